"""The force-balanced ideal (`ultraep_jax.ideal`, ``MoE(force_balanced=True)``): every expert and
every EP rank gets the same pairs (within one where they do not divide evenly), the router's
weights are kept, against hand-computed assignments and per-device NumPy counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ultraep_jax as uep
from tests import helpers
from tests.references.moe import reference_moe
from ultraep_jax.ideal import even_experts, force_balanced
from ultraep_jax.routers import router_logits

pytestmark = pytest.mark.xdist_group("test_ideal")

D, F, E, K = 8, 16, 8, 2


def test_even_experts_by_hand():
    """R = 2, E = 4 (experts 0, 1 on rank 0; 2, 3 on rank 1), K = 2: pair p goes to rank p % 2,
    master (p // 2) % 2; a masked token takes no pair."""
    ids = even_experts(jnp.array([True, True, True]), 2, 4, 2)
    np.testing.assert_array_equal(ids, [[0, 2], [1, 3], [0, 2]])
    ids = even_experts(jnp.array([True, False, True, True]), 2, 4, 2)
    np.testing.assert_array_equal(np.asarray(ids)[[0, 2, 3]], [[0, 2], [1, 3], [0, 2]])


def _counts(ids, real, devices, groups):
    """Per device [devices, E] and per EP group [groups, E] pair counts of ``ids`` [T, K] over
    the real tokens, the tokens split into contiguous blocks of one device each."""
    T = ids.shape[0]
    dev = np.repeat(np.arange(devices), T // devices)
    per_device = np.zeros((devices, E), int)
    for t in np.flatnonzero(real):
        np.add.at(per_device[dev[t]], ids[t], 1)
    return per_device, per_device.reshape(groups, devices // groups, E).sum(1)


def _spread(a, axis=-1):
    return np.max(a, axis) - np.min(a, axis)


@pytest.mark.parametrize("mesh_kind", ["ep8", "dp2ep4"])
@pytest.mark.parametrize(
    "tokens, masked",
    [(64, False), (64, True), (56, False), (72, True)],
    ids=["even", "even_masked", "uneven", "uneven_masked"],
)
def test_loads_equal_per_device_group_expert_and_rank(mesh_kind, tokens, masked):
    """Each device sends every expert floor or ceil of its pairs / E, every token's choices are
    distinct, and in each EP group every expert's and every rank's load is within one pair of
    the others (exactly equal when each device's pairs are a multiple of E)."""
    mesh = helpers.make_mesh(mesh_kind)
    R = mesh.shape["expert"]
    groups = 8 // R
    ep = uep.ExpertParallel(mesh, E)
    rng = np.random.default_rng(tokens)
    real = rng.random(tokens) < 0.7 if masked else np.ones(tokens, bool)
    router_ids = jnp.zeros((tokens, K), jnp.int32)  # only the shape is used
    ids = np.asarray(force_balanced(router_ids, ep, jnp.asarray(real) if masked else None))
    assert ids.shape == (tokens, K) and ids.dtype == np.int32
    assert all(len(set(row)) == K for row in ids[real])
    per_device, per_group = _counts(ids, real, 8, groups)
    pairs = real.reshape(8, -1).sum(1) * K
    np.testing.assert_array_equal(per_device.sum(1), pairs)
    assert np.all(per_device >= (pairs // E)[:, None])
    assert np.all(per_device <= (-(-pairs // E))[:, None])
    rank_load = per_group.reshape(groups, R, E // R).sum(-1)
    assert np.all(_spread(per_group) <= 1) and np.all(_spread(rank_load) <= 1)
    if not masked and (tokens // 8 * K) % E == 0:
        assert np.all(per_device == per_device[0, 0])  # exactly equal everywhere


@pytest.mark.parametrize("mesh_kind", ["ep8", "dp2ep4"])
def test_layer_ideal_fills_the_mean_buffer_and_keeps_the_weights(mesh_kind):
    """``MoE(force_balanced=True)`` on a skewed router: every expert and rank exactly at the
    mean (4 tokens per device, 8 pairs over 8 experts), so a buffer of exactly the mean
    (capacity_factor=1.0) drops nothing; y is the dense computation of the even ids with the
    router's own weights."""
    mesh = helpers.make_mesh(mesh_kind)
    rng = np.random.default_rng(3)
    x, params = helpers.draw_routed_inputs(rng, 8, 4, D, F, E, skew=True)
    options = dict(d_model=D, d_ff=F, num_experts=E, top_k=K, capacity_factor=1.0)
    ideal = helpers.build_layer(mesh, params, force_balanced=True, **options)
    plain = helpers.build_layer(mesh, params, **options)
    xs = helpers.place_batch(mesh, x)
    y, stats = nnx.jit(lambda m, x: m(x))(ideal, xs)
    _, plain_stats = nnx.jit(lambda m, x: m(x))(plain, xs)
    assert float(plain_stats.imbalance_before) > 1.3 and int(plain_stats.dropped) > 0
    np.testing.assert_array_equal(stats.expert_load, np.full(E, 8 * 4 * K // E))
    R = mesh.shape["expert"]
    np.testing.assert_array_equal(stats.rank_load_before, np.full(R, 8 * 4 * K // R))
    assert int(stats.dropped) == 0 and float(stats.imbalance_before) == 1.0
    w = tuple(jnp.asarray(params[k]) for k in ("w_gate", "w_up", "w_down"))

    @jax.jit  # one program: op by op, every op of the reference compiles on its own
    def reference(x, kernel, w):
        weights = uep.SoftmaxTopK(K)(router_logits(x.reshape(-1, D), kernel)).weights
        ids = force_balanced(jnp.zeros((8, 4, K), jnp.int32), ideal.ep)
        return reference_moe(x, ids, weights.reshape(8, 4, K), w)

    want = reference(jnp.asarray(x), jnp.asarray(params["router_kernel"]), w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_ideal_with_a_balancer_or_a_bad_flag_raises_one_line():
    mesh = helpers.make_mesh("ep8")
    build = dict(d_model=D, d_ff=F, num_experts=E, top_k=K, mesh=mesh, rngs=nnx.Rngs(0))
    helpers.assert_raises_one_line(
        ValueError,
        r"^MoE: force_balanced=True is the ideal a balancer is measured against: pass "
        r"balancer=None",
        uep.MoE,
        balancer=uep.BalancerConfig(),
        force_balanced=True,
        **build,
    )
    helpers.assert_raises_one_line(
        TypeError, r"^MoE: force_balanced must be a bool, got 1", uep.MoE, force_balanced=1, **build
    )
    ep = uep.ExpertParallel(mesh, E)
    helpers.assert_raises_one_line(
        ValueError,
        r"^force_balanced: top_k=9 exceeds num_experts=8",
        force_balanced,
        jnp.zeros((8, 9), jnp.int32),
        ep,
    )


def test_ideal_grads_flow_to_the_router():
    """The router's weights are kept, so the router kernel gets a gradient (the backward pass
    does the work of the real layer's), and it matches the dense reference's."""
    mesh = helpers.make_mesh("ep8")
    rng = np.random.default_rng(4)
    x, params = helpers.draw_routed_inputs(rng, 8, 4, D, F, E, skew=False)
    layer = helpers.build_layer(
        mesh, params, d_model=D, d_ff=F, num_experts=E, top_k=K, force_balanced=True
    )
    xs = helpers.place_batch(mesh, x)

    def loss(layer):
        y, _ = layer(xs)
        return jnp.sum(y**2)

    grads = nnx.jit(nnx.grad(loss))(layer)
    w = tuple(jnp.asarray(params[k]) for k in ("w_gate", "w_up", "w_down"))

    def ref_loss(kernel, x, w):
        ids = force_balanced(jnp.zeros((8, 4, K), jnp.int32), layer.ep)
        logits = router_logits(x.reshape(-1, D), kernel)
        weights = uep.SoftmaxTopK(K)(logits).weights.reshape(8, 4, K)
        return jnp.sum(reference_moe(x, ids, weights, w) ** 2)

    # jitted: op by op, every op of the reference's gradient compiles on its own
    want = jax.jit(jax.grad(ref_loss))(jnp.asarray(params["router_kernel"]), jnp.asarray(x), w)
    got = np.asarray(grads.router_kernel[...])
    assert np.abs(got).max() > 0
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-4, atol=1e-5)
