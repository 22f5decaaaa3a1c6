"""The per-rank replay (`experiments.replay.work`) against the layer itself: for load
matrices given exactly (expert ids built to produce them), the rows, groups and replica slots the
replay gives every rank equal those the layer received on 8 simulated devices (`MoEStats`), and
those of an independent NumPy rendering of the plan and dispatch rules (`references.planner`,
`references.dispatch`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ultraep_jax as uep
from experiments.replay import work as replay_work
from tests.helpers import expert_mesh
from tests.references.dispatch import instances, prefix_transport
from tests.references.planner import reference_plan

D, F, K = 8, 16, 2
TOKENS = 32  # per device: 64 pairs


def experts_for(loads_GRE: np.ndarray, seed: int) -> np.ndarray:
    """int32 [G * R, TOKENS, K]: each device's token choices, in a shuffled order, with exactly
    ``loads[g, r, e]`` of device (g, r)'s pairs on expert e (device g * R + r holds batch row
    g * R + r)."""
    rng = np.random.default_rng(seed)
    G, R, E = loads_GRE.shape
    rows = [
        rng.permutation(np.repeat(np.arange(E), loads_GRE[g, r])).reshape(TOKENS, K)
        for g in range(G)
        for r in range(R)
    ]
    return np.stack(rows).astype(np.int32)


def reference_group_rows(loads_RE, plan: dict, capacity: int) -> np.ndarray:
    """int [R, G]: rows each rank keeps per local group, by the documented rules in plain loops:
    the reroute of `prefix_transport`; a destination stores sources in rank order, each source's
    rows by local group, and keeps its first ``capacity`` rows."""
    R, E = loads_RE.shape
    slot_expert = np.asarray(plan["slot_expert"])
    assign = prefix_transport(loads_RE, slot_expert, plan["slot_quota"], plan["master_quota"])
    _, host, group = instances(slot_expert, E)
    G = E // R + slot_expert.shape[1]
    out = np.zeros((R, G), np.int64)
    for dst in range(R):
        used = 0
        for src in range(R):
            for g in range(G):
                i = int(np.flatnonzero((host == dst) & (group == g))[0])
                kept = max(0, min(int(assign[src, i]), capacity - used))
                out[dst, g] += kept
                used += int(assign[src, i])
    return out


def run_layer(loads_GRE, mesh, balancer, capacity_factor, seed=0):
    """The layer's `MoEStats` for the given loads (G EP groups of R ranks)."""
    E = loads_GRE.shape[-1]
    experts = experts_for(loads_GRE, seed)
    rng = np.random.default_rng(seed + 1)
    x = rng.normal(size=(experts.shape[0], TOKENS, D)).astype(np.float32)
    weights = np.full(experts.shape, 1.0 / K, np.float32)
    params = tuple(
        jnp.asarray(rng.normal(size=s).astype(np.float32))
        for s in ((E, D, F), (E, D, F), (E, F, D))
    )
    ep = uep.ExpertParallel(mesh, E, balancer, capacity_factor)
    _, stats = jax.jit(lambda *a: uep.routed_experts(*a, ep))(x, experts, weights, params)
    return jax.device_get(stats), ep.capacity(TOKENS, K)


def _skewed(R, E, hot, share, seed):
    """int [R, E]: every source sends ``share`` of its pairs to expert ``hot``, the rest spread at
    random."""
    rng = np.random.default_rng(seed)
    pairs = TOKENS * K
    loads = np.zeros((R, E), np.int64)
    for r in range(R):
        loads[r, hot] = int(share * pairs)
        loads[r] += np.bincount(rng.integers(0, E, pairs - loads[r, hot]), minlength=E)
    return loads


# (name, mesh shape, E, slots, capacity factor, loads [G, R, E]):
# uniform loads (nothing to replicate), one hot expert with replicas, two data groups with
# different hot experts, and a buffer too small for the mean (pairs dropped, replicas made).
CASES = [
    ("uniform", (8,), 16, 2, 1.1, np.full((1, 8, 16), TOKENS * K // 16)),
    ("skewed", (8,), 16, 2, 1.1, _skewed(8, 16, 3, 0.5, 1)[None]),
    (
        "two-groups",
        (2, 4),
        16,
        2,
        1.1,
        np.stack([_skewed(4, 16, 0, 0.4, 2), _skewed(4, 16, 9, 0.6, 3)]),
    ),
    ("drops", (8,), 16, 1, 0.7, _skewed(8, 16, 5, 0.5, 4)[None]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_replay_rows_groups_slots_equal_the_layer(case):
    name, shape, E, slots, factor, loads_GRE = case
    mesh = expert_mesh(shape[-1], dp=shape[0] if len(shape) == 2 else 1)
    R = shape[-1]
    cfg = uep.BalancerConfig(E, R, slots, min_tokens_per_replica=4, min_tokens_per_rank=0)
    stats, capacity = run_layer(loads_GRE, mesh, cfg, factor)
    assert replay_work.layer_capacity(factor, TOKENS * K) == capacity

    replayed = [replay_work.library_work("ultraep", l, cfg, capacity) for l in loads_GRE]
    want = []
    for loads, work in zip(loads_GRE, replayed, strict=True):
        plan = reference_plan(loads, slots, 4, cfg.balance_eps, capacity=capacity)
        np.testing.assert_array_equal(np.asarray(work.plan.slot_expert), plan["slot_expert"])
        want.append(reference_group_rows(loads, plan, capacity))
        np.testing.assert_array_equal(work.group_rows_RG, want[-1], err_msg=f"{name}: replay")

    got = np.asarray(stats.group_rows)
    assert got.shape == (R, E // R + slots)
    np.testing.assert_array_equal(sum(w.group_rows_RG for w in replayed), got, err_msg=name)
    assert int(stats.replicas) == sum(w.replicas for w in replayed)
    assert int(stats.dropped) == sum(w.dropped for w in replayed)
    if name == "uniform":
        assert int(stats.replicas) == 0
    else:
        assert int(stats.replicas) > 0, "no replica: the case tests nothing about slots"
        assert got[:, E // R :].sum() > 0
    assert (int(stats.dropped) > 0) == (name == "drops")


def test_replay_none_equals_the_plain_layer():
    """Without a balancer the replay's masters-only rows equal the plain layer's."""
    loads = _skewed(8, 16, 3, 0.5, 5)
    mesh = expert_mesh()
    stats, capacity = run_layer(loads[None], mesh, None, None)
    work = replay_work.library_work("none", loads, None, capacity)
    np.testing.assert_array_equal(work.group_rows_RG, np.asarray(stats.group_rows))
    # Masters only: each rank's groups are its experts' loads.
    np.testing.assert_array_equal(work.group_rows_RG, loads.sum(0).reshape(8, 2))
