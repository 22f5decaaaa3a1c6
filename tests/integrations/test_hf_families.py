"""Hugging Face's MoE blocks through `uep.MoE` (ultraep_jax.integrations.hf): each family's
block as transformers computes it (tests/fixtures/hf, written by ``python -m
experiments.hf_fixtures``: transformers' own block, its checkpoint as ``save_pretrained`` writes
it, its output and gradients), against the layer the fixture's config.json implies, loaded from
that checkpoint onto a (data 2, expert 4) mesh: the same experts for every token, y and every
gradient within float32 rounding, balanced (replicas made) and not. The mapping's round trip is
exact in both layouts, a load reads each device's block only, and the real models' configs give
the layers they describe."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ultraep_jax as uep
from tests.helpers import assert_raises_one_line, make_mesh, place_batch
from ultraep_jax.integrations import hf
from ultraep_jax.routers import router_logits

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf"
FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
#: Replicas for the skewed fixtures' 32 tokens per EP group.
BALANCER = uep.BalancerConfig(slots_per_rank=1, min_tokens_per_replica=1, min_tokens_per_rank=1)
#: float32 rounding of a block of this size (the largest measured: 6.0e-7).
RTOL = 1e-5


def _fixture(name: str):
    """(config dict, reference arrays, the checkpoint, the MoE block's decoder layer)."""
    folder = FIXTURES / name
    config = json.loads((folder / "config.json").read_text())
    ref = dict(np.load(folder / "reference.npz"))
    return config, ref, hf.SafetensorsCheckpoint(folder / "model.safetensors"), int(ref["layer"])


def _module_grads(ref, config, layer):
    """The reference's gradients (module names, fused experts) as the layer's variables."""
    prefix = hf.block_prefix(config, layer, "module")
    grads = {prefix + k.removeprefix("grad:"): v for k, v in ref.items() if k.startswith("grad:")}
    for var, piece in hf.mapping.pieces(config, "module").items():
        if var == "router_bias":  # a buffer: no gradient; zeros keep the layout whole
            grads[prefix + piece.name] = np.zeros(hf.layer_shapes(config)[var], np.float32)
    got = hf.from_hf(config, grads, layer, layout="module")
    got.pop("router_bias", None)
    return got


def _max_rel(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))


def test_fixtures_cover_the_families():
    assert FAMILIES == sorted([*hf.FAMILIES, "deepseek_v3_unnormalized"])
    versions = json.loads((FIXTURES / "versions.json").read_text())
    assert {"torch", "transformers", "safetensors", "numpy"} <= set(versions)


@pytest.mark.parametrize("name", FAMILIES)
def test_mapping_round_trip_is_exact(name):
    config, ref, ckpt, layer = _fixture(name)
    tensors = {k: ckpt.read(k, (slice(None),) * len(ckpt.shape(k))) for k in ckpt.keys()}
    params = hf.from_hf(config, tensors, layer)
    back = hf.to_hf(config, params, layer)
    assert sorted(back) == sorted(tensors)
    for k, v in tensors.items():
        np.testing.assert_array_equal(back[k], v, err_msg=k)
    # Through the other layout and back: the same variables, bit for bit.
    module = hf.to_hf(config, params, layer, layout="module")
    one_layout = hf.family_of(config).gpt_oss  # its checkpoints hold the module's tensors
    assert (sorted(module) == sorted(tensors)) == one_layout
    for var, v in hf.from_hf(config, module, layer).items():
        np.testing.assert_array_equal(v, params[var], err_msg=var)


#: The families whose block test runs on CI's 3.11 line only (marked slow; every family's
#: routing rules still run there): the others cover softmax, sigmoid-grouped and clamped-SwiGLU
#: routing on every line.
SLOW_FAMILIES = {"deepseek_v3_unnormalized", "glm4_moe", "olmoe", "qwen2_moe"}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_FAMILIES else []) for n in FAMILIES],
)
def test_block_equals_transformers_balanced_and_not(name):
    """One program per family: routing, y and gradients of the balanced and the plain layer."""
    config, ref, ckpt, layer_index = _fixture(name)
    assert layer_index in hf.moe_layers(config)
    assert float(ref["margin"]) > 1e-4  # no near-tie decides a choice
    mesh = make_mesh("dp2ep4")
    kwargs = hf.moe_kwargs(config)
    layers = []
    for balancer in (BALANCER, None):
        layer = nnx.eval_shape(
            lambda b=balancer: uep.MoE(
                mesh=mesh, balancer=b, capacity_factor=None, rngs=nnx.Rngs(0), **kwargs
            )
        )
        hf.load_moe(layer, config, ckpt, layer_index)
        layers.append(nnx.split(layer, nnx.Param, ...))
    (graph_b, params_b, rest_b), (graph_p, params_p, rest_p) = layers
    cot = jnp.asarray(ref["cotangent"])

    moe = nnx.merge(graph_p, params_p, rest_p)
    router = moe.router
    # The router on host copies (the layer's arrays live on its own Auto-axes mesh).
    names = ("router_kernel", "router_bias", "router_logit_bias")
    kernel, bias, logit_bias = (
        jax.device_get(getattr(moe, n)[...]) if hasattr(moe, n) else None for n in names
    )

    @jax.jit
    def run(params_b, rest_b, params_p, rest_p, x, x_host):
        def value_and_grads(graph, params, rest):
            def loss(params, x):
                y, stats = nnx.merge(graph, params, rest)(x)
                return jnp.sum(y * cot), (y, stats)

            return jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x)

        x_TD = x_host.reshape(-1, x_host.shape[-1])
        routing = router(router_logits(x_TD, kernel, logit_bias), bias)
        balanced = value_and_grads(graph_b, params_b, rest_b)
        plain = value_and_grads(graph_p, params_p, rest_p)
        return routing, balanced, plain

    x = place_batch(mesh, ref["x"])
    routing, balanced, plain = run(params_b, rest_b, params_p, rest_p, x, ref["x"])
    order = np.argsort(np.asarray(routing.experts), axis=-1)
    experts = np.take_along_axis(np.asarray(routing.experts), order, -1)
    np.testing.assert_array_equal(experts, ref["experts"])
    weights = np.take_along_axis(np.asarray(routing.weights), order, -1)
    np.testing.assert_allclose(weights, ref["weights"], rtol=RTOL)
    want = _module_grads(ref, config, layer_index)
    ys = []
    for (g_params, g_x), (y, stats) in (balanced, plain):
        assert int(stats.dropped) == 0
        assert _max_rel(y, ref["y"]) < RTOL
        assert _max_rel(g_x, ref["grad_x"]) < RTOL
        for var, w in want.items():
            assert _max_rel(g_params[var][...], w) < RTOL, var
        ys.append((np.asarray(y), int(stats.replicas)))
    (y_bal, replicas), (y_plain, _) = ys
    assert replicas > 0  # the skewed input made replicas
    np.testing.assert_allclose(y_bal, y_plain, rtol=1e-6, atol=1e-6)


class _Recording(hf.SafetensorsCheckpoint):
    """A checkpoint that records each block it reads: (name, elements read)."""

    def __init__(self, path):
        super().__init__(path)
        self.reads = []

    def read(self, name, index):
        block = super().read(name, index)
        self.reads.append((name, block.size))
        return block


@pytest.mark.parametrize(
    "name, layout",
    [("deepseek_v3", "checkpoint"), ("qwen2_moe", "module"), ("gpt_oss", "checkpoint")],
)
def test_load_reads_each_device_block_once(name, layout, tmp_path):
    """On (expert 4, tensor 2), a read of an expert tensor is one device's block (a fused
    tensor: at most a quarter, one EP rank's experts; one expert's: half, its F split) and
    each element is read once; the arrays equal the whole-host mapping."""
    from safetensors.numpy import save_file

    config, _, ckpt, layer_index = _fixture(name)
    tensors = {k: ckpt.read(k, (slice(None),) * len(ckpt.shape(k))) for k in ckpt.keys()}
    params = hf.from_hf(config, tensors, layer_index)
    path = tmp_path / "block.safetensors"
    save_file(hf.to_hf(config, params, layer_index, layout=layout), str(path))
    source = _Recording(path)
    mesh = jax.make_mesh((4, 2), ("expert", "tensor"))
    layer = nnx.eval_shape(
        lambda: uep.MoE(mesh=mesh, tensor_axis="tensor", rngs=nnx.Rngs(0), **hf.moe_kwargs(config))
    )
    hf.load_moe(layer, config, source, layer_index)
    read = {}
    for tensor, size in source.reads:
        if ".experts." in tensor:
            whole = int(np.prod(source.shape(tensor)))
            per_expert = tensor.split(".experts.")[1][0].isdigit()
            assert size <= whole // (2 if per_expert else 4), (tensor, size, whole)
        read[tensor] = read.get(tensor, 0) + size
    assert read == {k: int(np.prod(source.shape(k))) for k in source.keys()}
    for var, want in params.items():
        value = getattr(layer, var)[...]
        assert value.sharding.is_equivalent_to(hf.loading.variable_sharding(layer, var), value.ndim)
        np.testing.assert_array_equal(np.asarray(value), want, err_msg=var)


def test_unusable_inputs_are_one_line():
    config, _, ckpt, layer_index = _fixture("qwen2_moe")
    assert_raises_one_line(
        ValueError, "not a supported MoE family", hf.moe_kwargs, {"model_type": "llama"}
    )
    tensors = {k: ckpt.read(k, (slice(None),) * len(ckpt.shape(k))) for k in ckpt.keys()}
    prefix = hf.block_prefix(config, layer_index, "checkpoint")
    missing = {k: v for k, v in tensors.items() if k != prefix + "experts.3.up_proj.weight"}
    assert_raises_one_line(
        ValueError, "no model.layers.1.mlp.experts.3.up_proj", hf.from_hf, config, missing, 1
    )
    wide = dict(tensors, **{prefix + "gate.weight": np.zeros((8, 17), np.float32)})
    assert_raises_one_line(
        ValueError, r"gate.weight has shape \(8, 17\)", hf.from_hf, config, wide, 1
    )
    assert_raises_one_line(ValueError, "no MoE block of layer 0", hf.from_hf, config, tensors, 0)
    mesh = make_mesh("ep8")
    other = nnx.eval_shape(
        lambda: uep.MoE(mesh=mesh, rngs=nnx.Rngs(0), **hf.moe_kwargs(config) | {"d_ff": 16})
    )
    assert_raises_one_line(
        ValueError, "build the layer with moe_kwargs", hf.load_moe, other, config, ckpt, 1
    )


#: The MoE keys of released models' config.json (hidden_size, ...), and what they imply.
RELEASED = {
    "DeepSeek-V3": (
        dict(
            model_type="deepseek_v3",
            hidden_size=7168,
            moe_intermediate_size=2048,
            n_routed_experts=256,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            n_shared_experts=1,
            first_k_dense_replace=3,
            num_hidden_layers=61,
            hidden_act="silu",
        ),
        dict(
            d_model=7168,
            d_ff=2048,
            num_experts=256,
            top_k=8,
            router=uep.SigmoidTopK(
                8, num_groups=8, top_groups=4, scale=2.5, masked_group_score=0.0
            ),
            shared_d_ff=2048,
            activation="silu",
        ),
        range(3, 61),
    ),
    "Qwen1.5-MoE-A2.7B": (
        dict(
            model_type="qwen2_moe",
            hidden_size=2048,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            num_experts=60,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            num_hidden_layers=24,
        ),
        dict(
            d_model=2048,
            d_ff=1408,
            num_experts=60,
            top_k=4,
            router=uep.SoftmaxTopK(4, renormalize=False),
            shared_d_ff=5632,
            shared_expert_gate=True,
            activation="silu",
        ),
        range(24),
    ),
    "GLM-4.5-Air": (
        dict(
            model_type="glm4_moe",
            hidden_size=4096,
            moe_intermediate_size=1408,
            n_routed_experts=128,
            num_experts_per_tok=8,
            n_shared_experts=1,
            routed_scaling_factor=1.0,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            num_hidden_layers=46,
        ),
        dict(
            d_model=4096,
            d_ff=1408,
            num_experts=128,
            top_k=8,
            router=uep.SigmoidTopK(8, masked_group_score=0.0),
            shared_d_ff=1408,
            activation="silu",
        ),
        range(1, 46),
    ),
    "gpt-oss-120b": (  # no swiglu_alpha: transformers' default, 1.702
        dict(
            model_type="gpt_oss",
            hidden_size=2880,
            intermediate_size=2880,
            num_local_experts=128,
            num_experts_per_tok=4,
            swiglu_limit=7.0,
            num_hidden_layers=36,
            hidden_act="silu",
        ),
        dict(
            d_model=2880,
            d_ff=2880,
            num_experts=128,
            top_k=4,
            router=uep.TopKSoftmax(4),
            shared_d_ff=0,
            activation=uep.ClampedSwiGLU(limit=7.0, alpha=1.702),
            router_logit_bias=True,
            expert_bias=True,
        ),
        range(36),
    ),
}


@pytest.mark.parametrize("model", sorted(RELEASED))
def test_released_configs_give_their_layers(model):
    config, want, layers = RELEASED[model]
    got = hf.moe_kwargs(config)
    assert {k: got[k] for k in want} == want
    assert hf.moe_layers(config) == tuple(layers)
