"""Bad values stay where they are, and bad arguments fail early with one line.

The layer (`uep.routed_experts`, routing given explicitly) against the dense one-device reference
(tests/references/moe.py): every (token, choice) pair runs its own expert's SwiGLU on the gathered
weights, and pairs that reach no expert (an id outside [0, E), or dropped for capacity by the rule
of tests/references/dispatch.py) are selected out. Covered: inf/NaN in one expert's weights (they
must not reach tokens or gradients of other experts, through replicas and relays), NaN/inf routing
weights on skipped pairs, capacity drops together with relays and streamed transfers, and the
argument checks.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ultraep_jax as uep
from tests.helpers import (
    assert_integer_rule,
    assert_raises_one_line,
    expert_mesh,
    fetch_with_grads,
    padded_exchange,
    random_slots,
    routed_value_and_grads,
)
from tests.references.dispatch import kept_pairs, prefix_transport
from tests.references.moe import reference_moe
from tests.references.planner import reference_plan
from tests.references.relay import reference_schedule
from ultraep_jax.replicas import relay

D, F = 8, 16


def _balancer(max_fanout: int = 2) -> uep.BalancerConfig:
    """A balancer that replicates readily and balances at these tests' few tokens per rank (no
    fallback)."""
    return uep.BalancerConfig(
        slots_per_rank=2, min_tokens_per_replica=1, max_fanout=max_fanout, min_tokens_per_rank=0
    )


@jax.jit
def _reference_value_and_grads(x, weights, params, experts, keep, cot):
    """The reference's y and the gradients of sum(y * cot) w.r.t. x, weights and params. One
    jitted function with ``keep`` and ``cot`` as arguments: one program per shape, where a
    closure over them traced and compiled the reference anew for every case."""

    def loss(x, weights, params):
        y = reference_moe(x, experts, weights, params, keep)
        return jnp.sum(y * cot), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, weights, params)
    return y, grads


def layer_and_reference(x, experts, weights, params, ep, keep, cot):
    """The layer's and the reference's (y, stats or None, gx, gweights, gparams)."""

    def layer(x, weights, params, experts):
        return uep.routed_experts(x, experts, weights, params, ep)

    args = (
        jnp.asarray(x),
        jnp.asarray(weights),
        tuple(jnp.asarray(w) for w in params),
        jnp.asarray(experts),
    )
    ry, (rgx, rgw, rgp) = _reference_value_and_grads(*args, jnp.asarray(keep), jnp.asarray(cot))
    ref = (np.asarray(ry), None, np.asarray(rgx), np.asarray(rgw), rgp)
    return routed_value_and_grads(layer, *args, cot), ref


def assert_close(got, want, what):
    """float32-tolerance comparison, absolute tolerance scaled to the reference's magnitude."""
    want = np.asarray(want)
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale, err_msg=what)


def draw_params(rng, E):
    """float32 (w_gate, w_up [E, D, F], w_down [E, F, D]) of unit-scale outputs."""
    return (
        (rng.normal(size=(E, D, F)) / np.sqrt(D)).astype(np.float32),
        (rng.normal(size=(E, D, F)) / np.sqrt(D)).astype(np.float32),
        (rng.normal(size=(E, F, D)) / np.sqrt(F)).astype(np.float32),
    )


def skewed_experts(rng, shape, choices, hot, k):
    """int32 [*shape, k]: distinct experts per token from ``choices``, ``hot`` ones 20x likelier."""
    p = np.where(np.isin(choices, hot), 20.0, 1.0)
    ids = [rng.choice(choices, size=k, replace=False, p=p / p.sum()) for _ in range(np.prod(shape))]
    return np.asarray(ids, np.int32).reshape(*shape, k)


def expected_kept(experts, E, R, capacity, balancer):
    """bool [B, L, k]: the pairs the layer keeps under the receive buffer ``capacity`` (every id
    in [0, E)), by the NumPy reference planner and dispatch rules; device r holds the r-th slice
    of the batch. Also returns the plan."""
    pairs = np.asarray(experts).reshape(R, -1)  # each source's pairs in pair order
    loads = np.stack([np.bincount(p, minlength=E) for p in pairs])
    if balancer is None:
        load_e = loads.sum(0)
        plan = {
            "slot_expert": np.zeros((R, 0), np.int64),
            "slot_quota": np.zeros((R, 0), np.int64),
            "master_quota": load_e,
        }
    else:
        plan = reference_plan(
            loads,
            balancer.slots_per_rank,
            balancer.min_tokens_per_replica,
            balancer.balance_eps,
            balancer.master_keep_tokens,
            capacity=capacity,
        )
    assign = prefix_transport(loads, plan["slot_expert"], plan["slot_quota"], plan["master_quota"])
    return kept_pairs(pairs, assign, plan["slot_expert"], capacity).reshape(experts.shape), plan


# -- 1. inf/NaN in one expert's weights ---------------------------------------------------------


def _routed_grads_program(ep):
    """One jitted program of `uep.routed_experts` under ``ep``: (x, weights, params, experts,
    cot) -> ((loss, (y, stats)), (gx, gweights, gparams)) of loss = sum(y * cot), the values as
    arguments, so that one compile serves several of them."""

    def loss(x, weights, params, experts, cot):
        y, stats = uep.routed_experts(x, experts, weights, params, ep)
        return jnp.sum(y * cot), (y, stats)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


# Each case one compile of the layer's value and gradients, run at two non-finite values (data,
# not program): 4 values in all, on the padded transfer at 1 chunk and the ragged one relayed
# (f = 2) in 2 chunks. (Before, one compile per value: (inf, f 2, 1 chunk) and (nan, f 1,
# 2 chunks) padded, where f only enters the stats; (inf, f 0, 1 chunk), a single hop that the
# relayed case's first hop runs, and (-inf, f 2, 2 chunks) ragged; each chunk's transfer runs the
# code of an unstreamed one on a column slice.)
@pytest.mark.parametrize(
    "bads, max_fanout, chunks, backend",
    [((np.inf, np.nan), 2, 1, "padded"), ((-np.inf, np.nan), 2, 2, "ragged")],
    ids=["inf-nan-f2-1chunk-padded", "-inf-nan-f2-2chunks-ragged"],
)
def test_nonfinite_weights_of_a_cold_expert_stay_there(
    bads, max_fanout, chunks, backend, monkeypatch
):
    """E=16 on 8 ranks, every token to expert 0 or experts 4..15 (expert 0 hot, so replicated
    through relays), one non-finite entry in cold expert 2's w_gate: no token and no gradient of
    another expert may see it. The replica transfer gathers every master row of a rank, so a
    0/1 mask product would make inf * 0 = NaN in the slots of other experts."""
    if backend == "ragged":
        padded_exchange(monkeypatch)  # the exchanged hops, through the CPU's exchange
    R, E, k, B, L = 8, 16, 2, 8, 16
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, L, D)).astype(np.float32)
    experts = skewed_experts(rng, (B, L), np.array([0, *range(4, 16)]), hot=[0], k=k)
    weights = rng.uniform(0.1, 1.0, size=(B, L, k)).astype(np.float32)
    clean = draw_params(rng, E)
    cot = rng.normal(size=x.shape).astype(np.float32)
    balancer = _balancer(max_fanout)
    ep = uep.ExpertParallel(
        expert_mesh(R),
        E,
        balancer=balancer,
        capacity_factor=None,
        comm_backend=backend,
        transfer_chunks=chunks,
    )
    program = _routed_grads_program(ep)
    keep = jnp.ones(experts.shape, bool)
    args = (jnp.asarray(x), jnp.asarray(weights))
    for bad in bads:
        params = tuple(w.copy() for w in clean)
        params[0][2, 3, 5] = bad
        params = tuple(jnp.asarray(w) for w in params)
        (_, (y, stats)), (gx, gw, gp) = program(*args, params, jnp.asarray(experts), cot)
        ry, (rgx, rgw, rgp) = _reference_value_and_grads(
            *args, params, jnp.asarray(experts), keep, jnp.asarray(cot)
        )
        y = np.asarray(y)
        assert int(stats.replicas) > 0, "no replica: the transfer was not exercised"
        assert int(stats.expert_load[2]) == 0
        assert np.isfinite(y).all(), f"{bad}: {int((~np.isfinite(y).all(-1)).sum())} tokens"
        assert_close(y, ry, f"y ({bad})")
        assert_close(gx, rgx, f"d/dx ({bad})")
        assert_close(gw, rgw, f"d/dweights ({bad})")
        for name, g, rg in zip(("w_gate", "w_up", "w_down"), gp, rgp, strict=True):
            assert np.isfinite(np.asarray(g)).all(), f"d/d{name} not finite ({bad})"
            assert_close(g, rg, f"d/d{name} ({bad})")


@pytest.mark.parametrize("backend", ["padded", "ragged"])
def test_nonfinite_master_reaches_only_its_own_slots(backend, monkeypatch):
    """The replica transfer alone: one expert's master rows hold inf and NaN; every slot holding
    another expert gets exactly its weights, and a NaN cotangent on the bad expert's slots reaches
    only that expert's gradient (the transfer's transpose)."""
    if backend == "ragged":
        padded_exchange(monkeypatch)
    R, em, S, f = 8, 2, 2, 1
    E = R * em
    # Expert 0 relayed through 3 levels; expert 1 (the bad one, same master rank) on 2 ranks.
    slot_expert = np.array(
        [[-1, -1], [0, 1], [0, -1], [0, 9], [0, -1], [0, 1], [0, -1], [3, -1]], np.int32
    )
    assert reference_schedule(slot_expert, em, f)["hop"].max() >= 3
    rng = np.random.default_rng(1)
    master = rng.normal(size=(E, 3, 4)).astype(np.float32)
    master[1, 0, 0], master[1, 2, 3] = np.inf, np.nan
    cot = rng.normal(size=(R * S, 3, 4)).astype(np.float32)
    flat = slot_expert.reshape(-1)
    cot[flat == 1] = np.nan
    (got,), (grad,) = fetch_with_grads(
        expert_mesh(R), [master], slot_expert, [cot], backend=backend, max_fanout=f
    )
    got, grad = np.asarray(got), np.asarray(grad)
    for i, e in enumerate(flat):
        if e != 1:
            want = master[e] if e >= 0 else np.zeros_like(master[0])
            np.testing.assert_array_equal(got[i], want, err_msg=f"slot {i} (expert {e})")
    want_grad = np.zeros_like(master)
    for i, e in enumerate(flat):
        if e >= 0:
            want_grad[e] += cot[i]
    others = np.arange(E) != 1
    np.testing.assert_allclose(grad[others], want_grad[others], rtol=1e-6, atol=1e-6)


# -- 2. skipped pairs with NaN/inf weights --------------------------------------------------------


@pytest.mark.parametrize("balanced", [False, True])
def test_nonfinite_weights_of_pairs_of_no_expert_are_ignored(balanced):
    """Pairs with id -1 or E (possible under jit, where ids cannot be checked) carry NaN, inf and
    -inf weights: the output and every gradient equal the reference without those pairs, and the
    weights' gradient is exactly 0 on them."""
    R, E, k, B, L = 8, 8, 2, 8, 8
    rng = np.random.default_rng(2)
    x = rng.normal(size=(B, L, D)).astype(np.float32)
    experts = skewed_experts(rng, (B, L), np.arange(E), hot=[0, 1], k=k)
    weights = rng.uniform(0.1, 1.0, size=(B, L, k)).astype(np.float32)
    skipped = rng.random(size=experts.shape) < 0.25
    experts[skipped] = rng.choice([-1, E], size=int(skipped.sum()))
    weights[skipped] = rng.choice([np.nan, np.inf, -np.inf], size=int(skipped.sum()))
    params = draw_params(rng, E)
    cot = rng.normal(size=x.shape).astype(np.float32)
    balancer = _balancer() if balanced else None
    ep = uep.ExpertParallel(expert_mesh(R), E, balancer=balancer, capacity_factor=None)
    (y, stats, gx, gw, gp), (ry, _, rgx, rgw, rgp) = layer_and_reference(
        x, experts, weights, params, ep, ~skipped, cot
    )
    assert int(stats.invalid) == int(skipped.sum()) > 0
    assert (int(stats.replicas) > 0) == balanced
    assert np.isfinite(y).all(), f"{int((~np.isfinite(y).all(-1)).sum())} tokens not finite"
    assert_close(y, ry, "y")
    assert_close(gx, rgx, "d/dx")
    assert np.isfinite(gw).all() and (gw[skipped] == 0).all()
    assert_close(gw, rgw, "d/dweights")
    for name, g, rg in zip(("w_gate", "w_up", "w_down"), gp, rgp, strict=True):
        assert_close(g, rg, f"d/d{name}")


# -- 8 (and 2). capacity drops with relays and streamed transfers --------------------------------


def capacity_case(seed, max_fanout, chunks, backend, monkeypatch, poison_dropped=False):
    """E=8, top-2, 16 pairs per device on 8 ranks, skewed to experts 0 and 1, with a receive
    buffer of 13 rows (capacity factor 0.8: below the mean, so the plan replicates and still
    drops). Returns the layer's and the reference's results, the kept pairs and the plan."""
    if backend == "ragged":
        padded_exchange(monkeypatch)
    R, E, k, B, L = 8, 8, 2, 8, 8
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, L, D)).astype(np.float32)
    experts = skewed_experts(rng, (B, L), np.arange(E), hot=[0, 1], k=k)
    weights = rng.uniform(0.1, 1.0, size=(B, L, k)).astype(np.float32)
    params = draw_params(rng, E)
    cot = rng.normal(size=x.shape).astype(np.float32)
    balancer = _balancer(max_fanout)
    ep = uep.ExpertParallel(
        expert_mesh(R),
        E,
        balancer=balancer,
        capacity_factor=0.8,
        comm_backend=backend,
        transfer_chunks=chunks,
    )
    capacity = ep.capacity(B * L // R, k)
    keep, plan = expected_kept(experts, E, R, capacity, ep.balancer)
    if poison_dropped:
        weights[~keep] = rng.choice([np.nan, np.inf], size=int((~keep).sum()))
    got, ref = layer_and_reference(x, experts, weights, params, ep, keep, cot)
    return got, ref, keep, plan


# The ragged f = 1 case relays through 7 hops, each in every chunk (each hop's exchange compiled
# once per chunk): 2 chunks there; 4 chunks run through the same chunk loop at f = 3. The
# padded (dense) transfer ignores f (its dense hop sends every copy from the master) and this
# test reads no stat of f: one padded case, at 4 chunks (a padded case at f = 1 and 2 chunks, the
# same data, ran the same chunk loop here before). The f = 2 case runs on one JAX line (slow):
# the f = 1 chain runs the same relay and chunk code.
@pytest.mark.parametrize(
    "max_fanout, chunks, backend",
    [pytest.param(2, 3, "ragged", marks=pytest.mark.slow), (3, 4, "padded"), (1, 2, "ragged")],
)
def test_capacity_drops_with_relays_and_streaming_equal_reference(
    max_fanout, chunks, backend, monkeypatch
):
    """Pairs dropped for capacity while replica weights move through relays in 2-4 chunks: the
    drop count and the output and gradients equal the reference with the rule's pairs removed."""
    (y, stats, gx, gw, gp), (ry, _, rgx, rgw, rgp), keep, plan = capacity_case(
        3, max_fanout, chunks, backend, monkeypatch
    )
    assert int(stats.dropped) == int((~keep).sum()) > 0, "no pair was dropped"
    assert int(stats.replicas) == int((plan["slot_expert"] >= 0).sum()) > 0, "no replica"
    if max_fanout == 1:
        assert reference_schedule(plan["slot_expert"], 1, max_fanout)["hop"].max() >= 2
    assert_close(y, ry, "y")
    assert_close(gx, rgx, "d/dx")
    assert_close(gw, rgw, "d/dweights")
    for name, g, rg in zip(("w_gate", "w_up", "w_down"), gp, rgp, strict=True):
        assert_close(g, rg, f"d/d{name}")


def test_nonfinite_weights_of_dropped_pairs_are_ignored(monkeypatch):
    """The pairs dropped for capacity carry NaN and inf weights: nothing of them reaches a token
    or a gradient (the weights' gradient is exactly 0 on them)."""
    (y, stats, gx, gw, gp), (ry, _, rgx, rgw, rgp), keep, _ = capacity_case(
        4, 2, 2, "padded", monkeypatch, poison_dropped=True
    )
    assert int(stats.dropped) == int((~keep).sum()) > 0
    assert np.isfinite(y).all(), f"{int((~np.isfinite(y).all(-1)).sum())} tokens not finite"
    assert_close(y, ry, "y")
    assert_close(gx, rgx, "d/dx")
    assert np.isfinite(gw).all() and (gw[~keep] == 0).all()
    assert_close(gw, rgw, "d/dweights")
    for name, g, rg in zip(("w_gate", "w_up", "w_down"), gp, rgp, strict=True):
        assert_close(g, rg, f"d/d{name}")


# -- 3. wide ids -----------------------------------------------------------------------------------


def test_int64_ids_outside_the_experts_do_not_wrap_under_x64():
    """With ``jax_enable_x64``, int64 ids 2**32 + 3, 2**33 and -2**32 + 1 (which an int32 cast
    would make 3, 0 and 1) are pairs of no expert: counted as invalid and skipped; the output
    equals the reference without them."""
    R, E, k, B, L = 8, 8, 2, 8, 4
    rng = np.random.default_rng(5)
    x = rng.normal(size=(B, L, D)).astype(np.float32)
    experts = skewed_experts(rng, (B, L), np.arange(E), hot=[0], k=k).astype(np.int64)
    wide = rng.random(size=experts.shape) < 0.3
    experts[wide] = rng.choice([2**32 + 3, 2**33, -(2**32) + 1], size=int(wide.sum()))
    weights = rng.uniform(0.1, 1.0, size=(B, L, k)).astype(np.float32)
    params = draw_params(rng, E)
    ep = uep.ExpertParallel(expert_mesh(R), E, capacity_factor=None)
    with jax.enable_x64(True):
        ids = jnp.asarray(experts)
        assert ids.dtype == jnp.int64
        y, stats = jax.jit(lambda x, e: uep.routed_experts(x, e, weights, params, ep))(
            jnp.asarray(x), ids
        )
        with pytest.raises(ValueError, match=r"experts must be in \[0, 8\), got -4294967295\.\."):
            uep.routed_experts(jnp.asarray(x), ids, weights, params, ep)  # eager: checked
    assert int(stats.invalid) == int(wide.sum()) > 0
    assert int(np.asarray(stats.expert_load).sum()) == int((~wide).sum())
    want = jax.jit(reference_moe)(
        jnp.asarray(x),
        jnp.asarray(np.where(wide, 0, experts).astype(np.int32)),
        jnp.asarray(weights),
        tuple(jnp.asarray(w) for w in params),
        jnp.asarray(~wide),
    )
    assert_close(np.asarray(y), want, "y")


# -- 4. mixed parameter dtypes ---------------------------------------------------------------------


def test_mixed_parameter_dtypes_raise_one_line():
    """w_gate in float16 and the rest float32 used to pass the checks and fail with a long
    TypeError of the replica transfer's switch, and only with a balancer: now one line, balancer
    or not."""
    R, E = 8, 8
    rng = np.random.default_rng(6)
    w_gate, w_up, w_down = draw_params(rng, E)
    params = (w_gate.astype(np.float16), w_up, w_down)
    x = rng.normal(size=(R, 2, D)).astype(np.float32)
    ids, weights = np.zeros((R, 2, 1), np.int32), np.ones((R, 2, 1), np.float32)
    for balancer in (None, _balancer()):
        ep = uep.ExpertParallel(expert_mesh(R), E, balancer=balancer)
        assert_raises_one_line(
            TypeError,
            r"w_gate, w_up and w_down must have one dtype, got float16, float32, float32",
            uep.routed_experts,
            x,
            ids,
            weights,
            params,
            ep,
        )


# -- 5-7. errors: one line, naming the value, where the value is given --------------------------


def test_max_fanout_is_bounded_where_the_config_is_built():
    assert_raises_one_line(
        ValueError,
        r"^BalancerConfig.max_fanout must be <= 2147483647, got 2147483648$",
        uep.BalancerConfig,
        max_fanout=2**31,
    )
    assert uep.BalancerConfig(max_fanout=np.int64(2**31 - 1)).max_fanout == 2**31 - 1


@pytest.mark.parametrize("f", [2**30, 2**31 - 1])
def test_relay_schedule_of_the_largest_fanouts_equals_reference(f):
    """A fan-out near 2**31 used to overflow the schedule's int32 level bounds (every slot then
    received from itself in hop 2)."""
    rng = np.random.default_rng(9)
    # Jitted: op by op, each of the schedule's many small ops compiles on its own.
    schedule = jax.jit(relay.relay_schedule, static_argnums=(1, 2))
    for R, em, S in ((8, 1, 2), (8, 2, 3), (4, 4, 2)):
        slots = random_slots(rng, R, em, S, fill=0.8, hot=2)
        got = schedule(jnp.asarray(slots), em, f)
        want = reference_schedule(slots, em, f)
        np.testing.assert_array_equal(np.asarray(got.hop_RS), want["hop"])
        np.testing.assert_array_equal(np.asarray(got.sender_RS), want["sender"])
        np.testing.assert_array_equal(np.asarray(got.source_RS), want["source"])


def test_largest_max_fanout_sends_every_copy_from_the_master():
    """max_fanout = 2**31 - 1 runs (it used to overflow in the relay schedule) and sends every
    copy in the first hop: values equal the reference and the largest send is f = 0's."""
    R, E, k, B, L = 8, 8, 2, 8, 8
    rng = np.random.default_rng(7)
    x = rng.normal(size=(B, L, D)).astype(np.float32)
    experts = skewed_experts(rng, (B, L), np.arange(E), hot=[0, 1], k=k)
    weights = rng.uniform(0.1, 1.0, size=(B, L, k)).astype(np.float32)
    params = draw_params(rng, E)
    # The reference does not depend on f: computed once, jitted.
    want = jax.jit(reference_moe)(
        jnp.asarray(x),
        jnp.asarray(experts),
        jnp.asarray(weights),
        tuple(jnp.asarray(w) for w in params),
        jnp.ones(experts.shape, bool),
    )
    sends = {}
    for f in (0, 2**31 - 1):
        balancer = _balancer(f)
        ep = uep.ExpertParallel(expert_mesh(R), E, balancer=balancer, capacity_factor=None)
        y, stats = jax.jit(lambda x, ep=ep: uep.routed_experts(x, experts, weights, params, ep))(x)
        assert int(stats.replicas) > 0
        sends[f] = float(stats.transfer_send_max)
        assert_close(np.asarray(y), want, f"y, max_fanout={f}")
    assert sends[0] == sends[2**31 - 1] > 0


def test_plan_of_no_ranks_raises_one_line():
    for shape in ((0, 8), (4, 0)):
        assert_raises_one_line(
            ValueError,
            rf"^plan: loads \[ep_size, num_experts\] must have both sizes >= 1, got "
            rf"\[{shape[0]}, {shape[1]}\]$",
            uep.plan,
            np.zeros(shape, np.int32),
            uep.BalancerConfig(),
        )


def test_ragged_backend_on_cpu_devices_raises_at_construction():
    assert_raises_one_line(
        ValueError,
        r"comm_backend='ragged': cannot run on CPU devices",
        uep.ExpertParallel,
        expert_mesh(8),
        8,
        comm_backend="ragged",
    )
    # One rank exchanges nothing; abstract GPU devices (export for CUDA) may use it.
    assert uep.ExpertParallel(expert_mesh(1), 8, comm_backend="ragged").comm_backend == "ragged"
    from tests.helpers import gpu_expert_mesh

    assert uep.ExpertParallel(gpu_expert_mesh(8), 8, comm_backend="ragged").ep_size == 8


@pytest.mark.parametrize(
    "per_device, top_k, factor, match",
    [
        (2**30, 8, 1.0, r"^routed_experts: 8589934592 \(token, choice\) pairs per device exceed"),
        (2**25, 8, None, r"^routed_experts: a receive buffer of 2147483648 rows per device exc"),
    ],
    ids=["pairs", "buffer"],
)
def test_sizes_past_int32_raise_one_line(per_device, top_k, factor, match):
    """Shapes only (nothing is allocated): more pairs on a device, or more receive-buffer rows,
    than the int32 dispatch indices hold."""
    R, E = 8, 8
    ep = uep.ExpertParallel(expert_mesh(R), E, capacity_factor=factor)
    S = jax.ShapeDtypeStruct
    x = S((R * per_device, 1, D), jnp.float32)
    ids, weights = (
        S((R * per_device, 1, top_k), jnp.int32),
        S((R * per_device, 1, top_k), jnp.float32),
    )
    params = (S((E, D, F), jnp.float32), S((E, D, F), jnp.float32), S((E, F, D), jnp.float32))
    assert_raises_one_line(
        ValueError,
        match,
        jax.eval_shape,
        functools.partial(uep.routed_experts, ep=ep),
        x,
        ids,
        weights,
        params,
    )


def test_transfer_chunks_beyond_the_width_raise_without_a_balancer():
    """`routed_experts` refuses what `MoE` refuses, balancer or not."""
    R, E = 8, 8
    rng = np.random.default_rng(8)
    params = draw_params(rng, E)
    x = rng.normal(size=(R, 2, D)).astype(np.float32)
    ids = np.zeros((R, 2, 1), np.int32)
    weights = np.ones((R, 2, 1), np.float32)
    for balancer in (None, uep.BalancerConfig()):
        ep = uep.ExpertParallel(expert_mesh(R), E, balancer=balancer, transfer_chunks=F + 1)
        assert_raises_one_line(
            ValueError,
            rf"^routed_experts: transfer_chunks={F + 1} exceeds d_ff={F} ",
            uep.routed_experts,
            x,
            ids,
            weights,
            params,
            ep,
        )


# -- integer arguments: one rule everywhere --------------------------------------------------------


def _integer_arguments():
    """(name, fn(value)) for a sample of integer arguments of the library and the model (the
    experiments' follow the same rule: tests/experiments/test_data.py, test_workloads.py): each
    must raise TypeError for a non-integer and ValueError below its minimum."""
    from models.moe_lm import ModelConfig

    mesh = expert_mesh(8)
    return [
        ("BalancerConfig.max_fanout", lambda v: uep.BalancerConfig(max_fanout=v)),
        ("BalancerConfig.slots_per_rank", lambda v: uep.BalancerConfig(slots_per_rank=v)),
        ("Execution: transfer_chunks", lambda v: uep.ExpertParallel(mesh, 8, transfer_chunks=v)),
        ("ExpertParallel: num_experts", lambda v: uep.ExpertParallel(mesh, v)),
        (
            "MoE: top_k",
            lambda v: uep.MoE(
                d_model=D, d_ff=F, num_experts=8, top_k=v, mesh=mesh, rngs=nnx.Rngs(0)
            ),
        ),
        ("SoftmaxTopK: top_k", lambda v: uep.SoftmaxTopK(v)),
        ("SigmoidTopK: num_groups", lambda v: uep.SigmoidTopK(2, num_groups=v)),
        ("plan: capacity", lambda v: uep.plan(np.ones((8, 8), np.int32), uep.BalancerConfig(), v)),
        ("ModelConfig.top_k", lambda v: ModelConfig(top_k=v)),
        ("ModelConfig.shared_d_ff", lambda v: ModelConfig(shared_d_ff=v)),
    ]


def test_integer_arguments_follow_one_rule():
    """TypeError (one line naming the argument) for a bool, a float (even 2.0) or a string;
    ValueError for an integer below the minimum; NumPy integers accepted."""
    for name, fn in _integer_arguments():
        assert_integer_rule(name, fn)


# -- settings that could not do what they say are one-line errors ----------------------------------


def test_balancer_without_spare_slots_raises_one_line():
    """``slots_per_rank=0`` with a balancer never balances (1.068 -> 1.068 before): refused; the
    planner alone still takes S = 0 (a plan that keeps every token on its master)."""
    mesh = expert_mesh(8)
    # Each names the entry the user called: the configuration, or the layer that builds it.
    for entry, build in (
        (
            "ExpertParallel",
            lambda: uep.ExpertParallel(mesh, 8, uep.BalancerConfig(slots_per_rank=0)),
        ),
        (
            "MoE",
            lambda: uep.MoE(
                d_model=D,
                d_ff=F,
                num_experts=8,
                top_k=2,
                mesh=mesh,
                balancer=uep.BalancerConfig(slots_per_rank=0),
                rngs=nnx.Rngs(0),
            ),
        ),
    ):
        assert_raises_one_line(
            ValueError, rf"^{entry}: BalancerConfig\(slots_per_rank=0\) leaves", build
        )
    plan = uep.plan(np.ones((8, 8), np.int32), uep.BalancerConfig(slots_per_rank=0))
    assert plan.slot_expert.shape == (8, 0)


@pytest.mark.parametrize("entry", ["ExpertParallel", "MoE"])
def test_experts_not_dividing_the_ep_size_name_the_caller_and_what_fits(entry):
    """12 experts over the 8 ranks of ep8: the error names the entry called (`MoE` said
    "ExpertParallel", the configuration it builds) and the EP sizes that fit (the divisors of 12
    that divide the 8 devices), in one line."""
    mesh = expert_mesh(8)
    if entry == "MoE":
        build = functools.partial(uep.MoE, D, F, 12, 2, mesh, rngs=nnx.Rngs(0))
    else:
        build = functools.partial(uep.ExpertParallel, mesh, 12)
    match = (
        rf"^{entry}: num_experts=12 is not divisible by the EP size 8 \(mesh axis 'expert'\); "
        r"EP sizes that fit 12 experts within the 8 token devices: 1, 2 or 4 \(or num_experts "
        r"a multiple of 8\)$"
    )
    assert_raises_one_line(ValueError, match, build)


@pytest.mark.parametrize(
    "names, expert_axis",
    [(("data", "ep"), "expert"), (("data", "expert"), "experts"), (("data",), "expert")],
    ids=["mesh_axis_ep", "typo", "no_ep_axis"],
)
def test_ep_axis_missing_from_the_mesh_raises_one_line(names, expert_axis):
    """An EP axis the mesh lacks used to run every expert locally and report 1.0 -> 1.0 (which
    reads as perfect balance): now an error naming the mesh's axes; local experts only when asked
    for with ``expert_axis=None``."""
    shape = (8,) if len(names) == 1 else (2, 4)
    mesh = jax.make_mesh(shape, names)
    assert_raises_one_line(
        ValueError,
        rf"^ExpertParallel: the mesh has no axis '{expert_axis}' "
        rf"\(its axes: {re.escape(str(names))}\)",
        uep.ExpertParallel,
        mesh,
        8,
        uep.BalancerConfig(),
        expert_axis=expert_axis,
    )
    local = uep.ExpertParallel(mesh, 8, uep.BalancerConfig(), expert_axis=None)
    assert local.ep_size == 1 and local.active_balancer is None and not local.has_ep_axis


@pytest.mark.parametrize(
    "call, prefix",
    [
        ("global", "routed_experts"),
        ("local", "routed_experts_local"),
    ],
)
def test_errors_name_the_entry_point_called(call, prefix):
    """`routed_experts` and `routed_experts_local` name themselves in their errors (they said
    "MoE:", a layer the caller never built)."""
    ep = uep.ExpertParallel(expert_mesh(1), 8)
    x = jnp.zeros((4, D), jnp.float32)
    ids, weights = jnp.zeros((4, 2), jnp.float32), jnp.ones((4, 2), jnp.float32)
    params = draw_params(np.random.default_rng(0), 8)
    fn = uep.routed_experts if call == "global" else uep.routed_experts_local
    match = rf"^{prefix}: experts must have an integer dtype"
    assert_raises_one_line(TypeError, match, fn, x, ids, weights, params, ep)
