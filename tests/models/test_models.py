"""The model (`models/moe_lm.py`): scanned blocks equal the same blocks unrolled (values and
gradients), remat changes nothing, every preset builds and runs one step, and the router bias
moves from the loads of the step."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ultraep_jax as uep
from models.moe_lm import ModelConfig, MoELM, MoESettings, next_token_loss
from models.presets import PRESETS, preset
from tests.helpers import expert_mesh

# One test process computes the models it caches (pytest-xdist).
pytestmark = pytest.mark.xdist_group("test_models")

# Two blocks: the fewest where a scan that mixes up, reverses or repeats the blocks' parameters
# differs from the blocks unrolled (each block compiles again when unrolled).
SMALL = ModelConfig(
    d_model=16,
    num_layers=2,
    num_heads=2,
    d_ff=16,
    num_experts=8,
    top_k=2,
    max_seq_len=16,
    scan_layers=True,
)


def _balanced(cfg, slots=2) -> MoESettings:
    """Balanced, dropless layers on the 8-device expert mesh."""
    balancer = uep.BalancerConfig(
        cfg.num_experts, 8, slots_per_rank=slots, min_tokens_per_replica=1, min_tokens_per_rank=0
    )
    return MoESettings(balancer)


def _batch(seed=0, batch=8, seq=16):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, 256, (batch, seq + 1)), jnp.int32)


def _loss_and_grads(model, batch):
    """As the training step takes them: `nnx.jit` over `nnx.value_and_grad`."""

    @nnx.jit
    def fn(model, batch):
        return nnx.value_and_grad(next_token_loss, has_aux=True)(model, batch)

    (value, stats), grads = fn(model, batch)
    return value, stats, grads


def _unrolled_copy(scanned: MoELM, mesh, settings: MoESettings) -> MoELM:
    """The same model with its blocks as a list, holding the scanned model's parameters."""
    cfg = dataclasses.replace(scanned.cfg, scan_layers=False)
    unrolled = MoELM(cfg, mesh, settings, rngs=nnx.Rngs(1))
    stacked = nnx.state(scanned.blocks)
    for i, block in enumerate(unrolled.blocks):
        nnx.update(block, jax.tree.map(lambda a, i=i: a[i], stacked))
    for name in ("embed", "norm", "head"):
        nnx.update(getattr(unrolled, name), nnx.state(getattr(scanned, name)))
    unrolled.pos[...] = scanned.pos[...]
    return unrolled


@functools.cache
def scanned_and_unrolled():
    """(config, scanned model, its (loss, stats, grads), the unrolled copy's) on `_batch`: the
    sigmoid router in groups (its bias a per-block state the scan carries beside the parameters,
    so it covers the softmax router's path through the blocks and more), a shared expert, a bias
    rate. Computed once for the tests that compare them, remat against the scanned model and the
    bias step from its loads."""
    cfg = dataclasses.replace(
        SMALL, router="sigmoid", num_groups=2, top_groups=1, shared_d_ff=8, bias_rate=0.5
    )
    mesh, settings = expert_mesh(), _balanced(cfg)
    scanned = MoELM(cfg, mesh, settings, rngs=nnx.Rngs(0))
    unrolled = _unrolled_copy(scanned, mesh, settings)
    batch = _batch()
    return cfg, scanned, _loss_and_grads(scanned, batch), _loss_and_grads(unrolled, batch)


def test_scanned_blocks_equal_unrolled():
    cfg, _, (loss_s, stats_s, grads_s), (loss_u, stats_u, grads_u) = scanned_and_unrolled()
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-5)
    np.testing.assert_array_equal(stats_s.expert_load, stats_u.expert_load)
    assert stats_s.expert_load.shape == (cfg.num_layers, cfg.num_experts)
    assert int(jnp.sum(stats_s.replicas)) > 0  # balancing did something
    for name in ("embed", "pos", "norm", "head"):
        for a, b in zip(
            jax.tree.leaves(grads_s[name]), jax.tree.leaves(grads_u[name]), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    for i in range(cfg.num_layers):
        per_layer = jax.tree.map(lambda a, i=i: a[i], grads_s["blocks"])
        for a, b in zip(
            jax.tree.leaves(per_layer), jax.tree.leaves(grads_u["blocks"][i]), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # a third compile of the model's training step
def test_remat_changes_nothing():
    # The plain model is the scanned model of `scanned_and_unrolled` (same config and
    # initialisation), so only the remat model compiles here.
    cfg, _, (loss_p, _, grads_p), _ = scanned_and_unrolled()
    mesh, settings = expert_mesh(), _balanced(cfg)
    remat = MoELM(dataclasses.replace(cfg, remat=True), mesh, settings, rngs=nnx.Rngs(0))
    loss_r, _, grads_r = _loss_and_grads(remat, _batch())
    np.testing.assert_allclose(loss_p, loss_r, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_r), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_stacked_expert_weights_keep_the_layer_axis_whole():
    model = MoELM(SMALL, expert_mesh(), rngs=nnx.Rngs(0))
    w = model.blocks.moe.w_gate[...]
    assert w.shape == (SMALL.num_layers, SMALL.num_experts, SMALL.d_model, SMALL.d_ff)
    assert tuple(w.sharding.spec)[:2] == (None, "expert")


#: Presets whose model parts the others also run (softmax top-2: tiny, moe_heavy; top-8 over 4
#: slots per rank: deepseek_v3): on one JAX line (slow).
LIKE_OTHER_PRESETS = ("mixtral", "qwen3_moe")


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[pytest.mark.slow] if n in LIKE_OTHER_PRESETS else [])
        for n in sorted(PRESETS)
    ],
)
def test_presets_build_and_step(name):
    # The loss and stats of one batch, compiled without its gradient, which no assertion here
    # reads (a third of the compile; the gradient through each router, shared expert and scan:
    # test_scanned_blocks_equal_unrolled, tests/library/test_routing.py).
    cfg = dataclasses.replace(preset(name).model, num_layers=1, max_seq_len=16)
    settings = _balanced(cfg, preset(name).slots_per_rank)
    model = MoELM(cfg, expert_mesh(), settings, rngs=nnx.Rngs(0))
    loss, stats = nnx.jit(next_token_loss)(model, _batch(2))
    assert np.isfinite(float(loss)) and int(jnp.sum(stats.dropped)) == 0
    np.testing.assert_array_equal(
        np.asarray(stats.expert_load).sum(-1), 8 * 16 * cfg.top_k * np.ones(1)
    )


def test_the_settings_reach_every_layer_as_given():
    """One `MoESettings` carries every choice of the layers (the planner, the relay bound, the
    fast domains, the transfer chunks, the buffer): each block's layer holds them, none dropped
    on the way; the arguments threaded one by one before are a one-line TypeError."""
    cfg = dataclasses.replace(SMALL, scan_layers=False)
    balancer = uep.BalancerConfig(slots_per_rank=1, max_fanout=1, ranks_per_domain=4)
    execution = uep.Execution(planner="portable", transfer_chunks=2)
    settings = MoESettings(balancer, 1.5, execution=execution)
    model = MoELM(cfg, expert_mesh(), settings, rngs=nnx.Rngs(0))
    for block in model.blocks:
        ep = block.moe.ep
        assert (ep.balancer.max_fanout, ep.balancer.ranks_per_domain) == (1, 4)
        assert (ep.balancer.slots_per_rank, ep.capacity_factor) == (1, 1.5)
        assert (ep.execution.planner, ep.execution.transfer_chunks) == ("portable", 2)
    with pytest.raises(TypeError, match="^MoELM: settings must be a MoESettings, got Balancer"):
        MoELM(cfg, expert_mesh(), balancer, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="MoESettings.execution must be a uep.Execution"):
        MoESettings(execution="portable")


def test_router_bias_steps_from_the_loads():
    # The loads of the scanned sigmoid model's training step (bias rate 0.5, the bias still 0),
    # stepped on a copy so that the cached model keeps its bias.
    cfg, scanned, (_, stats, _), _ = scanned_and_unrolled()
    assert cfg.bias_rate == 0.5
    model = nnx.clone(scanned)
    np.testing.assert_array_equal(np.asarray(model.blocks.moe.router_bias[...]), 0)
    model.update_router_biases(stats)
    load = np.asarray(stats.expert_load, np.float64)
    want = 0.5 * np.sign(load.mean(-1, keepdims=True) - load)
    np.testing.assert_allclose(np.asarray(model.blocks.moe.router_bias[...]), want)


def test_bad_model_config_raises():
    with pytest.raises(ValueError, match="router"):
        ModelConfig(router="relu")
    with pytest.raises(ValueError, match="num_groups"):
        ModelConfig(router="sigmoid", num_experts=16, num_groups=3)
    with pytest.raises(ValueError, match="param_dtype"):
        ModelConfig(param_dtype="float16")
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("gpt5")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(router="sigmoid", num_experts=16, num_groups=8, top_groups=1, top_k=3),
            ValueError,
            "top_k=3 exceeds the experts of 1 groups of 2",
        ),
        (
            dict(router="sigmoid", routed_scale=float("inf")),
            ValueError,
            "routed_scale must be finite",
        ),
        (dict(bias_rate=float("nan")), ValueError, "bias_rate must be finite and >= 0, got nan"),
        (dict(top_k=np.float64(2.0)), TypeError, "ModelConfig.top_k must be an int, got float64"),
        (dict(top_k=0), ValueError, "ModelConfig.top_k must be a positive int, got 0"),
        (dict(shared_d_ff=True), TypeError, "ModelConfig.shared_d_ff must be an int, got bool"),
    ],
    ids=["top_k_in_groups", "scale_inf", "rate_nan", "float_top_k", "top_k_0", "bool_shared"],
)
def test_model_config_refuses_at_construction(kwargs, error, match):
    """What used to pass construction and fail at the first call (a top_k the chosen groups
    cannot hold) or give NaN (an infinite scale), refused with one line naming the value: a
    TypeError for a non-integer where an int is wanted, a ValueError for a bad value."""
    with pytest.raises(error, match=match) as info:
        ModelConfig(**kwargs)
    assert "\n" not in str(info.value)


def test_model_config_accepts_numpy_integers():
    cfg = ModelConfig(top_k=np.int64(2), num_experts=np.int32(16), d_model=np.int64(64))
    assert cfg == ModelConfig() and type(cfg.top_k) is int
