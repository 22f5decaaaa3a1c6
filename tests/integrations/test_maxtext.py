"""ultraep_jax as MaxText's MoE backend, against MaxText itself (the maxtext extra; CI's maxtext
line runs these, other lines skip them).

The reference for the block is MaxText's own dense dropless block (``sparse_matmul=False,
capacity_factor=-1``) on the same variables: its values, the gradients of x and of every weight
(the gate's included), its aux loss and its loss-free bias update. The reference for training is
MaxText's own trainer, unbalanced at EP = 1 (its EP > 1 does not compile on XLA:CPU), against
ours at EP4 x FSDP2: the same losses step by step.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

REQUIRE_ENV = "ULTRAEP_REQUIRE_MAXTEXT"
if importlib.util.find_spec("maxtext") is None:
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        raise RuntimeError(f"MaxText is not installed and {REQUIRE_ENV} is set")
    pytest.skip("MaxText is not installed (the maxtext extra)", allow_module_level=True)

os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")  # MaxText's CPU ("decoupled") mode

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import maxtext  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from flax.linen import partitioning as nn_partitioning  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from maxtext.configs import pyconfig  # noqa: E402
from maxtext.layers import initializers, moe  # noqa: E402
from maxtext.utils import maxtext_utils  # noqa: E402

import ultraep_jax as uep  # noqa: E402
from ultraep_jax.integrations import maxtext as uep_maxtext  # noqa: E402
from ultraep_jax.integrations.maxtext import __main__ as command  # noqa: E402
from ultraep_jax.integrations.maxtext.remat import with_saved  # noqa: E402
from ultraep_jax.integrations.maxtext.settings import (  # noqa: E402
    balancing_from_keys,
    split_keys,
)

pytestmark = pytest.mark.xdist_group("maxtext")

BASE_CONFIG = pathlib.Path(maxtext.__file__).parent / "configs" / "decoupled_base_test.yml"
#: The smallest MaxText run of each family: 2 decoder layers, the first dense where the family
#: has dense layers; float32 throughout; CPU.
TINY = dict(
    override_model_config=True,
    base_num_decoder_layers=2,
    vocab_size=256,
    max_target_length=16,
    per_device_batch_size=1,
    dtype="float32",
    weight_dtype="float32",
    dataset_type="synthetic",
    megablox=False,
    attention="dot_product",
    hardware="cpu",
    skip_jax_distributed_system=True,
    enable_checkpointing=False,
    run_name="ultraep_test",
)
SMALL_DIMS = dict(
    base_emb_dim=32,
    base_mlp_dim=32,
    base_moe_mlp_dim=32,
    base_num_query_heads=2,
    base_num_kv_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
)
#: Block configs: DeepSeek-V3's sigmoid router with its loss-free bias, the aux loss and a shared
#: expert (deepseek3-tiny, 16 experts, top-8); Mixtral's softmax top-2; gpt-oss's biased experts,
#: clamped unit and logit bias, with the experts' hidden width over a tensor axis.
BLOCKS = {
    "deepseek3_ep4_fsdp2": dict(
        model_name="deepseek3-tiny",
        first_num_dense_layers=1,
        routed_bias_update_rate=0.01,
        load_balance_loss_weight=0.01,
        ici_expert_parallelism=4,
        ici_fsdp_parallelism=2,
    ),
    "mixtral_ep4_fsdp2": dict(
        model_name="mixtral-8x7b",
        **SMALL_DIMS,
        load_balance_loss_weight=0.01,
        ici_expert_parallelism=4,
        ici_fsdp_parallelism=2,
    ),
    "gpt_oss_ep2_tp2_fsdp2": dict(
        model_name="gpt-oss-20b",
        **SMALL_DIMS,
        mlp_activations_limit=0.5,
        ici_expert_parallelism=2,
        ici_tensor_parallelism=2,
        ici_fsdp_parallelism=2,
    ),
}
#: Replicas from 32 tokens per device: thresholds low enough for the small shapes.
BALANCER = uep.BalancerConfig(slots_per_rank=2, min_tokens_per_replica=2, min_tokens_per_rank=1)


def maxtext_config(**overrides):
    """MaxText's config of its decoupled test base with ``TINY`` and ``overrides``."""
    keys = {**TINY, **overrides}
    return pyconfig.initialize(["", str(BASE_CONFIG)] + [f"{k}={v}" for k, v in keys.items()])


def routed_block(cfg, mesh=None):
    """MaxText's `RoutedMoE` of ``cfg`` on its mesh, as its decoder layers build it."""
    mesh = mesh or Mesh(maxtext_utils.create_device_mesh(cfg), cfg.mesh_axes)
    with nn_partitioning.axis_rules(cfg.logical_axis_rules):
        return moe.RoutedMoE(
            config=cfg,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            mesh=mesh,
            kernel_init=initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"),
            kernel_axes=("embed", None),
            intermediate_dim=cfg.moe_mlp_dim,
            dtype=cfg.dtype,
            weight_dtype=cfg.weight_dtype,
            rngs=nnx.Rngs(0),
        )


def value_and_grads(block, x, rules):
    """(y, aux loss, bias update), and the gradients of the block's weights and of x, of a
    loss that weighs every output element differently."""

    def loss(block, x):
        with nn_partitioning.axis_rules(rules):
            y, lb_loss, bias_updates = block(x)
        weights = jnp.cos(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape)
        total = jnp.sum(y * weights) + (0.0 if lb_loss is None else lb_loss)
        return total, (y, lb_loss, bias_updates)

    step = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    with jax.set_mesh(block.mesh):
        (_, outputs), grads = step(block, x)
    return outputs, grads


def relative_error(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_equals_maxtext_dense_block(name):
    overrides = BLOCKS[name]
    balanced_cfg = maxtext_config(sparse_matmul=True, **overrides)
    dense_cfg = maxtext_config(sparse_matmul=False, capacity_factor=-1, **overrides)
    balanced = routed_block(balanced_cfg)
    dense = routed_block(dense_cfg, balanced.mesh)
    nnx.update(dense, nnx.state(balanced))
    x = jax.random.normal(jax.random.key(1), (8, 16, balanced_cfg.emb_dim))

    (y_ref, lb_ref, bias_ref), (grads_ref, gx_ref) = value_and_grads(
        dense, x, dense_cfg.logical_axis_rules
    )
    with uep_maxtext.enabled(balancer=BALANCER):
        (y, lb, bias), (grads, gx) = value_and_grads(balanced, x, balanced_cfg.logical_axis_rules)

    ref = dict(nnx.to_flat_state(nnx.state(grads_ref, nnx.Param)))
    got = dict(nnx.to_flat_state(nnx.state(grads, nnx.Param)))
    assert got.keys() == ref.keys() and ("gate", "kernel") in ref
    errors = {"y": relative_error(y, y_ref), "dx": relative_error(gx, gx_ref)}
    errors |= {"d" + "/".join(p): relative_error(got[p][...], g[...]) for p, g in ref.items()}
    sown = {k: v.get_value()[-1] for k, v in nnx.state(balanced, nnx.Intermediate).items()}
    print(f"{name}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()), sown)  # -s shows
    assert max(errors.values()) < 1e-5, errors
    assert (lb is None) == (lb_ref is None)
    if lb_ref is not None:
        assert jnp.allclose(lb, lb_ref, rtol=1e-5)
    assert (bias is None) == (bias_ref is None)
    if bias_ref is not None:
        assert jnp.array_equal(bias, bias_ref)
    assert int(sown["ultraep_replicas"]) > 0 and int(sown["ultraep_dropped"]) == 0
    assert float(sown["ultraep_imbalance_after"]) < float(sown["ultraep_imbalance_before"])


#: A covered block the refusal tests change one setting of: Mixtral's, at EP4 x FSDP2.
COVERED = dict(BLOCKS["mixtral_ep4_fsdp2"], sparse_matmul=True)
REFUSED = {
    "te_moe_block": (
        dict(te_moe_block=True, prefuse_moe_weights=True, te_gmm_quantization="te_no_quant"),
        "te_moe_block",
    ),
    "dense_block": (dict(sparse_matmul=False), "sparse_matmul=False"),
    "ring_of_experts": (dict(use_ring_of_experts=True), "use_ring_of_experts"),
    "random_routing": (dict(use_random_routing=True), "use_random_routing"),
    "quantization": (dict(quantization="int8"), "quantization"),
    "activation": (dict(mlp_activations=["gelu", "tanh"]), "mlp_activations"),
    "explicit_sharding": (dict(shard_mode="explicit"), "shard_mode=explicit"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_uncovered_setting_is_refused_in_one_line(name):
    overrides, setting = REFUSED[name]
    cfg = maxtext_config(**{**COVERED, **overrides})
    block = routed_block(cfg)
    x = jnp.zeros((8, 16, cfg.emb_dim))
    with uep_maxtext.enabled(balancer=BALANCER), pytest.raises(ValueError) as caught:
        with nn_partitioning.axis_rules(cfg.logical_axis_rules), jax.set_mesh(block.mesh):
            block(x)
    message = str(caught.value)
    assert setting in message and "disable()" in message and "\n" not in message


def test_forced_routing_is_refused():
    cfg = maxtext_config(**COVERED)
    block = routed_block(cfg)
    x = jnp.zeros((8, 16, cfg.emb_dim))
    forced = jnp.zeros((8, 16, 2), jnp.int32)
    with uep_maxtext.enabled(balancer=BALANCER), pytest.raises(ValueError, match="forced_routed"):
        with nn_partitioning.axis_rules(cfg.logical_axis_rules), jax.set_mesh(block.mesh):
            block(x, forced_routed_experts=forced)


def test_disable_restores_maxtext_block():
    own = moe.RoutedMoE.sparse_matmul
    with uep_maxtext.enabled(balancer=None) as balancing:
        assert moe.RoutedMoE.sparse_matmul is not own and balancing.balancer is None
    assert moe.RoutedMoE.sparse_matmul is own and uep_maxtext.active() is None


def test_keys_split_off_and_checked():
    argv = ["a.yml", "steps=3", "ultraep_slots_per_rank=3", "--ultraep_planner=portable"]
    rest, keys = split_keys(argv)
    assert rest == ["a.yml", "steps=3"]
    balancing = balancing_from_keys(keys)
    assert balancing.balancer.slots_per_rank == 3 and balancing.execution.planner == "portable"
    assert balancing_from_keys({"balancer": "off"}).balancer is None
    assert balancing_from_keys({"capacity_factor": "1.1"}).capacity_factor == 1.1
    with pytest.raises(ValueError, match="unknown key.*ultraep_slots_per_rnk"):
        balancing_from_keys({"slots_per_rnk": "2"})
    with pytest.raises(ValueError, match="balancer=off with balancer settings"):
        balancing_from_keys({"balancer": "off", "slots_per_rank": "2"})
    with pytest.raises(ValueError, match="needs a value"):
        split_keys(["ultraep_planner"])


def test_remat_saved_adds_our_stages_to_maxtexts_policy(capsys):
    def f(x):
        a = jax.ad_checkpoint.checkpoint_name(jnp.sin(x), uep.remat.PLAN)
        b = jax.ad_checkpoint.checkpoint_name(jnp.sin(a), "mlpwo")
        c = jax.ad_checkpoint.checkpoint_name(jnp.sin(b), uep.remat.RETURNED)
        return jnp.sum(jnp.sin(c))

    minimal = jax.checkpoint_policies.save_only_these_names("mlpwo")  # one of MaxText's
    for policy, saved in ((None, {uep.remat.PLAN}), (minimal, {uep.remat.PLAN, "mlpwo"})):
        checked = jax.checkpoint(f, policy=with_saved(policy, (uep.remat.PLAN,)))
        jax.ad_checkpoint.print_saved_residuals(checked, jnp.ones(3))
        assert set(re.findall(r"named '(\w+)'", capsys.readouterr().out)) == saved
    assert with_saved(minimal, ()) is minimal
    assert balancing_from_keys({"remat": "plan,returned"}).remat_saved == (
        uep.remat.PLAN,
        uep.remat.RETURNED,
    )
    with pytest.raises(ValueError, match="unknown stage.*plans"):
        balancing_from_keys({"remat": "plans"})


def test_command_help_names_every_key(capsys):
    assert command.main(["prog", "--help"]) == 0
    out = capsys.readouterr().out
    assert "ultraep_slots_per_rank" in out and "ultraep_capacity_factor" in out
    assert command.main(["prog", "a.yml", "ultraep_nope=1"]) == 2
    assert "unknown key" in capsys.readouterr().err


#: MaxText's source of its MoE blocks, the one the integration's allow-list is checked against.
MOE_SOURCE = pathlib.Path(moe.__file__)


def sparse_path_reads(source: str) -> dict[str, set[str]]:
    """{config field: the functions that read it} of `RoutedMoE.sparse_matmul` and every method
    of `RoutedMoE` and function of the module it calls, transitively: each
    ``self.config.<name>``, ``cfg.<name>``, ``config.<name>`` and ``getattr(<one of them>,
    "<name>", ...)``."""
    tree = ast.parse(source)
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    routed = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RoutedMoE")
    methods = {n.name: n for n in routed.body if isinstance(n, ast.FunctionDef)}

    def is_config(node):
        if isinstance(node, ast.Name):
            return node.id in ("cfg", "config")
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "config"
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        )

    reads, todo, seen = {}, [methods["sparse_matmul"]], set()
    while todo:
        function = todo.pop()
        if function.name in seen:
            continue
        seen.add(function.name)
        for node in ast.walk(function):
            name = None
            if isinstance(node, ast.Attribute) and is_config(node.value):
                name = node.attr
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr":
                field = node.args[1] if len(node.args) > 1 else None
                if is_config(node.args[0]) and isinstance(field, ast.Constant):
                    name = field.value
            if name is not None:
                reads.setdefault(name, set()).add(function.name)
            if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "self":
                todo.extend([methods[node.attr]] if node.attr in methods else [])
            if isinstance(node, ast.Name) and node.id in functions:
                todo.append(functions[node.id])
    return reads


def test_every_setting_the_sparse_path_reads_is_covered_or_refused():
    """The allow-list against MaxText's source: every config field its sparse path reads is
    covered or refused away from its default, and a config with one refused field set away from
    it is refused at config time, naming it."""
    from ultraep_jax.integrations.maxtext import coverage  # noqa: PLC0415

    reads = sparse_path_reads(MOE_SOURCE.read_text())
    listed = coverage.COVERED.keys() | coverage.REFUSED.keys()
    unlisted = {name: sorted(where) for name, where in reads.items() if name not in listed}
    assert not unlisted, f"MaxText's sparse path reads settings not in coverage: {unlisted}"
    assert not coverage.COVERED.keys() & coverage.REFUSED.keys()
    named_in_issue = {
        "moe_dropless_fallback",
        "num_moe_token_chunks",
        "log_required_ragged_buffer_factor",
        "moe_quantize_token_all_gather",
        "use_custom_sort_vjp",
    }
    assert named_in_issue <= reads.keys() and named_in_issue <= coverage.REFUSED.keys()

    cfg = maxtext_config(**COVERED)
    assert listed <= cfg.get_keys().keys() and coverage.config_refusal(cfg) is None
    away = {
        "quantization": "int8",
        "shard_mode": "explicit",
        "moe_quantize_combine_bwd_method": "rowwise",
        "moe_dropless_fallback": "layer",
        "matmul_precision": "highest",
        "moe_routing_maps": "device",
    }
    for name, default in coverage.defaults().items():
        if name not in away:
            away[name] = not default if isinstance(default, bool) else default + 2
        value = away[name]
        fields = cfg._pydantic_config.model_copy(update={name: value})
        changed = pyconfig.HyperParameters(fields)
        reason = coverage.config_refusal(changed)
        assert reason is not None and reason.startswith(f"{name}="), (name, reason)
        assert "\n" not in reason


def test_command_refuses_an_uncovered_model_before_building_it(capsys, monkeypatch):
    """Llama4 through the command: one line naming the setting, as soon as MaxText's config is
    read (the trainer's loop, which builds the model, never starts)."""
    from maxtext.trainers.pre_train import train  # noqa: PLC0415

    from ultraep_jax.integrations.maxtext import metrics  # noqa: PLC0415

    def built(*args, **kwargs):
        raise AssertionError("the trainer started building the model")

    monkeypatch.setattr(train, "train_loop", built)
    monkeypatch.setenv("LIBTPU_INIT_ARGS", os.environ.get("LIBTPU_INIT_ARGS", ""))
    prng = jax.config.jax_default_prng_impl  # MaxText's trainer sets its own
    keys = {**TINY, **SMALL_DIMS, "model_name": "llama4-17b-16e", "num_experts_per_tok": 1}
    argv = ["prog", str(BASE_CONFIG)] + [f"{k}={v}" for k, v in keys.items()]
    try:
        assert command.main(argv) == 2
    finally:
        jax.config.update("jax_default_prng_impl", prng)
        metrics.uninstall()
        uep_maxtext.disable()
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "decoder_block=llama4" in errors[0], errors


def test_untested_maxtext_release_is_refused_unless_allowed(monkeypatch):
    from ultraep_jax.integrations.maxtext import coverage, settings  # noqa: PLC0415

    monkeypatch.setattr(coverage, "installed_version", lambda: "0.2.6")
    with pytest.raises(ValueError) as caught:
        uep_maxtext.enable(balancer=BALANCER)
    message = str(caught.value)
    assert "0.2.5" in message and "0.2.6" in message and "\n" not in message
    assert "allow_untested_maxtext=True" in message and uep_maxtext.active() is None
    with uep_maxtext.enabled(balancer=BALANCER, allow_untested_maxtext=True) as balancing:
        assert uep_maxtext.active() is balancing
    _, keys = split_keys(["a.yml", "ultraep_allow_untested_maxtext=true"])
    assert settings.command_settings(keys)[1] is True
    assert settings.command_settings({})[1] is False


def test_names_and_values_as_users_write_them(capsys):
    """One spelling of the remat stages in both places, non-finite numbers said as such, the
    defaults in --help."""
    for names in (("plan",), (uep.remat.PLAN,), "plan"):
        assert uep_maxtext.Balancing(remat_saved=names).remat_saved == (uep.remat.PLAN,)
    assert uep_maxtext.Balancing(remat_saved="all").remat_saved == uep.remat.NAMES
    keys = {"remat": f"dispatch,{uep.remat.PLAN}"}
    assert balancing_from_keys(keys).remat_saved == (uep.remat.DISPATCH, uep.remat.PLAN)
    for text in ("nan", "inf", "-inf"):
        with pytest.raises(ValueError, match=f"ultraep_balance_eps={text} is not a finite number"):
            balancing_from_keys({"balance_eps": text})
    assert command.main(["prog", "--help"]) == 0
    out = capsys.readouterr().out
    for key, default in (("min_tokens_per_replica", 1024), ("min_tokens_per_rank", 256)):
        assert re.search(rf"ultraep_{key}: .*\(default {default}\b", out), key


def stats_tree(stats: dict) -> dict:
    """MaxText's intermediates of a scanned decoder's MoE layers with the sown ``stats``
    ({stat: [layers]})."""
    sown = {f"ultraep_{k}": (jnp.asarray(v),) for k, v in stats.items()}
    return {"decoder": {"moe_layers": {"MoeBlock_0": sown}}}


def test_gradient_accumulation_reports_ratio_means_and_count_sums():
    """MaxText sums the intermediates over the microbatches of gradient accumulation: the
    imbalance ratios are reported as their means over the microbatches, the counts as sums."""
    from ultraep_jax.integrations.maxtext import metrics  # noqa: PLC0415

    microbatches = [  # per microbatch, per layer (3 MoE layers)
        dict(
            imbalance_before=[1.176, 1.25, 1.05],
            imbalance_after=[1.008, 1.0, 1.016],
            dropped=[0, 2, 0],
            replicas=[3, 1, 2],
        ),
        dict(
            imbalance_before=[1.176, 1.5, 1.1],
            imbalance_after=[1.008, 1.125, 1.0],
            dropped=[1, 0, 0],
            replicas=[2, 2, 0],
        ),
    ]
    summed = jax.tree.map(lambda *x: sum(x), *map(stats_tree, microbatches))  # as MaxText
    recorded = {"scalar": {}}
    config = types.SimpleNamespace(gradient_accumulation_steps=2, record_internal_nn_metrics=0)
    metrics._record(recorded, summed, config)
    got = recorded["scalar"]
    for stat in microbatches[0]:
        per_micro = np.array([m[stat] for m in microbatches], np.float64)  # [2, layers]
        ratio = stat.startswith("imbalance")
        per_layer = per_micro.mean(0) if ratio else per_micro.sum(0)
        over_layers = per_layer.max() if ratio else per_layer.sum()
        np.testing.assert_allclose(float(got[f"ultraep/{stat}"]), over_layers, rtol=1e-6)
        for i, value in enumerate(per_layer):
            np.testing.assert_allclose(float(got[f"ultraep/layer_{i:03d}/{stat}"]), value, 1e-6)


def test_metrics_hook_hands_train_step_a_real_config(monkeypatch):
    """`train_step` gets a `HyperParameters` (no proxy) with record_internal_nn_metrics on and
    every other setting MaxText's; MaxText's own activation metrics only where its config asks;
    a trainer whose step did not record the stats is refused in one line."""
    from ultraep_jax.integrations.maxtext import metrics  # noqa: PLC0415

    seen = []
    monkeypatch.setitem(metrics._ORIGINAL, "train_step", lambda _m, config, *a: seen.append(config))
    cfg = maxtext_config(**COVERED)
    on = pyconfig.HyperParameters(
        cfg._pydantic_config.model_copy(update={"record_internal_nn_metrics": 1})
    )
    for config in (cfg, cfg, on):
        metrics._train_step(None, config, "state", "data")
    recording = seen[0]
    assert type(recording) is pyconfig.HyperParameters and seen[1] is recording and seen[2] is on
    assert recording.record_internal_nn_metrics and not cfg.record_internal_nn_metrics
    rest = {k: v for k, v in recording.get_keys().items() if k != "record_internal_nn_metrics"}
    assert rest == {k: v for k, v in cfg.get_keys().items() if k != "record_internal_nn_metrics"}
    assert copy.deepcopy(recording).record_internal_nn_metrics

    own = []
    monkeypatch.setitem(metrics._ORIGINAL, "record_activation_metrics", lambda *a: own.append(a))
    for config in (recording, on):
        metrics._record({"scalar": {}}, stats_tree(dict(dropped=[0])), config)
    assert len(own) == 1 and own[0][2] is on

    logged = []
    monkeypatch.setitem(metrics._ORIGINAL, "log", lambda *a: logged.append(a))
    logger = types.SimpleNamespace(config=cfg)
    unrecorded = {"scalar": {"learning/loss": 1.0}}
    metrics._log(logger, unrecorded, 0)  # nothing balanced: MaxText's own log
    with uep_maxtext.enabled(balancer=BALANCER), pytest.raises(RuntimeError) as caught:
        metrics._log(logger, unrecorded, 1)
    assert len(logged) == 1 and "pre_train" in str(caught.value) and "\n" not in str(caught.value)


def test_command_without_maxtext_says_how_to_install():
    """The command in a Python without MaxText (its import blocked): one line naming the extra
    and docs/maxtext.md, a non-zero exit."""
    without = (
        "import runpy, sys; sys.modules['maxtext'] = None; "
        "runpy.run_module('ultraep_jax.integrations.maxtext', run_name='__main__', alter_sys=True)"
    )
    checkout = pathlib.Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", without, "a.yml", "steps=1"],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert 'pip install ".[maxtext]"' in lines[0] and "docs/maxtext.md" in lines[0]


#: The training comparison: deepseek3-tiny (one dense layer, two MoE layers), a learning rate at
#: which the loss moves, the loss-free bias on (it changes the routing from the second step); the
#: batch is large enough that the EP groups of the FSDP axis plan apart: in some call one group's
#: plan has a replica and another's has none, so they take different branches of the plan's
#: `lax.cond` (the run that aborted, "Termination timeout for all reduce", while the masters' cast
#: to varying over FSDP sat inside those branches).
TRAIN = dict(
    model_name="deepseek3-tiny",
    base_num_decoder_layers=3,
    first_num_dense_layers=1,
    vocab_size=512,
    max_target_length=64,
    per_device_batch_size=2,
    sparse_matmul=True,
    routed_bias_update_rate=0.01,
    steps=8,
    learning_rate=0.01,
    warmup_steps_fraction=0.0,
)
#: The balanced runs, by name: the meshes and settings, on the balancer's small thresholds.
BALANCED_RUNS = {
    "ep4_fsdp2": dict(
        ici_expert_parallelism=4,
        ici_fsdp_parallelism=2,
        ultraep_remat="plan,dispatch",  # saved by MaxText's full remat: the same losses
    ),
    "ep2_fsdp2_tp2": dict(
        ici_expert_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2
    ),
}
SMALL_THRESHOLDS = dict(ultraep_min_tokens_per_replica=2, ultraep_min_tokens_per_rank=1)
#: The command with each device's plans recorded (argv: the record's path, then the command's):
#: every call of the balanced experts (`streaming.experts_with_replicas`, the plan's branches)
#: appends the device's mesh coordinates and its plan's slots [R, S] (-1: empty) to the record,
#: by a `jax.debug.callback` that changes no value.
PLAN_PROBE = """
import json, runpy, sys, threading
import jax
from ultraep_jax.replicas import streaming
path, lock, experts = sys.argv.pop(1), threading.Lock(), streaming.experts_with_replicas
def record(coords, slots):
    with lock, open(path, "a") as f:
        f.write(json.dumps([{a: int(i) for a, i in coords.items()}, slots.tolist()]) + "\\n")
def probed(rows, masters, slot_expert_RS, *args, **kwargs):
    axes = jax.sharding.get_abstract_mesh().axis_names
    jax.debug.callback(record, {a: jax.lax.axis_index(a) for a in axes}, slot_expert_RS)
    return experts(rows, masters, slot_expert_RS, *args, **kwargs)
streaming.experts_with_replicas = probed
runpy.run_module("ultraep_jax.integrations.maxtext", run_name="__main__", alter_sys=True)
"""


def plans_per_group(path) -> dict[tuple, list]:
    """{EP group (its coordinates on every mesh axis but the EP axis): [slots [R, S] of each
    call, in the order the calls ran]} from `PLAN_PROBE`'s record; every device of a group
    recorded the same plans (the plan is agreed over the EP axis)."""
    calls = {}
    for line in pathlib.Path(path).read_text().splitlines():
        coords, slots = json.loads(line)
        calls.setdefault(tuple(sorted(coords.items())), []).append(slots)
    groups = {}
    for device, plans in calls.items():
        group = tuple((a, i) for a, i in device if a != "expert")
        assert groups.setdefault(group, plans) == plans, f"plans differ within EP group {group}"
    return groups


@pytest.mark.slow
@pytest.mark.xdist_group("maxtext_training")  # beside the block tests, in a process of its own
def test_training_through_the_command_has_maxtext_losses(tmp_path):
    """MaxText's trainer through our command at EP4 x FSDP2 and EP2 x FSDP2 x TP2, 8 steps: every
    step's loss is MaxText's own (its trainer, unbalanced, at EP = 1), while the EP groups of
    the FSDP axis took different branches of their plans (one with a replica, another without
    in the same call, `PLAN_PROBE`'s record)."""

    def start(argv, run, overrides):
        keys = {**TINY, **TRAIN, **overrides, "run_name": run}
        keys.update(base_output_directory=tmp_path, metrics_file=tmp_path / f"{run}.jsonl")
        argv = [sys.executable, *argv, str(BASE_CONFIG)] + [f"{k}={v}" for k, v in keys.items()]
        log = open(tmp_path / f"{run}.log", "w")  # noqa: SIM115 (closed with the process)
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ), log

    runs = {
        name: start(
            ["-c", PLAN_PROBE, tmp_path / f"{name}.plans"], name, {**run, **SMALL_THRESHOLDS}
        )
        for name, run in BALANCED_RUNS.items()
    }
    stock = dict(ici_fsdp_parallelism=8)
    runs["stock"] = start(["-m", "maxtext.trainers.pre_train.train"], "stock", stock)
    for process, log in runs.values():
        process.wait(timeout=900)
        log.close()
        assert process.returncode == 0, pathlib.Path(log.name).read_text()[-3000:]

    def metrics(run):
        lines = (tmp_path / f"{run}.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    reference = [m["learning/loss"] for m in metrics("stock")]
    assert len(reference) == TRAIN["steps"] and reference[-1] < reference[0]  # a run that learns
    for name in BALANCED_RUNS:
        balanced = metrics(name)
        losses = [m["learning/loss"] for m in balanced]
        print(f"losses (ultraep_jax {name}, MaxText EP1):", losses, reference)  # -s shows
        assert losses == pytest.approx(reference, rel=2e-5), name
        assert all(m["ultraep/replicas"] > 0 and m["ultraep/dropped"] == 0 for m in balanced)
        assert all(m["ultraep/imbalance_after"] < m["ultraep/imbalance_before"] for m in balanced)
        assert (tmp_path / f"{name}.log").read_text().count("ultraep step ") == TRAIN["steps"]

        groups = plans_per_group(tmp_path / f"{name}.plans")
        calls = {len(plans) for plans in groups.values()}
        assert len(groups) > 1 and len(calls) == 1, (name, calls)
        with_replica = [[max(map(max, slots)) >= 0 for slots in g] for g in groups.values()]
        apart = [i for i, had in enumerate(zip(*with_replica, strict=True)) if len(set(had)) > 1]
        print(f"{name}: calls whose EP groups' plans took different branches:", apart)
        assert apart, f"{name}: the EP groups never planned apart; the run no longer tests that"
