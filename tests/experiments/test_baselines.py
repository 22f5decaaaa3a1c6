"""Tests for experiments/lab/loads/baselines.py and drift.drifting_stream (fast; hand-computed
cases)."""

import dataclasses

import numpy as np
import pytest

import ultraep_jax as uep
from experiments.lab.loads import baselines as b
from experiments.lab.loads import drift, policies, workloads


def _loads(expert_load, num_ranks=2):
    """A ``[R, E]`` int32 matrix whose column sums are ``expert_load`` (split over sources)."""
    expert_load = np.asarray(expert_load, dtype=np.int64)
    first = expert_load // 2
    rows = [first] + [expert_load - first] + [np.zeros_like(first)] * (num_ranks - 2)
    return np.stack(rows).astype(np.int32)


def _random_loads(rng, num_ranks, num_experts, skew=1.0, pairs=4000):
    p = rng.dirichlet(np.full(num_experts, skew))
    return rng.multinomial(pairs, p, size=num_ranks).astype(np.int32)


def _check_invariants(res: b.Balanced, loads, slots_per_rank):
    """Tokens conserved per expert, non-negative quotas, empty slots idle, slot cap respected."""
    R, E = loads.shape
    assert res.layout.shape == (R, E // R + slots_per_rank)  # at most E/R + S instances per rank
    assert res.quota.shape == res.layout.shape
    assert np.all(res.quota >= 0)
    assert np.all(res.quota[res.layout < 0] == 0)
    valid = res.layout >= 0
    per_expert = np.bincount(res.layout[valid], weights=res.quota[valid], minlength=E)
    np.testing.assert_array_equal(per_expert, loads.sum(axis=0))
    assert res.rank_load.sum() == loads.sum()


# ----------------------------------------------------------------------------- helpers


def test_split_evenly_integer_rule():
    layout = np.array([[0, 1, 0], [1, 0, -1]])
    # expert 0: 7 tokens over 3 instances -> 3, 2, 2 in row-major order; expert 1: 5 over 2 -> 3, 2.
    quota = b.split_evenly(layout, np.array([7, 5]))
    np.testing.assert_array_equal(quota, [[3, 3, 2], [2, 2, 0]])
    with pytest.raises(ValueError):
        b.split_evenly(np.array([[0, 0]]), np.array([1, 1]))  # expert 1 has load, no instance


def test_new_placements_and_masters():
    masters = b.master_layout(2, 4)
    np.testing.assert_array_equal(masters, [[0, 1], [2, 3]])
    new = np.array([[0, 0, 2], [0, 1, 3]])
    # new holds (0,0) (0,2) (1,0) (1,1) (1,3); (0,2), (1,0), (1,1) are not in the master layout.
    assert b.new_placements(masters, new, 4) == 3
    assert b.new_placements(new, new, 4) == 0


# ----------------------------------------------------------------------------- none


def test_none_is_master_loads():
    loads = _loads([10, 6, 3, 1])
    res = b.none(loads)
    np.testing.assert_array_equal(res.layout, [[0, 1], [2, 3]])
    np.testing.assert_array_equal(res.rank_load, [16, 4])
    assert res.num_replicas == 0
    assert res.imbalance == pytest.approx(1.6)


# ----------------------------------------------------------------------------- EPLB (by hand)


def test_eplb_hand_perfect_split_with_colocated_replicas():
    # R=2, E=4, S=1: 6 physical slots, 3 per rank. load_e = [12, 4, 2, 2], mean rank load 10.
    # replicate: 12 -> 6 (e0 twice), then e0 again (6 > 4) -> counts [3, 1, 1, 1], weights
    # [4, 4, 2, 2]. pack heaviest first (equal weights in expert order), least-loaded rank:
    # e0->r0 (4,0) e0->r1 (4,4) e0->r0 (8,4) e1->r1 (8,8) e2->r0 (10,8, r0 full) e3->r1 (10,10).
    loads = _loads([12, 4, 2, 2])
    np.testing.assert_array_equal(b.eplb_replicate([12, 4, 2, 2], 6), [3, 1, 1, 1])
    res = b.eplb_exact(loads, 1)
    np.testing.assert_array_equal(res.layout, [[0, 0, 2], [0, 1, 3]])  # e0 twice on r0
    np.testing.assert_array_equal(res.quota, [[4, 4, 2], [4, 4, 2]])
    np.testing.assert_array_equal(res.rank_load, [10, 10])
    assert res.num_replicas == 2
    _check_invariants(res, loads, 1)


def test_eplb_hand_greedy_is_not_optimal():
    # load_e = [10, 6, 3, 1]: replicate e0 (10 -> 5/5), then e1 (6 > 5) -> weights e0 5,5 e1 3,3
    # e2 3 e3 1. pack: e0->r0 (5,0) e0->r1 (5,5) e1->r0 (8,5) e1->r1 (8,8) e2->r0 (11,8; full)
    # e3->r1 (11,9). max/mean 1.1 although 10/10 exists.
    loads = _loads([10, 6, 3, 1])
    np.testing.assert_array_equal(b.eplb_replicate([10, 6, 3, 1], 6), [2, 2, 1, 1])
    res = b.eplb_exact(loads, 1)
    np.testing.assert_array_equal(res.layout, [[0, 1, 2], [0, 1, 3]])
    np.testing.assert_array_equal(res.rank_load, [11, 9])
    assert res.imbalance == pytest.approx(1.1)


def test_eplb_pack_respects_cap():
    rng = np.random.default_rng(0)
    for _ in range(20):
        R, cap = int(rng.integers(2, 9)), int(rng.integers(1, 5))
        E = int(rng.integers(1, R * cap + 1))
        count = np.ones(E, np.int64) + rng.multinomial(R * cap - E, np.full(E, 1 / E))
        load = rng.integers(0, 100, E)
        layout = b.eplb_pack(load, count, R, cap)
        assert layout.shape == (R, cap)
        np.testing.assert_array_equal(np.bincount(layout[layout >= 0], minlength=E), count)


# ----------------------------------------------------------------------------- eplb_plus


def test_eplb_plus_hand():
    # R=2, E=4, S=1, masters r0 {0,1} (16), r1 {2,3} (4). Slot 1: least-loaded rank r1; heaviest
    # expert it lacks is e0 (10) -> e0 split 5/5, ranks (11, 9). Slot 2: only r0 has a free slot;
    # it lacks e2 (3) and e3 (1) -> e2, split 3 = 2 (first in row-major: r0's replica) + 1.
    loads = _loads([10, 6, 3, 1])
    res = b.eplb_plus(loads, 1)
    np.testing.assert_array_equal(res.layout, [[0, 1, 2], [2, 3, 0]])
    np.testing.assert_array_equal(res.quota, [[5, 6, 2], [1, 1, 5]])
    np.testing.assert_array_equal(res.rank_load, [13, 7])
    assert res.num_replicas == 2
    _check_invariants(res, loads, 1)


# ----------------------------------------------------------------------------- ultraep


def test_ultraep_hand():
    # r0 has excess 6 over the mean 10; the oracle moves 6 of e0's tokens to a replica on r1.
    loads = _loads([10, 6, 3, 1])
    cfg = uep.BalancerConfig(
        num_experts=4, ep_size=2, slots_per_rank=1, min_tokens_per_replica=1, balance_eps=0.0
    )
    res = policies.ultraep(loads, cfg)
    np.testing.assert_array_equal(res.layout, [[0, 1, -1], [2, 3, 0]])
    np.testing.assert_array_equal(res.quota, [[4, 6, 0], [3, 1, 6]])
    np.testing.assert_array_equal(res.rank_load, [10, 10])
    assert res.num_replicas == 1
    _check_invariants(res, loads, 1)


# ----------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("R,E,S", [(2, 4, 1), (4, 16, 2), (8, 32, 2), (3, 6, 3)])
def test_invariants_random(R, E, S):
    rng = np.random.default_rng(R * 100 + E + S)
    cfg = uep.BalancerConfig(num_experts=E, ep_size=R, slots_per_rank=S, min_tokens_per_replica=8)
    batch = np.stack([_random_loads(rng, R, E, skew) for skew in (0.2, 0.5, 1.0, 5.0) * 3])
    ultra = policies.run("ultraep", batch, cfg).balanced
    masters = b.master_layout(R, E)
    for loads, u in zip(batch, ultra, strict=True):
        none = b.none(loads)
        np.testing.assert_array_equal(none.rank_load, workloads.master_rank_loads(loads))
        exact = b.eplb_exact(loads, S)
        plus = b.eplb_plus(loads, S)
        for res in (exact, plus, u):
            _check_invariants(res, loads, S)
        # EPLB fills every physical slot and keeps every expert.
        assert np.all(exact.layout >= 0)
        assert set(exact.layout.ravel().tolist()) == set(range(E))
        # eplb_plus: masters never move, every spare slot used, no expert twice on a rank.
        np.testing.assert_array_equal(plus.layout[:, : E // R], masters)
        if E >= E // R + S:
            assert np.all(plus.layout >= 0)
        for row in plus.layout:
            assert len(set(row[row >= 0].tolist())) == np.count_nonzero(row >= 0)
        # ultraep: masters fixed, rank loads agree with the planner's own.
        np.testing.assert_array_equal(u.layout[:, : E // R], masters)
        assert u.imbalance <= none.imbalance + 1e-12


# ----------------------------------------------------------------------------- eplb_periodic


def test_periodic_window1_interval1_equals_exact():
    stream = drift.drifting_stream(4, 16, 256, 2, 12, seed=3)
    p = b.eplb_periodic(stream, 2, window=1, interval=1)
    assert p.replan_steps == list(range(12))
    prev = b.master_layout(4, 16)
    for loads, got, moved in zip(stream, p.steps, p.new_placements, strict=True):
        want = b.eplb_exact(loads, 2)
        np.testing.assert_array_equal(got.layout, want.layout)
        np.testing.assert_array_equal(got.quota, want.quota)
        assert moved == b.new_placements(prev, want.layout, 16)
        prev = want.layout


def test_periodic_window_interval_and_lag():
    stream = drift.drifting_stream(4, 16, 256, 2, 10, seed=5)
    p = b.eplb_periodic(stream, 1, window=3, interval=4)
    assert p.replan_steps == [0, 4, 8]
    assert len(p.new_placements) == len(p.plan_seconds) == 3
    per_expert = stream.sum(axis=1)
    for t, res in enumerate(p.steps):
        t0 = t // 4 * 4
        want = b.eplb_layout(per_expert[max(0, t0 - 2) : t0 + 1].sum(0), 4, 1)
        np.testing.assert_array_equal(res.layout, want)  # layout from the last re-plan's window
        _check_invariants(res, stream[t], 1)
    # lag=1: no history at step 0, so the master layout holds until the re-plan at step 2.
    lagged = b.eplb_periodic(stream, 1, window=1, interval=2, lag=1)
    assert lagged.replan_steps == [2, 4, 6, 8]
    np.testing.assert_array_equal(lagged.steps[0].rank_load, b.none(stream[0]).rank_load)
    np.testing.assert_array_equal(
        lagged.steps[2].layout, b.eplb_layout(per_expert[1], 4, 1)
    )  # planned on step 1 only


# ----------------------------------------------------------------------------- drifting_stream


def test_drifting_stream_shape_and_determinism():
    a = drift.drifting_stream(8, 32, 128, 4, 40, seed=1)
    assert a.shape == (40, 8, 32) and a.dtype == np.int32
    np.testing.assert_array_equal(a.sum(axis=2), np.full((40, 8), 128 * 4))
    np.testing.assert_array_equal(a, drift.drifting_stream(8, 32, 128, 4, 40, seed=1))
    assert not np.array_equal(a, drift.drifting_stream(8, 32, 128, 4, 40, seed=2))
    with pytest.raises(ValueError):
        drift.drifting_stream(8, 30, 128, 4, 40, seed=1)
    with pytest.raises(ValueError):
        drift.drifting_stream(8, 32, 128, 4, 40, seed=1, jump_every=0.5)


def test_drifting_stream_drifts_and_jumps():
    # Without noise or jumps the popularity is stationary: every step is the same distribution.
    still = drift.drifting_stream(4, 64, 4096, 8, 30, seed=0, drift=0.0, jump_every=np.inf)
    share = still.sum(axis=1) / still.sum(axis=(1, 2))[:, None]
    assert np.abs(share[0] - share[-1]).max() < 0.01
    # A jump at every step re-ranks the experts: consecutive steps barely agree.
    jumpy = drift.drifting_stream(4, 64, 4096, 8, 30, seed=0, jump_every=1.0)
    share = jumpy.sum(axis=1) / jumpy.sum(axis=(1, 2))[:, None]
    corr = [np.corrcoef(share[t], share[t + 1])[0, 1] for t in range(29)]
    assert np.mean(corr) < 0.5
    # Default: neighbouring steps agree far more than steps 300 apart (drift plus jumps).
    s = drift.drifting_stream(4, 64, 1024, 8, 301, seed=0).sum(axis=1).astype(np.float64)
    near = np.mean([np.corrcoef(s[t], s[t + 1])[0, 1] for t in range(0, 300, 30)])
    assert near > np.corrcoef(s[0], s[300])[0, 1] + 0.2


# ----------------------------------------------------------------------------- the runner


def test_run_maps_each_name_to_its_policy():
    # One runner for sim, replay and planner: each name gives its policy's own layouts, timed
    # where it plans on the matrix itself, and says whether those layouts move weights.
    rng = np.random.default_rng(7)
    cfg = uep.BalancerConfig(num_experts=8, ep_size=4, slots_per_rank=1, min_tokens_per_replica=1)
    stream = np.stack([_random_loads(rng, 4, 8, 0.5, 200) for _ in range(3)])
    past = np.stack([_random_loads(rng, 4, 8, 0.5, 200) for _ in range(2)])
    for name, want, relaid in (
        ("none", [b.none(x) for x in stream], False),
        ("eplb_exact", [b.eplb_exact(x, 1) for x in stream], True),
        ("eplb_plus", [b.eplb_plus(x, 1) for x in stream], True),
        (
            "eplb_periodic",
            b.eplb_periodic(np.concatenate([past, stream]), 1, 2, 2, lag=1).steps[2:],
            False,
        ),
        ("ultraep", [policies.ultraep(x, cfg) for x in stream], True),
    ):
        got = policies.run(name, stream, cfg, past)
        assert got.relaid is relaid and len(got.balanced) == len(got.seconds) == 3, name
        for g, w in zip(got.balanced, want, strict=True):
            np.testing.assert_array_equal(g.layout, w.layout, err_msg=name)
            np.testing.assert_array_equal(g.quota, w.quota, err_msg=name)
    with pytest.raises(ValueError, match="unknown policy 'eplb'"):
        policies.run("eplb", stream, cfg)


def test_run_gives_the_librarys_plans_within_the_capacity():
    # ultraep and exact are uep.plan within the layer's buffer (exact: balance_eps = 0), the
    # plans themselves returned for the replay's per-rank counts.
    rng = np.random.default_rng(8)
    cfg = uep.BalancerConfig(num_experts=8, ep_size=4, slots_per_rank=1, min_tokens_per_replica=1)
    stream = np.stack([_random_loads(rng, 4, 8, 0.3, 200) for _ in range(2)])
    for name, c in (("ultraep", cfg), ("exact", dataclasses.replace(cfg, balance_eps=0.0))):
        got = policies.run(name, stream, cfg, capacity=230)
        for i, loads in enumerate(stream):
            want = uep.plan(loads, c, capacity=230)
            np.testing.assert_array_equal(got.plans.slot_expert[i], want.slot_expert)
            np.testing.assert_array_equal(got.plans.slot_quota[i], want.slot_quota)
        assert got.seconds == [0.0, 0.0]  # no timer: not timed
