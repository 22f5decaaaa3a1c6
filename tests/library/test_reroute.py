"""`uep.reroute.reroute_counts`: how each source rank's (token, choice) pairs split over the
instances of their expert, locality first.

Instances are the E masters in expert order, then the R*S spare slots in (rank, slot) order. The
random tests check the properties (row sums per expert, column sums = quotas, non-negative,
locality first), compare with a greedy NumPy transport where the answer is unique, and with the
documented prefix-sum rule (tests/references/dispatch.py) everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ultraep_jax as uep
from tests.references.dispatch import prefix_transport

_reroute = jax.jit(uep.reroute.reroute_counts)


# -- the independent NumPy transport ---------------------------------------------------------


def instance_table(plan: dict, num_experts: int, ep_size: int):
    """(expert [I], host rank [I], quota [I]) of every instance; expert -1 for an empty slot."""
    slot_expert = np.asarray(plan["slot_expert"])
    R, S = slot_expert.shape
    em = num_experts // ep_size
    expert = np.concatenate([np.arange(num_experts), slot_expert.reshape(-1)])
    host = np.concatenate([np.arange(num_experts) // em, np.repeat(np.arange(R), S)])
    quota = np.concatenate(
        [np.asarray(plan["master_quota"]), np.asarray(plan["slot_quota"]).ravel()]
    )
    quota = np.where(expert >= 0, quota, 0)
    return expert, host, quota


def numpy_transport(loads, plan: dict) -> np.ndarray:
    """A transport that satisfies every property: locality first, then the remaining sources are
    matched to the remaining instances greedily, the largest remainder first (a different order
    from the prefix-sum rule the library uses, so only the unique parts can be compared)."""
    loads = np.asarray(loads, np.int64)
    R, E = loads.shape
    expert, host, quota = instance_table(plan, E, R)
    assign = np.zeros((R, expert.size), np.int64)
    for e in range(E):
        inst = np.flatnonzero(expert == e)
        left = loads[:, e].copy()
        room = quota[inst].copy()
        for j, i in enumerate(inst):  # locality first
            take = min(left[host[i]], room[j])
            assign[host[i], i] += take
            left[host[i]] -= take
            room[j] -= take
        while left.sum() > 0:
            r, j = int(np.argmax(left)), int(np.argmax(room))
            take = min(left[r], room[j])
            assert take > 0, "quotas do not cover the expert's load"
            assign[r, inst[j]] += take
            left[r] -= take
            room[j] -= take
        assert room.sum() == 0, "quotas exceed the expert's load"
    return assign


def check_transport(assign, loads, plan: dict) -> None:
    """Asserts the reroute properties of ``assign`` [R, E + R*S]."""
    loads = np.asarray(loads, np.int64)
    R, E = loads.shape
    expert, host, quota = instance_table(plan, E, R)
    assign = np.asarray(assign)
    assert assign.shape == (R, expert.size)
    assert (assign >= 0).all(), "negative count"
    assert (assign[:, expert < 0] == 0).all(), "tokens sent to an empty slot"
    np.testing.assert_array_equal(assign.sum(axis=0), quota, err_msg="column sums != quotas")
    for e in range(E):
        np.testing.assert_array_equal(
            assign[:, expert == e].sum(axis=1), loads[:, e], err_msg=f"row sums of expert {e}"
        )
    for i in np.flatnonzero(expert >= 0):  # locality first
        r = host[i]
        want = min(loads[r, expert[i]], quota[i])
        assert assign[r, i] == want, f"source {r} fills its own instance {i} with {want}"


def plan_dict(plan) -> dict:
    """A `uep.Plan` as NumPy arrays."""
    return {k: np.asarray(v) for k, v in vars(plan).items()}


def make_plan(slot_expert, slot_quota, master_quota) -> uep.Plan:
    """A hand-written `uep.Plan` (rank_load derived from the quotas)."""
    slot_expert = np.asarray(slot_expert, np.int32)
    slot_quota = np.asarray(slot_quota, np.int32)
    master_quota = np.asarray(master_quota, np.int32)
    R = slot_expert.shape[0]
    em = master_quota.size // R
    rank_load = master_quota.reshape(R, em).sum(1) + slot_quota.sum(1)
    return uep.Plan(
        jnp.asarray(slot_expert),
        jnp.asarray(slot_quota),
        jnp.asarray(master_quota),
        jnp.asarray(rank_load.astype(np.int32)),
    )


# -- hand-made plans with a unique answer ------------------------------------------------------


def test_local_source_fills_its_own_replica_first():
    # R=2, E=2, S=1: expert 1 (master on rank 1) has a replica on rank 0 (slot 0).
    # Instances: [master 0, master 1, slot (0,0) = expert 1, slot (1,0) empty].
    loads = np.array([[0, 10], [0, 4]], np.int32)
    plan = make_plan([[1], [-1]], [[7], [0]], [0, 7])
    got = np.asarray(_reroute(loads, plan))
    # Rank 0 keeps 7 of its 10 on its own replica, rank 1 keeps its 4 on the master, and the
    # remaining 3 of rank 0 fill the master.
    np.testing.assert_array_equal(got, [[0, 3, 7, 0], [0, 4, 0, 0]])


def test_two_experts_two_replicas():
    # Instances: [m0 (rank 0), m1 (rank 1), slot (0,0) empty, slot (1,0) = expert 0].
    loads = np.array([[8, 2], [6, 0]], np.int32)
    plan = make_plan([[-1], [0]], [[0], [6]], [8, 2])
    np.testing.assert_array_equal(np.asarray(_reroute(loads, plan)), [[8, 2, 0, 0], [0, 0, 0, 6]])


def test_no_slots_sends_everything_to_the_master():
    rng = np.random.default_rng(0)
    loads = rng.integers(0, 100, size=(4, 8)).astype(np.int32)
    cfg = uep.BalancerConfig(num_experts=8, ep_size=4, slots_per_rank=0)
    got = np.asarray(_reroute(loads, uep.plan(loads, cfg)))
    np.testing.assert_array_equal(got, loads)


def test_zero_loads():
    loads = np.zeros((4, 8), np.int32)
    cfg = uep.BalancerConfig(num_experts=8, ep_size=4, slots_per_rank=2)
    got = np.asarray(_reroute(loads, uep.plan(loads, cfg)))
    assert got.shape == (4, 8 + 4 * 2) and got.dtype == np.int32
    assert not got.any()


def test_eager_jit_and_vmap_agree():
    rng = np.random.default_rng(1)
    cfg = uep.BalancerConfig(num_experts=16, ep_size=8, slots_per_rank=2, min_tokens_per_replica=8)
    batch = np.stack([skewed_loads(rng, 8, 16) for _ in range(3)])
    plans = jax.vmap(lambda l: uep.plan(l, cfg))(batch)
    batched = np.asarray(jax.jit(jax.vmap(uep.reroute.reroute_counts))(batch, plans))
    for b in range(batch.shape[0]):
        plan = uep.plan(batch[b], cfg)
        eager = np.asarray(uep.reroute.reroute_counts(batch[b], plan))
        np.testing.assert_array_equal(np.asarray(_reroute(batch[b], plan)), eager)
        np.testing.assert_array_equal(batched[b], eager)


# -- random skewed loads ----------------------------------------------------------------------


def skewed_loads(rng, R, E, hot=None):
    """int32 [R, E]: small background load plus a few hot experts."""
    loads = rng.integers(0, 40, size=(R, E))
    hot = max(1, E // 4) if hot is None else hot
    cols = rng.choice(E, size=hot, replace=False)
    loads[:, cols] += rng.integers(50, 800, size=(R, hot))
    return loads.astype(np.int32)


@settings(max_examples=30, deadline=None)
@given(
    R=st.sampled_from([2, 4, 8]),
    S=st.sampled_from([0, 1, 2]),
    em=st.sampled_from([1, 2]),
    floor=st.sampled_from([1, 16, 100]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reroute_properties_on_planned_skewed_loads(R, S, em, floor, seed):
    E = R * em
    rng = np.random.default_rng(seed)
    loads = skewed_loads(rng, R, E)
    cfg = uep.BalancerConfig(
        num_experts=E, ep_size=R, slots_per_rank=S, min_tokens_per_replica=floor
    )
    plan = uep.plan(loads, cfg)
    pd = plan_dict(plan)
    got = np.asarray(_reroute(loads, plan))
    assert got.dtype == np.int32
    check_transport(got, loads, pd)
    # The oracle satisfies the same properties; locality fixes every count a source sends to an
    # instance it hosts, so those entries, the local volume and the network volume agree.
    want = numpy_transport(loads, pd)
    check_transport(want, loads, pd)
    expert, host, _ = instance_table(pd, E, R)
    own = host[None, :] == np.arange(R)[:, None]
    np.testing.assert_array_equal(got[own], want[own])
    assert got[~own].sum() == want[~own].sum()
    # Experts without a replica have one instance: the whole column is determined.
    single = [e for e in range(E) if (expert == e).sum() == 1]
    np.testing.assert_array_equal(got[:, single], loads[:, single])
    # The whole matrix follows the documented prefix-sum rule, rendered independently in NumPy.
    want_exact = prefix_transport(loads, pd["slot_expert"], pd["slot_quota"], pd["master_quota"])
    np.testing.assert_array_equal(got, want_exact)


@pytest.mark.parametrize("R, S", [(2, 2), (4, 1), (8, 2)])
def test_reroute_properties_with_one_dominant_expert(R, S):
    rng = np.random.default_rng(R * 10 + S)
    E = 2 * R
    loads = rng.integers(0, 5, size=(R, E)).astype(np.int32)
    loads[:, 1] += rng.integers(200, 400, size=R).astype(np.int32)
    cfg = uep.BalancerConfig(num_experts=E, ep_size=R, slots_per_rank=S, min_tokens_per_replica=4)
    plan = uep.plan(loads, cfg)
    assert int(plan.num_replicas) > 0
    check_transport(np.asarray(_reroute(loads, plan)), loads, plan_dict(plan))
