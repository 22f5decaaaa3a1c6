"""The Hugging Face mapping's edges (ultraep_jax.integrations.hf), on the families' fixtures
(tests/fixtures/hf): a block lacking a tensor names it, every missing or misshaped one in one
line; `to_hf` takes the state a user has (the layer, its Param-only state, gradients) and
writes a checkpoint's dtype; a config comes as a dict, a transformers-like object or a path;
`save_moe` writes a layer's block into a copy of a sharded bf16 checkpoint, bit for bit, every
other byte kept; torch's bfloat16 is read through its bits; `MoE.route` gives the layer's own
choices; configs with 0 or null where a count is read are what transformers makes of them, or
one line."""

from __future__ import annotations

import dataclasses
import filecmp
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import ultraep_jax as uep
from tests.helpers import assert_raises_one_line, make_mesh, place_batch
from tests.references.routing import Router, select_experts
from ultraep_jax.integrations import hf
from ultraep_jax.integrations.hf.arrays import as_numpy, from_bits

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf"


def _fixture(name: str):
    """(config dict, reference arrays, the block's tensors, the MoE block's decoder layer)."""
    folder = FIXTURES / name
    config = json.loads((folder / "config.json").read_text())
    ref = dict(np.load(folder / "reference.npz"))
    ckpt = hf.SafetensorsCheckpoint(folder / "model.safetensors")
    tensors = {k: ckpt.read(k, (slice(None),) * len(ckpt.shape(k))) for k in ckpt.keys()}
    return config, ref, tensors, int(ref["layer"])


def _loaded(config, source, layer_index, mesh_kind="ep8", **options):
    """An abstract `uep.MoE` for ``config`` filled by `hf.load_moe` from ``source``."""
    mesh = make_mesh(mesh_kind)
    layer = nnx.eval_shape(
        lambda: uep.MoE(mesh=mesh, rngs=nnx.Rngs(0), **hf.moe_kwargs(config), **options)
    )
    hf.load_moe(layer, config, source, layer_index)
    return layer


# 1. A block lacking a tensor names it (every missing or misshaped one, in one line).


@pytest.mark.parametrize(
    "name, tensor",
    [
        ("qwen2_moe", "experts.0.up_proj.weight"),
        ("qwen2_moe", "shared_expert_gate.weight"),
        ("deepseek_v3", "gate.e_score_correction_bias"),
        ("gpt_oss", "experts.down_proj_bias"),
    ],
)
def test_a_missing_tensor_of_the_layout_is_named(name, tensor):
    """The tensors the layout is told by were reported as no MoE block at all, naming the router
    (which is there)."""
    config, _, tensors, i = _fixture(name)
    full = f"model.layers.{i}.mlp.{tensor}"
    del tensors[full]
    assert_raises_one_line(ValueError, rf"^hf: .*: no {full}$", hf.from_hf, config, tensors, i)
    assert_raises_one_line(ValueError, rf": no {full}$", _loaded, config, tensors, i)


def test_every_problem_of_a_block_is_listed():
    config, _, tensors, i = _fixture("deepseek_v3")
    prefix = hf.block_prefix(config, i, "checkpoint")
    for e in (0, 5):
        del tensors[f"{prefix}experts.{e}.down_proj.weight"]
    tensors[prefix + "gate.weight"] = np.zeros((8, 17), np.float32)
    del tensors[prefix + "shared_experts.up_proj.weight"]
    with pytest.raises(ValueError) as info:
        hf.from_hf(config, tensors, i)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"hf: the MoE block {prefix}*")
    for problem in (
        f"no {prefix}experts.0.down_proj.weight",
        f"no {prefix}experts.5.down_proj.weight",
        f"{prefix}gate.weight has shape (8, 17) where the config implies (8, 16)",
        f"no {prefix}shared_experts.up_proj.weight",
    ):
        assert problem in message, (problem, message)
    assert message.count("; ") == 3


def test_no_tensor_of_the_block_is_no_block():
    config, _, tensors, i = _fixture("deepseek_v3")
    assert_raises_one_line(
        ValueError, "no MoE block of layer 0", hf.from_hf, config, tensors, i - 1
    )


# 2. to_hf takes the layer's own state; gradients map to transformers' names.


def test_to_hf_takes_the_layers_param_state():
    """A Param-only state raised KeyError: 'router_bias' (a RouterBias is no nnx.Param)."""
    config, _, tensors, i = _fixture("deepseek_v3")
    layer = _loaded(config, tensors, i)
    bias = hf.block_prefix(config, i, "checkpoint") + "gate.e_score_correction_bias"
    for params in (nnx.to_pure_dict(nnx.state(layer, nnx.Param)), nnx.state(layer, nnx.Param)):
        back = hf.to_hf(config, params, i)
        assert sorted(back) == sorted(set(tensors) - {bias})  # the bias is no parameter
        for k, v in back.items():
            np.testing.assert_array_equal(v, tensors[k], err_msg=k)
    whole = hf.to_hf(config, layer, i)  # the layer itself: every tensor, its bias too
    assert sorted(whole) == sorted(tensors)
    np.testing.assert_array_equal(whole[bias], tensors[bias])
    params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    del params["w_up"], params["shared_down"]
    assert_raises_one_line(
        ValueError,
        r"^hf: the variables have no w_up, shared_down: pass ",
        hf.to_hf,
        config,
        params,
        i,
    )


def test_gradients_map_to_transformers_names():
    """The layer's gradients (an nnx.State of Params) as transformers' param.grad names."""
    config, _, tensors, i = _fixture("qwen2_moe")
    layer = _loaded(config, tensors, i, capacity_factor=None)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4, config["hidden_size"])))
    grads = nnx.grad(lambda m: jnp.sum(m(x.astype(jnp.float32))[0] ** 2))(layer)
    named = hf.to_hf(config, grads, i, layout="module")
    prefix = hf.block_prefix(config, i, "module")
    assert sorted(named) == sorted(
        prefix + n
        for n in (
            "gate.weight",
            "experts.gate_up_proj",
            "experts.down_proj",
            "shared_expert.gate_proj.weight",
            "shared_expert.up_proj.weight",
            "shared_expert.down_proj.weight",
            "shared_expert_gate.weight",
        )
    )
    g = jax.device_get(grads["w_down"][...])
    np.testing.assert_array_equal(named[prefix + "experts.down_proj"], np.swapaxes(g, -1, -2))


# 3. A config as a dict, an object with to_dict() or a path.


class _Config:
    """Stands in for a transformers config: what the mapping uses of one is ``to_dict()``."""

    def __init__(self, values):
        self._values = dict(values)

    def to_dict(self):
        return dict(self._values)


def test_config_as_object_or_path(tmp_path):
    config, _, tensors, i = _fixture("deepseek_v3")
    folder = FIXTURES / "deepseek_v3"
    want = hf.moe_kwargs(config)
    forms = (_Config(config), folder / "config.json", str(folder), folder)
    for form in forms:
        assert hf.moe_kwargs(form) == want, form
        assert hf.moe_layers(form) == hf.moe_layers(config), form
    params = hf.from_hf(_Config(config), tensors, i)
    back = hf.to_hf(str(folder), params, i)
    assert sorted(back) == sorted(tensors)
    assert_raises_one_line(TypeError, "^hf: config must be a dict, ", hf.moe_kwargs, 3)
    assert_raises_one_line(FileNotFoundError, "^hf: no config.json at ", hf.moe_kwargs, tmp_path)
    (tmp_path / "config.json").write_text("{")
    assert_raises_one_line(ValueError, "is not a JSON config", hf.moe_kwargs, tmp_path)


# 4. save_moe: the block written into a copy of a sharded bf16 checkpoint.


def _full_checkpoint(folder: pathlib.Path, config, tensors):
    """A save_pretrained-like folder: two shards with an index, bf16 weights, the router's
    choice bias in float32 (as DeepSeek-V3's), other tensors beside the block, {"format": "pt"}
    metadata, a config.json and another file."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    D = config["hidden_size"]
    others = {
        "model.embed_tokens.weight": rng.normal(size=(32, D)),
        "model.layers.0.mlp.gate_proj.weight": rng.normal(size=(24, D)),
        "lm_head.weight": rng.normal(size=(32, D)),
    }
    every = {k: v.astype(ml_dtypes.bfloat16) for k, v in (others | tensors).items()}
    every = {k: v.astype(np.float32) if "bias" in k else v for k, v in every.items()}
    names = sorted(every)
    shards = {"model-00001-of-00002.safetensors": names[::2]}
    shards["model-00002-of-00002.safetensors"] = names[1::2]
    folder.mkdir()
    for file, part in shards.items():
        save_file({k: every[k] for k in part}, str(folder / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}}
    index["weight_map"] = {k: file for file, part in shards.items() for k in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text("{}")
    return every


def _read_all(folder: pathlib.Path):
    """Every tensor of the folder's safetensors files (numpy, bf16 as ml_dtypes'), and each
    file's metadata."""
    from safetensors import safe_open

    tensors, metadata = {}, {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            metadata[file.name] = f.metadata()
            tensors |= {k: f.get_tensor(k) for k in f.keys()}
    return tensors, metadata


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def test_save_moe_writes_the_block_into_a_copy(tmp_path):
    config, _, tensors, i = _fixture("deepseek_v3")
    source = tmp_path / "ckpt"
    saved = _full_checkpoint(source, config, tensors)
    layer = _loaded(config, hf.SafetensorsCheckpoint(source), i)
    rng = np.random.default_rng(2)
    for name in ("w_gate", "w_down", "router_kernel", "router_bias", "shared_up"):
        var = getattr(layer, name)  # values bf16 cannot hold: rounding is part of the write
        var[...] = var[...] * 1.37 + jnp.asarray(rng.normal(size=var.shape), var.dtype) * 1e-3
    out = tmp_path / "out"
    changed = hf.save_moe(layer, config, source, out, i)
    assert sorted(p.name for p in changed) == sorted(p.name for p in source.glob("*.safetensors"))
    got, metadata = _read_all(out)
    assert all(m == {"format": "pt"} for m in metadata.values()), metadata
    block = hf.to_hf(config, layer, i)
    assert set(block) < set(got)
    for k, v in got.items():
        assert v.dtype == saved[k].dtype, k
        want = block[k].astype(saved[k].dtype) if k in block else saved[k]
        np.testing.assert_array_equal(_bits(v), _bits(want), err_msg=k)
    in_bf16 = hf.to_hf(config, layer, i, dtype=jnp.bfloat16)
    for k, v in in_bf16.items():
        assert v.dtype == jnp.bfloat16
        if saved[k].dtype == v.dtype:
            np.testing.assert_array_equal(_bits(v), _bits(got[k]), err_msg=k)
    for file in ("config.json", "generation_config.json", "model.safetensors.index.json"):
        assert filecmp.cmp(source / file, out / file, shallow=False), file
    # The source is untouched; loading the copy gives the layer back (bf16-rounded).
    assert _read_all(source)[0].keys() == saved.keys()
    for k, v in _read_all(source)[0].items():
        np.testing.assert_array_equal(_bits(v), _bits(saved[k]), err_msg=k)
    again = _loaded(config, hf.SafetensorsCheckpoint(out), i)
    for name in ("w_gate", "router_bias"):
        value = np.asarray(getattr(again, name)[...])
        assert value.dtype == np.float32
        np.testing.assert_allclose(value, np.asarray(getattr(layer, name)[...]), rtol=1e-2)


def test_save_moe_refusals(tmp_path):
    config, _, tensors, i = _fixture("deepseek_v3")
    source = tmp_path / "ckpt"
    _full_checkpoint(source, config, tensors)
    layer = _loaded(config, hf.SafetensorsCheckpoint(source), i)
    params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    assert_raises_one_line(
        ValueError,
        r"give no model\.layers\.1\.mlp\.gate\.e_score_correction_bias: pass the layer",
        hf.save_moe,
        params,
        config,
        source,
        tmp_path / "a",
        i,
    )
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert_raises_one_line(
        FileExistsError,
        "is not an empty folder",
        hf.save_moe,
        layer,
        config,
        source,
        tmp_path / "full",
        i,
    )
    # In place: the folder itself, the next layer into the same copy.
    hf.save_moe(layer, config, source, source, i)
    np.testing.assert_array_equal(
        hf.SafetensorsCheckpoint(source).read(
            f"model.layers.{i}.mlp.gate.e_score_correction_bias", (slice(None),)
        ),
        np.asarray(layer.router_bias[...]),
    )


# 5. torch's bfloat16 through its bits.


def test_bfloat16_from_its_bits():
    values = np.array([[1.0, -2.5], [3.140625, 0.0078125]], ml_dtypes.bfloat16)
    for bits in (values.view(np.int16), values.view(np.uint16)):
        got = from_bits(bits, "bfloat16")
        assert got.dtype == ml_dtypes.bfloat16 and got.shape == (2, 2)
        np.testing.assert_array_equal(got.astype(np.float32), values.astype(np.float32))
    e4m3 = np.array([1.0, -448.0], ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(from_bits(e4m3.view(np.uint8), "float8_e4m3fn"), e4m3)
    assert_raises_one_line(
        TypeError, "bfloat16 needs 2-byte", from_bits, np.zeros(2, np.uint8), "bfloat16"
    )
    assert as_numpy(values) is values or np.array_equal(as_numpy(values), values)


def test_bfloat16_torch_state_dict():
    """Runs where torch is installed (the tests do not need it): a bf16 state_dict gave torch's
    "Got unsupported ScalarType BFloat16"."""
    torch = pytest.importorskip("torch")
    config, _, tensors, i = _fixture("qwen3_moe")
    state = {k: torch.from_numpy(v).to(torch.bfloat16).requires_grad_() for k, v in tensors.items()}
    params = hf.from_hf(config, state, i)
    want = hf.from_hf(config, {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, i)
    for var, v in params.items():
        assert v.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(_bits(v), _bits(want[var]), err_msg=var)


# 6. MoE.route: the layer's own choice per token.


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss", "qwen2_moe"])
def test_route_is_the_layers_choice(name):
    """Each token's experts and weights equal transformers' routing (the fixture's), from x on
    the host or on the layer's mesh, and the layer's call routes by the same choices (its
    stats' expert loads)."""
    config, ref, tensors, i = _fixture(name)
    layer = _loaded(config, tensors, i, mesh_kind="dp2ep4", capacity_factor=None)
    x = ref["x"]
    K = layer.top_k
    for placed in (x, place_batch(make_mesh("dp2ep4"), x)):
        routing = layer.route(placed)
        assert routing.experts.shape == routing.weights.shape == (*x.shape[:2], K)
        experts = np.asarray(routing.experts).reshape(-1, K)
        order = np.argsort(experts, axis=-1)
        np.testing.assert_array_equal(np.take_along_axis(experts, order, -1), ref["experts"])
        weights = np.asarray(routing.weights).reshape(-1, K)
        np.testing.assert_allclose(
            np.take_along_axis(weights, order, -1), ref["weights"], rtol=1e-5
        )
    _, stats = layer(place_batch(make_mesh("dp2ep4"), x))
    counts = np.bincount(np.asarray(routing.experts).ravel(), minlength=layer.num_experts)
    np.testing.assert_array_equal(np.asarray(stats.expert_load), counts)
    assert_raises_one_line(
        ValueError, r"^MoE: x must be \[\.\.\., d_model=", layer.route, x[..., :3]
    )


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_group_masking_is_transformers(name):
    """transformers' DeepSeek-V3 and GLM-4.5 routers fill the dropped groups' experts with 0.0
    before the top-k (DeepSeek's own reference code with -inf, the layer's default): under a
    strongly negative ``e_score_correction_bias`` the two rules choose differently, and the
    router `hf.moe_kwargs` builds chooses as transformers' rule does (its NumPy transcription).
    GLM-4.5's configs have one group; here both take 4 groups, 2 kept."""
    config = dict(_fixture(name)[0], n_group=4, topk_group=2)
    router = hf.moe_kwargs(config)["router"]
    assert router.masked_group_score == 0.0
    rng = np.random.default_rng(11)
    E = hf.moe_kwargs(config)["num_experts"]
    logits = rng.normal(size=(64, E)).astype(np.float32)
    bias = (-0.6 + 0.3 * rng.normal(size=E)).astype(np.float32)
    rule = Router(
        "sigmoid", router.top_k, router.renormalize, 4, 2, router.scale, masked_group_score=0.0
    )
    experts, margin = select_experts(logits, rule, bias)
    assert margin > 1e-6  # no near-tie decides the choice
    deepseek_rule = dataclasses.replace(rule, masked_group_score=-np.inf)
    deepseek, _ = select_experts(logits, deepseek_rule, bias)
    assert (np.sort(experts, -1) != np.sort(deepseek, -1)).any(), "the rules chose alike"
    routing = jax.jit(router)(jnp.asarray(logits), jnp.asarray(bias))
    np.testing.assert_array_equal(np.asarray(routing.experts), experts)


# 10. Configs with 0 or null where a count is read.


def test_no_shared_expert_with_n_shared_experts_0():
    """n_shared_experts: 0 crashed from_hf, to_hf and load_moe with KeyError: 'shared_gate';
    transformers builds zero-width shared experts (nothing), which the mapping leaves out."""
    config, _, tensors, i = _fixture("deepseek_v3")
    config = dict(config, n_shared_experts=0)
    assert hf.moe_kwargs(config)["shared_d_ff"] == 0
    params = hf.from_hf(config, tensors, i)
    assert not any(k.startswith("shared") for k in params)
    back = hf.to_hf(config, params, i)
    assert sorted(back) == sorted(k for k in tensors if ".shared_experts." not in k)
    layer = _loaded(config, tensors, i)
    assert not hasattr(layer, "shared_gate")
    qwen, _, qwen_tensors, j = _fixture("qwen2_moe")
    qwen = dict(qwen, shared_expert_intermediate_size=0)
    assert hf.moe_kwargs(qwen)["shared_expert_gate"] is False
    assert "shared_expert_gate" not in hf.from_hf(qwen, qwen_tensors, j)


def test_null_and_zero_counts_are_transformers_or_one_line():
    config, _, _, _ = _fixture("deepseek_v3")
    # transformers' config refuses null for n_shared_experts (a field typed int): so do we.
    assert_raises_one_line(
        ValueError,
        r"^hf: the deepseek_v3 config's n_shared_experts is null, .*0: no shared",
        hf.moe_kwargs,
        dict(config, n_shared_experts=None),
    )
    # A null norm_topk_prob is None in transformers, falsy: no renormalisation.
    router = hf.moe_kwargs(dict(config, norm_topk_prob=None))["router"]
    assert router.renormalize is False
    qwen, _, _, _ = _fixture("qwen2_moe")
    assert_raises_one_line(
        ValueError,
        r"^hf: the qwen2_moe config has decoder_sparse_step=0; ",
        hf.moe_layers,
        dict(qwen, decoder_sparse_step=0),
    )
    # transformers builds a MoE block only where num_experts > 0.
    none = dict(qwen, num_experts=0, decoder_sparse_step=0)
    assert hf.moe_layers(none) == ()
    assert_raises_one_line(ValueError, "num_experts=0: no decoder layer", hf.moe_kwargs, none)
    # transformers' Qwen configs turn a null mlp_only_layers into [].
    no_dense = hf.moe_layers(dict(qwen, mlp_only_layers=[]))
    assert hf.moe_layers(dict(qwen, mlp_only_layers=None)) == no_dense
    mixtral, _, _, _ = _fixture("mixtral")
    assert_raises_one_line(
        ValueError,
        "num_local_experts=0; its MoE block needs experts",
        hf.moe_kwargs,
        dict(mixtral, num_local_experts=0),
    )
