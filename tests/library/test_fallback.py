"""`BalancerConfig.min_tokens_per_rank`: below it the layer compiles plain expert parallelism (no
planner call, no replica slots), checked on the lowered program, against plain EP and against a
dense NumPy reference; at or above it the planner is there and replicas are used."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import ultraep_jax as uep
from tests import helpers

# One test process builds the module fixture (pytest-xdist).
pytestmark = pytest.mark.xdist_group("test_fallback")

D, F, E, K = 8, 16, 8, 2
BATCH, SEQ = 16, 4  # 8 tokens per device on the 8 devices
TOKENS_PER_RANK = BATCH * SEQ // 8


def _numpy_moe(x, params):
    """Dense float64 MoE: softmax top-k renormalised, SwiGLU on every expert, [B, L, D]."""
    xt = x.reshape(-1, D).astype(np.float64)
    logits = xt @ params["router_kernel"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, :K]
    w = np.take_along_axis(probs, top, axis=-1)
    w /= w.sum(-1, keepdims=True)
    out = np.zeros_like(xt)
    for t in range(xt.shape[0]):
        for j in range(K):
            e = top[t, j]
            g, u = xt[t] @ params["w_gate"][e], xt[t] @ params["w_up"][e]
            h = g / (1 + np.exp(-g)) * u
            out[t] += w[t, j] * (h @ params["w_down"][e])
    return out.reshape(x.shape)


@pytest.fixture(scope="module")
def setup():
    mesh = helpers.expert_mesh(8)
    rng = np.random.default_rng(5)
    x, params = helpers.draw_routed_inputs(rng, BATCH, SEQ, D, F, E, skew=True)
    return mesh, x, params


def _layer(mesh, params, balancer, capacity_factor=None):
    return helpers.build_layer(
        mesh,
        params,
        d_model=D,
        d_ff=F,
        num_experts=E,
        top_k=K,
        balancer=balancer,
        capacity_factor=capacity_factor,
    )


def _forward(layer):
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    return jax.jit(lambda p, r, x: nnx.merge(graphdef, p, r)(x)), params, rest


def _run(mesh, x, params, balancer):
    """(y, stats, lowered text) of the layer on x."""
    fn, p, r = _forward(_layer(mesh, params, balancer))
    xs = helpers.place_batch(mesh, x)
    text = fn.lower(p, r, xs).as_text()
    y, stats = fn(p, r, xs)
    return np.asarray(y), jax.tree.map(np.asarray, stats), text


def _balancer(threshold: int) -> uep.BalancerConfig:
    return uep.BalancerConfig(
        slots_per_rank=2, min_tokens_per_replica=1, min_tokens_per_rank=threshold
    )


def test_below_threshold_compiles_plain_ep(setup):
    mesh, x, params = setup
    y_fb, st_fb, text_fb = _run(mesh, x, params, _balancer(TOKENS_PER_RANK + 1))
    y_plain, st_plain, text_plain = _run(mesh, x, params, None)
    assert "ultraep_plan" not in text_fb
    assert "ultraep_plan" not in text_plain
    # The same program as plain EP: the same result to the bit, nothing replicated.
    np.testing.assert_array_equal(y_fb, y_plain)
    assert int(st_fb.replicas) == 0
    np.testing.assert_array_equal(st_fb.rank_load_after, st_fb.rank_load_before)
    assert float(st_fb.imbalance_before) > 1.5  # skewed: balancing would have had work to do
    want = _numpy_moe(x, params)
    np.testing.assert_allclose(y_fb, want, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(want).max()))


def test_at_threshold_balances(setup):
    mesh, x, params = setup
    y, stats, text = _run(mesh, x, params, _balancer(TOKENS_PER_RANK))
    assert "ultraep_plan" in text
    assert int(stats.replicas) > 0
    assert float(stats.imbalance_after) < float(stats.imbalance_before)
    want = _numpy_moe(x, params)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(want).max()))


def test_threshold_decided_per_traced_shape(setup):
    """One layer, two batch sizes: the small one compiles plain, the large one balances."""
    mesh, x, params = setup
    layer = _layer(mesh, params, _balancer(TOKENS_PER_RANK))
    fn, p, r = _forward(layer)
    small = helpers.place_batch(mesh, x[: BATCH // 2])
    big = helpers.place_batch(mesh, x)
    assert "ultraep_plan" not in fn.lower(p, r, small).as_text()
    assert "ultraep_plan" in fn.lower(p, r, big).as_text()


@pytest.mark.parametrize(
    ("tokens", "threshold", "want"),
    [(0, 0, True), (63, 64, False), (64, 64, True), (8192, 64, True), (1, 2, False)],
)
def test_applies(tokens, threshold, want):
    assert uep.BalancerConfig(min_tokens_per_rank=threshold).applies(tokens) is want


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (-1, ValueError, r"min_tokens_per_rank must be an int >= 0, got -1"),
        (1.5, TypeError, r"min_tokens_per_rank must be an int, got float 1.5"),
        (True, TypeError, r"min_tokens_per_rank must be an int, got bool"),
    ],
)
def test_bad_threshold_raises_one_line(value, error, match):
    with pytest.raises(error, match=match):
        uep.BalancerConfig(min_tokens_per_rank=value)


def test_threshold_normalised_from_numpy():
    cfg = uep.BalancerConfig(min_tokens_per_rank=np.int64(256))
    assert type(cfg.min_tokens_per_rank) is int and cfg.min_tokens_per_rank == 256
    assert cfg == uep.BalancerConfig(min_tokens_per_rank=256)


def _loss_and_grads(layer, xs):
    """(y, replicas, (d loss / d params, d loss / d x)) of ``mean(y**2)``, jitted."""
    graphdef, p, r = nnx.split(layer, nnx.Param, ...)

    def loss(p, x):
        y, stats = nnx.merge(graphdef, p, r)(x)
        return (y**2).mean(), (y, stats.replicas)

    (_, (y, replicas)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        p, xs
    )
    return np.asarray(y), int(replicas), grads


@pytest.fixture(scope="module")
def plain_ep_runs():
    """Plain EP's `_loss_and_grads` by expert kernel, computed by the first case that needs it:
    without a balancer there is no replica transfer, so ``transfer_chunks`` leaves the program
    as it is (the same lowered text) and the cases of each kernel share it."""
    return {}


# Each run a compile of the layer's value and gradients. At 1 chunk "tiled" fuses the stacks (the
# no-replica branch: zeros for the slots' weights in the fused loop) and "ragged_dot" does not
# (the no-replica branch: zeros beside the masters' calls); at 2 chunks neither fuses, and the
# no-replica branch is ragged_dot's at 1 chunk, the masters' calls beside it those of the
# balanced run: 2 chunks run balanced only, with "tiled" (ragged_dot balanced at 2 chunks runs in
# test_gpt_oss_block's dp2ep4 case, against the dense reference). Before, every kernel and chunk
# count ran every variant: 4 cases.
@pytest.mark.parametrize(
    ("kernel", "chunks"),
    [("tiled", 1), ("ragged_dot", 1), pytest.param("tiled", 2, marks=pytest.mark.slow)],
)
def test_plan_without_replica_equals_plain_ep(setup, plain_ep_runs, kernel, chunks):
    """At run time a plan with no replica skips the transfer and the slots' work (one `lax.cond`
    branch: masters alone, in the fused loop or beside the slots' calls); with replicas the other
    branch runs. Both give plain EP's values and gradients."""
    mesh, x, params = setup
    xs = helpers.place_batch(mesh, x)
    options = dict(d_model=D, d_ff=F, num_experts=E, top_k=K, capacity_factor=None)
    options |= dict(expert_kernel=kernel, transfer_chunks=chunks)
    # Dropless buffers and a tolerance no load exceeds: the planner has nothing to do.
    never = uep.BalancerConfig(slots_per_rank=2, balance_eps=1e9, min_tokens_per_rank=0)
    if kernel not in plain_ep_runs:
        plain = helpers.build_layer(mesh, params, balancer=None, **options)
        plain_ep_runs[kernel] = _loss_and_grads(plain, xs)
    variants = [("no_replica", never), ("balanced", _balancer(0))]
    if chunks > 1:  # the no-replica branch of ragged_dot at 1 chunk (the comment above)
        variants = variants[1:]
    runs = {"plain": plain_ep_runs[kernel]} | {
        name: _loss_and_grads(helpers.build_layer(mesh, params, balancer=b, **options), xs)
        for name, b in variants
    }
    assert runs.get("no_replica", (None, 0))[1] == 0 and runs["balanced"][1] > 0
    y0, _, (gp0, gx0) = runs["plain"]
    want = _numpy_moe(x, params)
    np.testing.assert_allclose(y0, want, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(want).max()))
    for name, _ in variants:
        y, _, (gp, gx) = runs[name]
        np.testing.assert_allclose(y, y0, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(gx, gx0, rtol=1e-5, atol=1e-7, err_msg=name)
        for key in ("w_gate", "w_up", "w_down", "router_kernel"):
            np.testing.assert_allclose(
                np.asarray(gp[key][...]),
                np.asarray(gp0[key][...]),
                rtol=1e-4,
                atol=1e-6,
                err_msg=f"{name} d{key}",
            )


# -- the fallback never drops a pair ------------------------------------------------------------


def _run_at(mesh, x, params, balancer, capacity_factor):
    """(y, stats, receive-buffer rows) of the layer with ``capacity_factor`` on x."""
    layer = _layer(mesh, params, balancer, capacity_factor)
    fn, p, r = _forward(layer)
    y, stats = fn(p, r, helpers.place_batch(mesh, x))
    return np.asarray(y), jax.tree.map(np.asarray, stats), layer.capacity(TOKENS_PER_RANK)


def test_fallback_is_dropless_at_a_balanced_buffer(setup):
    """Below the threshold a balanced layer at 1.05x buffers runs plain EP with a buffer for
    every pair: nothing dropped on a skewed load, the dense result; plain EP asked for the same
    1.05x buffer (a user-set capacity, no balancer) still drops what does not fit."""
    mesh, x, params = setup
    y, stats, rows = _run_at(mesh, x, params, _balancer(TOKENS_PER_RANK + 1), 1.05)
    assert float(stats.imbalance_before) > 1.5
    assert rows == 8 * K * TOKENS_PER_RANK  # every pair of every rank could land on one rank
    assert int(stats.dropped) == 0 and int(stats.replicas) == 0
    want = _numpy_moe(x, params)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(want).max()))
    _, plain, plain_rows = _run_at(mesh, x, params, None, 1.05)
    assert plain_rows == int(np.ceil(1.05 * K * TOKENS_PER_RANK))
    assert int(plain.dropped) > 0


def test_balanced_path_keeps_its_buffer(setup):
    """At or above the threshold the capacity factor sizes the balanced path's buffer; below it
    the fallback's buffer holds every pair; without a balancer the factor always applies."""
    T = TOKENS_PER_RANK
    ep = uep.ExpertParallel(setup[0], E, _balancer(T), capacity_factor=1.05)
    assert ep.balances(T) and not ep.balances(T - 1)
    assert ep.capacity(T, K) == int(np.ceil(1.05 * K * T))
    assert ep.capacity(T - 1, K) == 8 * K * (T - 1)
    plain = uep.ExpertParallel(setup[0], E, None, capacity_factor=1.05)
    assert plain.capacity(T - 1, K) == int(np.ceil(1.05 * K * (T - 1)))


def test_readme_layer_at_half_the_batch_drops_nothing():
    """docs/usage.md's layer example (2 x 4 mesh, E=16, top-2, 1.05x buffers) with a batch of 32
    instead of 64: 128 tokens per rank, below the default threshold, so it falls back, and
    drops nothing (it dropped 50 of 2,048 pairs when the fallback kept the 1.05x buffer)."""
    mesh = helpers.expert_mesh(4, 2)
    layer = uep.MoE(
        d_model=64,
        d_ff=128,
        num_experts=16,
        top_k=2,
        mesh=mesh,
        balancer=uep.BalancerConfig(slots_per_rank=2, min_tokens_per_replica=8),
        capacity_factor=1.05,
        rngs=nnx.Rngs(0),
    )
    x = jax.random.normal(jax.random.key(0), (32, 32, 64))
    _, stats = layer(x)
    assert int(stats.dropped) == 0 and int(stats.replicas) == 0
    assert int(np.sum(stats.expert_load)) == 32 * 32 * 2
