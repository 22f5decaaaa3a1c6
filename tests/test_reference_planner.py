"""Tests of the NumPy reference planner (tests/reference_planner.py) against ffi/PLANNER.md.

(a) hand-worked plans, derived step by step in the comments from the spec's pseudo-code
    (tau0 = max(ceil(T / R), floor(double(T) * (1.0 + eps) / double(R))); targets chosen by
    pick_target(need), need = min(x, avail): the least slack >= need, else the most slack,
    ties -> smallest rank);
(b) hypothesis property tests over random shapes, skews and scales;
(c) edge cases.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

try:  # tests/ on sys.path (pytest's default rootdir-less import mode)
    from reference_planner import (
        INT32_MAX,
        check_plan_invariants,
        compute_delta,
        compute_tau0,
        oracle,
        rank_loads_before,
        reference_plan,
        reference_plan_info,
        search_tau,
    )
except ImportError:  # tests/ is a package
    from tests.reference_planner import (
        INT32_MAX,
        check_plan_invariants,
        compute_delta,
        compute_tau0,
        oracle,
        rank_loads_before,
        reference_plan,
        reference_plan_info,
        search_tau,
    )


def loads_from_expert_totals(load_e, R, rows=None):
    """A [R, E] int32 load matrix whose column sums are ``load_e`` (all tokens on row 0 unless
    ``rows`` gives a [R, E] split)."""
    load_e = np.asarray(load_e, dtype=np.int64)
    if rows is not None:
        out = np.asarray(rows, dtype=np.int64)
        assert (out.sum(axis=0) == load_e).all()
        return out.astype(np.int32)
    out = np.zeros((R, load_e.size), dtype=np.int64)
    out[0] = load_e
    return out.astype(np.int32)


def assert_plan(plan, slot_expert, slot_quota, master_quota, rank_load):
    expected = {
        "slot_expert": slot_expert,
        "slot_quota": slot_quota,
        "master_quota": master_quota,
        "rank_load": rank_load,
    }
    assert set(plan) == set(expected)
    for k, v in expected.items():
        assert plan[k].dtype == np.int32, (k, plan[k].dtype)
        np.testing.assert_array_equal(plan[k], np.asarray(v, dtype=np.int32), err_msg=k)


# ============================================================================================
# (a) hand-worked examples
# ============================================================================================


def test_hand_r2_e2_s1_first_probe():
    # R=2, E=2 (E_m=1), S=1, F=1, K=1, eps=0.
    # loads rows [[6,1],[4,1]] -> load_e = [10, 2]; L = [10, 2]; T = 12; Lmax = 10.
    # tau0 = max(ceil(12 / 2), floor(12 * 1.0 / 2)) = max(6, 6) = 6 < 10;
    # delta = max(1, ceil(12 * 0 / 2 / 2)) = max(1, 0) = 1.
    # try(6): slack = [0, 4], free = [1, 1]; rank order 0, 1. d=0: x = 4. expert 0: fl = 1,
    #   avail = 10-1-0 = 9, need = min(4, 9) = 4; pick_target(4): the only candidate is rank 1
    #   (slack 4 >= 4, a fit) -> q = min(4, 4, 9) = 4. x = 0 -> success.
    # Plan: rank 1 slot 0 holds expert 0 with 4 tokens; master_quota = [6, 2];
    #   rank_load = [10-4, 2+4] = [6, 6].
    loads = np.array([[6, 1], [4, 1]], dtype=np.int32)
    plan, info = reference_plan_info(loads, 1, 1, 0.0, 1)
    assert info["tau0"] == 6 and info["delta"] == 1 and info["tau"] == 6
    assert info["probes"] == [6]
    assert info["replicas"] == [(0, 1, 4)]
    assert_plan(plan, [[-1], [0]], [[0], [4]], [6, 2], [6, 6])
    check_plan_invariants(loads, plan, 1)


def test_hand_r2_e2_s1_adaptive_floor():
    # Same loads with F=5: tau0 = 6 as above. At try(6) x = 4, so fl = min(5, 4) = 4 (adaptive
    # floor); avail = 9 >= 4, need = 4, rank 1 (slack 4) fits, q = 4 >= fl = 4 -> success.
    loads = np.array([[6, 1], [4, 1]], dtype=np.int32)
    plan, info = reference_plan_info(loads, 1, 5, 0.0, 1)
    assert info["tau"] == 6
    assert_plan(plan, [[-1], [0]], [[0], [4]], [6, 2], [6, 6])


def test_hand_r2_e2_s1_third_fast_probe_master_keep():
    # Same loads, K=8: avail = 10 - 8 = 2 tokens may leave expert 0. tau0 = 6, delta = 1.
    # try(6): x=4; need = min(4, 2) = 2, rank 1 (slack 4) fits: q = min(4, 4, 2) = 2, x = 2,
    #   free[1] = 0; then avail = 0 < fl=1 -> break; no more experts on rank 0, x > 0 -> failure.
    # try(7) (tau0 + delta): x=3, need 2, q = 2, x = 1 -> failure the same way.
    # try(8) (tau0 + 2 delta): x=2, need = min(2, 2) = 2, rank 1 (slack 6) fits:
    #   q = min(2, 6, 2) = 2 -> success.
    # Plan: rank 1 slot 0 = expert 0 with 2 tokens; master_quota = [8, 2]; rank_load = [8, 4].
    loads = np.array([[6, 1], [4, 1]], dtype=np.int32)
    plan, info = reference_plan_info(loads, 1, 1, 0.0, 8)
    assert info["probes"] == [6, 7, 8]
    assert info["tau"] == 8
    assert_plan(plan, [[-1], [0]], [[0], [2]], [8, 2], [8, 4])
    check_plan_invariants(loads, plan, 1)


def test_hand_fallback_coarse_probe_refine_skipped():
    # R=2, E=2, S=1, F=1, K=16, eps=0. load_e = [20, 2]; L = [20, 2]; T = 22;
    # tau0 = max(ceil(22 / 2), floor(22 / 2)) = 11; delta = 1. Rank 1 is the only target and gets
    # one replica (S = 1) of at most avail = 20 - 16 = 4 tokens, so try(tau) succeeds iff
    # x = 20 - tau <= 4, i.e. tau >= 16.
    # Fast path 11, 12, 13, 14 fails. lo = 14, span = 20 - 14 = 6, c_j = 14 + (6 j) // 32:
    #   j = 1..5 -> 14, j = 6..10 -> 15, j = 11 -> 16 (66 // 32 = 2). j* = 11.
    # Refine between c_10 = 15 and c_11 = 16: r_i = 15 + i // 16 = 15 for i = 1..15, all skipped
    #   (r_i <= c_10). So c_11 = 16 wins.
    # try(16): x = 4, need = min(4, 4) = 4, rank 1 (slack 14) fits, q = min(4, 14, 4) = 4.
    loads = loads_from_expert_totals([20, 2], 2)
    plan, info = reference_plan_info(loads, 1, 1, 0.0, 16)
    assert info["tau0"] == 11 and info["delta"] == 1
    assert info["probes"] == [11, 12, 13, 14] + [14] * 5 + [15] * 5 + [16]
    assert info["tau"] == 16
    assert_plan(plan, [[-1], [0]], [[0], [4]], [16, 2], [16, 6])
    check_plan_invariants(loads, plan, 1)


def test_hand_fallback_refine_wins():
    # R=2, E=2, S=1, F=1, K=1490, eps=0. load_e = [2000, 0]; L = [2000, 0]; T = 2000;
    # tau0 = max(1000, floor(2000.0 / 2)) = 1000; delta = 1. One replica on rank 1 of at most
    # avail = 510 tokens: success iff x = 2000 - tau <= 510, i.e. tau >= 1490.
    # Fast path 1000..1003 fails. lo = 1003, span = 997; c_j = 1003 + (997 j) // 32:
    #   c_15 = 1003 + 14955 // 32 = 1003 + 467 = 1470 (fails),
    #   c_16 = 1003 + 15952 // 32 = 1003 + 498 = 1501 (first success) -> j* = 16.
    # Refine: r_i = 1470 + (31 i) // 16: i = 10 -> 1470 + 19 = 1489 (fails),
    #   i = 11 -> 1470 + 341 // 16 = 1470 + 21 = 1491 (succeeds) -> tau = 1491.
    # try(1491): x = 509, avail = 510, need = 509, rank 1 (slack 1491) fits -> q = 509.
    # master_quota = [1491, 0]; rank_load = [1491, 509].
    loads = loads_from_expert_totals([2000, 0], 2)
    plan, info = reference_plan_info(loads, 1, 1, 0.0, 1490)
    coarse = [1003 + (997 * j) // 32 for j in range(1, 17)]
    assert coarse[14] == 1470 and coarse[15] == 1501
    refine = [1470 + (31 * i) // 16 for i in range(1, 12)]
    assert refine[-2:] == [1489, 1491]
    assert info["probes"] == [1000, 1001, 1002, 1003] + coarse + refine
    assert info["tau"] == 1491
    assert_plan(plan, [[-1], [0]], [[0], [509]], [1491, 0], [1491, 509])
    check_plan_invariants(loads, plan, 1)


HOT8 = [100, 10, 10, 10, 10, 10, 10, 10]


def test_hand_r4_e8_s2_one_hot_expert():
    # R=4, E=8 (E_m=2), S=2, F=1, K=1, eps=0. load_e = HOT8; L = [110, 20, 20, 20]; T = 170;
    # tau0 = max(ceil(170 / 4), floor(42.5)) = max(43, 42) = 43 (the ceil term wins); Lmax = 110.
    # try(43): slack = [0, 23, 23, 23]; rank order 0, 1, 2, 3. d=0: x = 67; expert order e0 (100),
    #   e1 (10). e0: avail 99, need 67: no slack >= 67 -> the most slack, 23, ties -> rank 1:
    #   q = 23, x = 44. avail 76, need 44: no fit -> most slack, rank 2 (23): q = 23, x = 21.
    #   avail 53, need 21: rank 3 (23 >= 21) is the only fit: q = min(21, 23, 53) = 21.
    # Plan: ranks 1, 2, 3 hold e0 in slot 0 with 23, 23, 21; master_quota[0] = 100 - 67 = 33;
    #   rank_load = [43, 43, 43, 41].
    # The tokens are spread over the source rows: only the column sums matter.
    rng = np.random.default_rng(0)
    rows = np.zeros((4, 8), dtype=np.int64)
    for e, n in enumerate(HOT8):
        rows[:, e] = rng.multinomial(n, [0.25] * 4)
    loads = loads_from_expert_totals(HOT8, 4, rows)
    plan, info = reference_plan_info(loads, 2, 1, 0.0, 1)
    assert info["tau"] == 43 and info["probes"] == [43]
    assert info["replicas"] == [(0, 1, 23), (0, 2, 23), (0, 3, 21)]
    assert_plan(
        plan,
        [[-1, -1], [0, -1], [0, -1], [0, -1]],
        [[0, 0], [23, 0], [23, 0], [21, 0]],
        [33, 10, 10, 10, 10, 10, 10, 10],
        [43, 43, 43, 41],
    )
    check_plan_invariants(loads, plan, 2)


def test_hand_r4_e8_s2_one_hot_expert_large_floor():
    # As above with F = 30 (tau0 = 43, delta = 1).
    # try(43): x = 67, fl = 30, need 67: no fit -> most slack, rank 1 (23): q = 23 < 30 -> failure.
    #   Likewise try(44), try(45), try(46): need 66..64 > slack 24..26, q = slack < 30.
    # Fallback: lo = 46, span = 64, c_j = 46 + 2 j. c_1 = 48: need 62 > slack 28, q = 28 < 30
    #   -> failure. c_2 = 50: x = 60, need 60 > slack 30: most slack, tie -> rank 1, q = 30,
    #   x = 30; fl = 30, avail 69, need 30: ranks 2 and 3 (30) both fit, tie -> rank 2, q = 30,
    #   x = 0 -> success. j* = 2.
    # Refine between 48 and 50: r_i = 48 + (2 i) // 16: i = 1..7 -> 48 (skipped), i = 8..15 -> 49:
    #   try(49): x = 61, need 61 > slack 29, q = 29 < 30 -> failure (probed 8 times).
    #   c_2 = 50 wins.
    # Plan: e0 replicas on ranks 1, 2 with 30 each; master_quota[0] = 40;
    #   rank_load = [50, 50, 50, 20].
    loads = loads_from_expert_totals(HOT8, 4)
    plan, info = reference_plan_info(loads, 2, 30, 0.0, 1)
    assert info["probes"] == [43, 44, 45, 46, 48, 50] + [49] * 8
    assert info["tau"] == 50
    assert_plan(
        plan,
        [[-1, -1], [0, -1], [0, -1], [-1, -1]],
        [[0, 0], [30, 0], [30, 0], [0, 0]],
        [40, 10, 10, 10, 10, 10, 10, 10],
        [50, 50, 50, 20],
    )
    check_plan_invariants(loads, plan, 2)


def test_hand_rank_order_tie_break():
    # R=4, E=4 (E_m=1), S=1, F=1, K=1, eps=0. load_e = [30, 30, 0, 0]; T = 60;
    # tau0 = max(15, floor(15.0)) = 15. Rank order: 0, 1 (tie on L=30 -> index), 2, 3.
    # d=0: x = 15, avail 29, need 15; slack = [0, 0, 15, 15]: ranks 2 and 3 both fit with the same
    #   slack -> tie -> rank 2, q = 15.
    # d=1: x = 15, need 15; rank 2 has no slack left -> rank 3 (15, fits), q = 15.
    loads = loads_from_expert_totals([30, 30, 0, 0], 4)
    plan = reference_plan(loads, 1, 1, 0.0)
    assert_plan(
        plan, [[-1], [-1], [0], [1]], [[0], [0], [15], [15]], [15, 15, 0, 0], [15, 15, 15, 15]
    )
    check_plan_invariants(loads, plan, 1)


def test_hand_expert_order_tie_break_and_slot_order():
    # R=2, E=4 (E_m=2), S=2, F=1, K=1, eps=0. load_e = [5, 5, 0, 0]; L = [10, 0]; T = 10;
    # tau0 = max(5, floor(5.0)) = 5.
    # try(5): d=0, x = 5; expert order e0, e1 (tie -> index).
    #   e0: avail = 4, need = min(5, 4) = 4, rank 1 (slack 5) fits: q = min(5, 5, 4) = 4, x = 1;
    #   then avail = 0 -> break.
    #   e1: fl = 1, avail = 4, need 1, rank 1 (slack 1, one free slot) fits: q = 1, x = 0.
    # Rank 1: slot 0 = e0 (4), slot 1 = e1 (1) (creation order). master_quota = [1, 4, 0, 0].
    loads = loads_from_expert_totals([5, 5, 0, 0], 2)
    plan = reference_plan(loads, 2, 1, 0.0)
    assert_plan(plan, [[-1, -1], [0, 1]], [[0, 0], [4, 1]], [1, 4, 0, 0], [5, 5])
    check_plan_invariants(loads, plan, 2)

    # With S=1, try(5) fails: after the e0 replica rank 1 has no free slot, so pick_target finds no
    # candidate for e1. try(6) (delta = 1): x = 4, e0: need = min(4, 4) = 4, rank 1 (slack 6) fits:
    # q = min(4, 6, 4) = 4 -> success. master_quota = [1, 5, 0, 0]; rank_load = [6, 4].
    plan, info = reference_plan_info(loads, 1, 1, 0.0)
    assert info["probes"] == [5, 6]
    assert_plan(plan, [[-1], [0]], [[0], [4]], [1, 5, 0, 0], [6, 4])
    check_plan_invariants(loads, plan, 1)


def test_hand_master_keep_zero_drains_a_master():
    # R=3, E=6 (E_m=2), S=2, F=1, K=0, eps=0. load_e = [9, 9, 0, 0, 0, 0]; L = [18, 0, 0];
    # T = 18, tau0 = max(6, floor(6.0)) = 6. try(6): slack = [0, 6, 6]; d=0: x = 12;
    #   e0 (tie -> index 0 first): avail 9, need = min(12, 9) = 9 > every slack -> most slack,
    #   tie -> rank 1: q = 6, x = 6; avail 3, need 3: rank 2 (6) is the only candidate and fits:
    #   q = 3, x = 3; avail 0 -> break. e1: avail 9, need 3: rank 2 (slack 3, one slot left) fits:
    #   q = 3, x = 0.
    # master_quota[0] = 0 (K = 0 lets the master keep nothing).
    loads = loads_from_expert_totals([9, 9, 0, 0, 0, 0], 3)
    plan = reference_plan(loads, 2, 1, 0.0, 0)
    assert_plan(
        plan,
        [[-1, -1], [0, -1], [0, 1]],
        [[0, 0], [6, 0], [3, 3]],
        [0, 6, 0, 0, 0, 0],
        [6, 6, 6],
    )
    check_plan_invariants(loads, plan, 2)


NONMONO_LOAD_E = [1, 3, 44, 96, 1, 5, 9, 8]


def test_hand_oracle_is_not_monotone():
    # R=4, E_m=2, S=1, F=40, K=10. L = [4, 140, 6, 17], Lmax = 140.
    # try(50): slack = [46, 0, 44, 33]; d=1, x = 90; expert order e3 (96), e2 (44).
    #   e3: fl 40, avail 86, need 86 > every slack -> most slack, rank 0 (46): q = 46, x = 44;
    #   fl 40, avail 40, need = min(44, 40) = 40: fits are slack >= 40 with a free slot: only
    #   rank 2 (44; rank 3 has 33): q = min(44, 44, 40) = 40 >= 40, x = 4; fl 4, avail 0 -> break.
    #   e2: fl 4, avail 34, need 4: candidates rank 3 only (ranks 0 and 2 have no free slot),
    #   33 >= 4 fits: q = 4, x = 0 -> success.
    # try(51): slack = [47, 0, 45, 34]; x = 89. e3: need 86, no fit -> rank 0 (47): q = 47, x = 42;
    #   fl 40, avail 39 -> break. e2: fl 40, avail 34 -> break. x > 0 -> failure.
    load_e = NONMONO_LOAD_E
    L = [4, 140, 6, 17]
    ok, reps = oracle(50, load_e, L, 1, 40, 10)
    assert ok and reps == [(3, 0, 46), (3, 2, 40), (2, 3, 4)]
    assert oracle(51, load_e, L, 1, 40, 10) == (False, [])


def test_hand_nonmonotone_case_full_plan():
    # Same input through the search, eps = 0: T = 167,
    # tau0 = max(ceil(167 / 4), floor(41.75)) = max(42, 41) = 42 (the ceil term wins), delta = 1.
    # e3 (avail 86) always comes first and its first need, min(x, 86) = 86, exceeds every slack,
    # so its first replica goes to the most slack, rank 0.
    # try(42), try(43): rank 0's slack 38, 39 is the q, < fl 40 -> failure.
    # try(44): (e3 -> rank 0, 40), x = 56, avail 46, need 46 > slacks 38, 27 -> most slack,
    #   rank 2: q = 38 < 40 -> failure.
    # try(45): (e3 -> rank 0, 41), x = 54, avail 45, need 45 > 39, 28 -> rank 2: q = 39 < 40 ->
    #   failure.
    # Fallback: lo = 45, span = 95, c_1 = 45 + 95 // 32 = 47:
    #   slack [43, 0, 41, 30], x = 93: (e3 -> 0, 43), x = 50, avail 43, need 43 > 41, 30 -> most
    #   slack: (e3 -> 2, min(50,41,43)=41), x = 9, avail 2 < 9 -> break; e2: fl 9, avail 34,
    #   need 9, rank 3 (30) is the only candidate and fits: q = 9 -> success. j* = 1.
    # Refine between c_0 = 45 and c_1 = 47: r_i = 45 + (2 i) // 16: i = 1..7 -> 45 (skipped),
    #   i = 8 -> 46: slack [42, 0, 40, 29], x = 94: (e3 -> 0, 42), x = 52, avail 44, need 44 > 40,
    #   29: (e3 -> 2, min(52, 40, 44) = 40), x = 12, avail 4 < 12 -> break; e2: fl 12, avail 34,
    #   need 12, rank 3 (29) fits: q = 12 -> success. tau = 46.
    # master_quota = [1, 3, 44-12, 96-82, 1, 5, 9, 8]; rank_load = [46, 46, 46, 29].
    loads = loads_from_expert_totals(NONMONO_LOAD_E, 4)
    plan, info = reference_plan_info(loads, 1, 40, 0.0, 10)
    assert info["probes"] == [42, 43, 44, 45, 47, 46]
    assert info["tau"] == 46
    assert info["replicas"] == [(3, 0, 42), (3, 2, 40), (2, 3, 12)]
    assert_plan(
        plan,
        [[3], [-1], [3], [2]],
        [[42], [0], [40], [12]],
        [1, 3, 32, 14, 1, 5, 9, 8],
        [46, 46, 46, 29],
    )
    check_plan_invariants(loads, plan, 1)


def test_hand_best_fit_prefers_the_smaller_fitting_slack():
    # R=4, E=4 (E_m=1), S=1, F=1, K=1, eps=0.5. load_e = L = [12, 0, 2, 6]; T = 20; Lmax = 12.
    # tau0 = max(ceil(20 / 4), floor(20.0 * 1.5 / 4.0)) = max(5, floor(7.5)) = 7 (the floor term
    # wins); delta = max(1, ceil(20 * 0.5 / 4 / 2)) = ceil(1.25) = 2.
    # try(7): slack = [0, 7, 5, 1], free = [1, 1, 1, 1]; rank order 0 (12), 3 (6), 2 (2), 1 (0).
    #   d=0: x = 5; e0: fl = 1, avail = 11, need = min(5, 11) = 5. Candidates: ranks 1 (7),
    #   2 (5), 3 (1); those that take all 5: ranks 1 (7) and 2 (5) -> the least slack, rank 2
    #   (the most-slack rule would have picked rank 1). q = min(5, 5, 11) = 5, x = 0.
    #   d=3: x = 6 - 7 <= 0 -> break. Success at the first probe.
    # Plan: rank 2 slot 0 = e0 with 5; master_quota = [7, 0, 2, 6]; rank_load = [7, 0, 7, 6]
    #   (rank 1 keeps its whole slack of 7 for a larger excess).
    loads = loads_from_expert_totals([12, 0, 2, 6], 4)
    plan, info = reference_plan_info(loads, 1, 1, 0.5, 1)
    assert info["tau0"] == 7 and info["delta"] == 2
    assert info["probes"] == [7] and info["tau"] == 7
    assert info["replicas"] == [(0, 2, 5)]
    assert_plan(plan, [[-1], [-1], [0], [-1]], [[0], [0], [5], [0]], [7, 0, 2, 6], [7, 0, 7, 6])
    check_plan_invariants(loads, plan, 1)


def test_hand_no_fit_takes_the_most_slack():
    # R=3, E=3 (E_m=1), S=1, F=1, K=1, eps=0. load_e = L = [20, 5, 2]; T = 27; Lmax = 20.
    # tau0 = max(ceil(27 / 3), floor(27.0 / 3.0)) = max(9, 9) = 9; delta = 1.
    # try(9): slack = [0, 4, 7]; rank order 0, 1, 2. d=0: x = 11; e0: avail = 19,
    #   need = min(11, 19) = 11. Candidates rank 1 (4) and rank 2 (7): neither takes 11 -> the
    #   most slack, rank 2 (not the smaller index 1): q = min(11, 7, 19) = 7, x = 4, slack[2] = 0.
    #   avail 12, need = min(4, 12) = 4: rank 1 (4) is the only candidate and fits: q = 4, x = 0.
    #   d=1: x = 5 - 9 <= 0 -> break.
    # Plan: rank 1 slot 0 = e0 with 4, rank 2 slot 0 = e0 with 7; master_quota = [9, 5, 2];
    #   rank_load = [9, 9, 9].
    loads = loads_from_expert_totals([20, 5, 2], 3)
    plan, info = reference_plan_info(loads, 1, 1, 0.0, 1)
    assert info["tau0"] == 9 and info["probes"] == [9] and info["tau"] == 9
    assert info["replicas"] == [(0, 2, 7), (0, 1, 4)]
    assert_plan(plan, [[-1], [0], [0]], [[0], [4], [7]], [9, 5, 2], [9, 9, 9])
    check_plan_invariants(loads, plan, 1)


def test_hand_best_fit_reaches_tau0_where_most_slack_would_fail():
    # R=4, E=8 (E_m=2), S=1, F=1, K=1, eps=0. load_e = [12, 12, 0, 0, 3, 2, 1, 5];
    # L = [24, 0, 5, 6]; T = 35; Lmax = 24.
    # tau0 = max(ceil(35 / 4), floor(8.75)) = max(9, 8) = 9 (the ceil term wins); delta = 1.
    # try(9): slack = [0, 9, 4, 3], free = [1, 1, 1, 1]; rank order 0 (24), 3 (6), 2 (5), 1 (0).
    #   d=0: x = 15; expert order e0, e1 (tie on 12 -> index).
    #   e0: avail = 11, need = min(15, 11) = 11 > every slack (9, 4, 3) -> most slack, rank 1:
    #     q = min(15, 9, 11) = 9, x = 6; slack[1] = 0, free[1] = 0.
    #     avail = 2, need = min(6, 2) = 2: ranks 2 (4) and 3 (3) both fit -> least slack, rank 3:
    #     q = min(6, 3, 2) = 2, x = 4; slack[3] = 1, free[3] = 0. avail = 0 < fl -> break.
    #   e1: avail = 11, need = min(4, 11) = 4: the only candidate is rank 2 (slack 4, free 1),
    #     which fits: q = 4, x = 0.
    #   d=3: x = 6 - 9 <= 0 -> break. Success at tau0.
    # (The most-slack rule would send the 2-token replica to rank 2, whose only slot then holds
    #  it with 2 slack unused; e1's 4 tokens would find only rank 3 (3): q = 3, x = 1, then no
    #  candidate -> try(9) would fail.)
    # Plan: replicas (e0 -> 1, 9), (e0 -> 3, 2), (e1 -> 2, 4); master_quota[0] = 12 - 11 = 1,
    #   master_quota[1] = 12 - 4 = 8; rank_load = [24 - 15, 0 + 9, 5 + 4, 6 + 2] = [9, 9, 9, 8].
    load_e = [12, 12, 0, 0, 3, 2, 1, 5]
    loads = loads_from_expert_totals(load_e, 4)
    plan, info = reference_plan_info(loads, 1, 1, 0.0, 1)
    assert info["tau0"] == 9 and info["probes"] == [9] and info["tau"] == 9
    assert info["replicas"] == [(0, 1, 9), (0, 3, 2), (1, 2, 4)]
    assert_plan(
        plan,
        [[-1], [0], [1], [0]],
        [[0], [9], [4], [2]],
        [1, 8, 0, 0, 3, 2, 1, 5],
        [9, 9, 9, 8],
    )
    check_plan_invariants(loads, plan, 1)


# --- the IEEE-double formulas -----------------------------------------------------------------


def test_tau0_ieee_order_examples():
    # tau0 = max(ceil(T / R), floor(double(T) * (1.0 + eps) / double(R))): the first term in
    # exact integers, the second as IEEE double 1.0 + eps, then multiply, then divide, then floor.
    # Every claim about a double below is checked exactly with fractions.Fraction.

    # (1) The ceil term wins. eps = 0, T = 170, R = 4: 170.0 / 4.0 = 42.5 exactly, floor 42 <
    # ceil(42.5) = 43. Also with eps > 0: T = 10, R = 4, eps = 0.1: 10.0 * 1.1 / 4.0 = 2.75
    # (the exact product with the double 1.1 is just above 2.75), floor 2 < ceil(2.5) = 3.
    # And T = 2^31 - 1, R = 4, eps = 0: floor(536870911.75) = 536870911 < 536870912.
    assert Fraction(170.0 * (1.0 + 0.0) / 4.0) == Fraction(85, 2)
    assert compute_tau0(170, 4, 0.0) == 43
    assert math.floor(Fraction(10) * Fraction(1.0 + 0.1) / 4) == 2
    assert compute_tau0(10, 4, 0.1) == 3
    assert compute_tau0(INT32_MAX, 4, 0.0) == 536870912
    assert compute_tau0(1000, 4, 0.0) == 250  # both terms 250
    assert compute_tau0(1, 2, 0.0) == 1  # ceil(0.5) = 1 > floor(0.5) = 0

    # (2) 1.0 + eps is rounded before the multiply. eps = 0.3: the binary 0.3 is just below 3/10,
    # but 1.0 + 0.3 rounds up to the double just above 13/10. 20.0 * that = 26 + 2^-50 exactly,
    # which rounds to 26.0 (a quarter ulp away); 26.0 / 2.0 = 13.0 -> 13. The exact value with the
    # binary eps, 20 * (1 + 0.3_binary) / 2, is just below 13 -> floor 12. The spec's order gives
    # 13 (the second term wins over ceil(20 / 2) = 10).
    e = Fraction(0.3)
    assert e < Fraction(3, 10) and Fraction(1.0 + 0.3) > Fraction(13, 10)
    assert math.floor(Fraction(20) * (1 + e) / 2) == 12
    assert Fraction(20) * Fraction(1.0 + 0.3) - 26 == Fraction(1, 2**50)
    assert 20.0 * (1.0 + 0.3) == 26.0 and 26.0 / 2.0 == 13.0
    assert compute_tau0(20, 2, 0.3) == 13

    # (3) Multiply first, then divide. eps = 0.2, T = 35, R = 3: 1.0 + 0.2 is the double just below
    # 6/5; 35 * that = 42 - 7 * 2^-52 exactly, which rounds to 42.0 (less than half an ulp of
    # 2^-47); 42.0 / 3.0 = 14.0 -> 14. Dividing first, 35.0 / 3.0 * 1.2 = 13.999999999999998 -> 13.
    # The exact value with the binary eps (0.2_binary > 1/5) is just above 14 -> 14 as well.
    assert Fraction(1.0 + 0.2) < Fraction(6, 5)
    assert 42 - Fraction(35) * Fraction(1.0 + 0.2) == Fraction(7, 2**52)
    assert 35.0 * (1.0 + 0.2) == 42.0 and 42.0 / 3.0 == 14.0
    assert Fraction(35.0 / 3.0 * (1.0 + 0.2)) < 14
    assert math.floor(Fraction(35) * (1 + Fraction(0.2)) / 3) == 14
    assert compute_tau0(35, 3, 0.2) == 14
    assert math.floor(35.0 / 3.0 * (1.0 + 0.2)) == 13

    # (4) IEEE rounding lands just below an integer, and the floor keeps it there. eps = 0.16,
    # T = 50, R = 2: 1.0 + 0.16 rounds to the double just below 29/25; 50.0 * that =
    # 57.99999999999999, / 2.0 = 28.999999999999996 -> 28, although the exact value with the
    # binary eps (0.16_binary >= 4/25) is >= 29 (and the decimal value is exactly 29).
    assert Fraction(1.0 + 0.16) < Fraction(29, 25)
    assert Fraction(50.0 * (1.0 + 0.16) / 2.0) < 29
    assert math.floor(Fraction(50) * (1 + Fraction(0.16)) / 2) == 29
    assert compute_tau0(50, 2, 0.16) == 28

    # (5) floor, not ceil: 90.0 * 1.1 = 99.00000000000001, / 3.0 = 33.00000000000001 (the exact
    # value with the binary 0.1 is just above 33 too) -> 33; a ceil would give 34. Likewise
    # 50.0 * 1.1 / 5.0 = 11.000000000000002 -> 11, and 20.0 * 1.1 / 2.0 = 11.0 exactly -> 11.
    assert 33 < Fraction(90.0 * (1.0 + 0.1) / 3.0) < 34
    assert 33 < Fraction(90) * (1 + Fraction(0.1)) / 3 < 34
    assert compute_tau0(90, 3, 0.1) == 33
    assert 11 < Fraction(50.0 * (1.0 + 0.1) / 5.0) < 12
    assert compute_tau0(50, 5, 0.1) == 11
    assert 20.0 * (1.0 + 0.1) / 2.0 == 11.0
    assert compute_tau0(20, 2, 0.1) == 11


@settings(max_examples=300, deadline=None)
@given(
    T=st.integers(0, INT32_MAX * 8),
    R=st.integers(1, 64),
    eps=st.one_of(
        st.sampled_from([0.0, 0.01, 0.05, 0.1, 0.16, 0.2, 0.3, 0.5, 1.0]),
        st.floats(0.0, 4.0, allow_nan=False, allow_infinity=False),
    ),
)
def test_tau0_formula_properties(T, R, eps):
    # tau0 = max(ceil(T / R), floor(v)) with v = double(T) * (1.0 + eps) / double(R) (IEEE):
    # an integer >= ceil(T / R); equal to it when v < ceil(T / R), else floor(v) (the largest
    # integer <= v); and within one of the exact-rational max(ceil(T / R), floor(T (1 + eps) / R)).
    tau0 = compute_tau0(T, R, eps)
    c = -(-T // R)
    v = float(T) * (1.0 + eps) / float(R)
    assert isinstance(tau0, int) and tau0 >= c
    if v < c:
        assert tau0 == c
    else:
        assert tau0 <= v < tau0 + 1
    exact = max(c, math.floor(Fraction(T) * (1 + Fraction(eps)) / R))
    assert abs(tau0 - exact) <= 1
    if eps == 0.0:
        assert tau0 == c  # floor(T / R) <= ceil(T / R)


def test_delta_ieee_examples():
    # 40 * 0.1 / 2 / 2 == 1.0 in IEEE double (exact binary value is just above 1 -> 2).
    assert compute_delta(40, 2, 0.1) == 1
    assert math.ceil(Fraction(40) * Fraction(0.1) / 2 / 2) == 2
    assert compute_delta(1000, 4, 0.0) == 1  # max(1, 0)
    assert compute_delta(100, 4, 0.5) == 7  # ceil(6.25)
    assert compute_delta(10**6, 8, 0.05) == 3125


def test_tau0_ieee_order_in_a_full_plan():
    # R=2, E=2, S=1, F=1, K=1, eps=0.3, load_e = [20, 0]: T = 20, tau0 = 13 (example (2) above;
    # an exact-rational tau0 with the binary eps would be 12); delta = ceil(20 * 0.3 / 2 / 2) =
    # ceil(1.5) = 2. try(13): x = 7, avail 19, need 7, rank 1 (slack 13) fits: q = 7.
    # rank_load = [13, 7] (tau0 = 12 would give [12, 8]).
    loads = loads_from_expert_totals([20, 0], 2)
    plan, info = reference_plan_info(loads, 1, 1, 0.3)
    assert info["tau0"] == 13 and info["probes"] == [13]
    assert_plan(plan, [[-1], [0]], [[0], [7]], [13, 0], [13, 7])
    # R=3, E=3, S=1, F=1, K=1, eps=0.2, load_e = [35, 0, 0]: tau0 = 14 (example (3); dividing
    # first would give 13). try(14): slack [0, 14, 14], x = 21, need = min(21, 34) = 21 > 14, 14
    # -> most slack, tie -> rank 1: q = 14, x = 7; need 7: rank 2 (14) fits: q = 7.
    loads = loads_from_expert_totals([35, 0, 0], 3)
    plan, info = reference_plan_info(loads, 1, 1, 0.2)
    assert info["tau0"] == 14 and info["probes"] == [14]
    assert_plan(plan, [[-1], [0], [0]], [[0], [14], [7]], [14, 0, 0], [14, 14, 7])
    # R=3, E=3, S=1, F=1, K=1, eps=0.1, load_e = [90, 0, 0]: tau0 = 33 (example (5)).
    # try(33): slack [0, 33, 33], x = 57, need 57 > 33 -> most slack, tie -> rank 1: q = 33,
    # x = 24; need 24: rank 2 (33) fits: q = 24. rank_load = [33, 33, 24].
    loads = loads_from_expert_totals([90, 0, 0], 3)
    plan, info = reference_plan_info(loads, 1, 1, 0.1)
    assert info["tau0"] == 33 and info["probes"] == [33]
    assert_plan(plan, [[-1], [0], [0]], [[0], [33], [24]], [33, 0, 0], [33, 33, 24])
    # R=2, E=2, S=1, F=1, K=1, eps=0.16, load_e = [50, 0]: tau0 = 28 (example (4); the decimal
    # value would be 29). try(28): x = 22, need 22, rank 1 (28) fits: q = 22. rank_load [28, 22].
    loads = loads_from_expert_totals([50, 0], 2)
    plan, info = reference_plan_info(loads, 1, 1, 0.16)
    assert info["tau0"] == 28 and info["probes"] == [28]
    assert_plan(plan, [[-1], [0]], [[0], [22]], [28, 0], [28, 22])


def test_delta_ieee_in_a_full_plan():
    # R=2, E=2, S=1, eps=0.1, load_e = [40, 0]: T = 40. 40 * (1.0 + 0.1) = 44 + 2^-48 exactly,
    # half an ulp (2^-47) above 44: ties-to-even rounds it to 44.0; / 2.0 = 22.0, so
    # tau0 = max(ceil(40 / 2), 22) = 22. delta = 1 (IEEE). With K = 23, rank 1 takes one replica
    # of at most avail = 40 - 23 = 17 tokens, so the oracle needs x = 40 - tau <= 17, tau >= 23:
    # try(22): x = 18, need = min(18, 17) = 17, rank 1 (slack 22) fits, q = 17, x = 1, avail 0
    # -> failure. try(23) = tau0 + delta: x = 17, need 17, q = 17 -> success (an exact delta of 2
    # would probe 24 instead).
    assert Fraction(40) * Fraction(1.0 + 0.1) - 44 == Fraction(1, 2**48)
    assert 40.0 * (1.0 + 0.1) == 44.0
    assert compute_tau0(40, 2, 0.1) == 22
    loads = loads_from_expert_totals([40, 0], 2)
    plan, info = reference_plan_info(loads, 1, 1, 0.1, 23)
    assert info["probes"] == [22, 23]
    assert_plan(plan, [[-1], [0]], [[0], [17]], [23, 0], [23, 17])


# --- the probe sequence with synthetic oracles --------------------------------------------------


def _search(T, Lmax, R, S, eps, pred):
    probes = []
    calls = []

    def try_fn(tau):
        calls.append(tau)
        assert tau < Lmax
        return pred(tau)

    tau, tau0, delta = search_tau(T, Lmax, R, S, eps, try_fn, probes)
    return tau, probes, calls


def test_search_fast_path():
    # T=1000, R=4, eps=0: tau0 = 250, delta = 1; first success at 252.
    tau, probes, _ = _search(1000, 1000, 4, 1, 0.0, lambda t: t >= 252)
    assert tau == 252 and probes == [250, 251, 252]


def test_search_fallback_refine():
    # Fast path 250..253 fails; lo = 253, span = 747, c_j = 253 + (747 j) // 32.
    # c_14 = 253 + 10458 // 32 = 579 (fails), c_15 = 253 + 11205 // 32 = 603 (succeeds).
    # r_i = 579 + (24 i) // 16: 580, 582, 583, 585, 586, 588, 589, 591, 592, 594, 595, 597, 598,
    # 600 (i = 14, first >= 600).
    tau, probes, _ = _search(1000, 1000, 4, 1, 0.0, lambda t: t >= 600)
    coarse = [253 + (747 * j) // 32 for j in range(1, 16)]
    assert coarse[-2:] == [579, 603]
    refine = [580, 582, 583, 585, 586, 588, 589, 591, 592, 594, 595, 597, 598, 600]
    assert probes == [250, 251, 252, 253] + coarse + refine
    assert tau == 600


def test_search_nothing_succeeds():
    tau, probes, _ = _search(1000, 1000, 4, 1, 0.0, lambda t: False)
    assert tau == 1000
    assert probes == [250, 251, 252, 253] + [253 + (747 * j) // 32 for j in range(1, 32)]


def test_search_first_success_wins_even_if_not_monotone():
    # Succeeds only at c_3 = 253 + 2241 // 32 = 323 and at >= 900: j* = 3; refine between
    # c_2 = 299 and 323 (r_i = 299 + (24 i) // 16 <= 321) all fail -> c_3 = 323.
    c3 = 253 + (747 * 3) // 32
    assert c3 == 323
    tau, probes, _ = _search(1000, 1000, 4, 1, 0.0, lambda t: t == 323 or t >= 900)
    assert tau == 323
    assert probes[-15:] == [299 + (24 * i) // 16 for i in range(1, 16)]
    # A success inside the refine interval wins over c_{j*}: 588 = 579 + (24 * 6) // 16.
    tau, _, _ = _search(1000, 1000, 4, 1, 0.0, lambda t: t == 588 or t >= 600)
    assert tau == 588
    # A success that is never probed is never found.
    tau, _, _ = _search(1000, 1000, 4, 1, 0.0, lambda t: t == 587 or t >= 600)
    assert tau == 600


def test_search_probe_at_or_above_lmax_succeeds_without_oracle():
    # T=100, R=4, eps=0.5: tau0 = max(ceil(25), floor(150.0 / 4.0 = 37.5)) = 37 < Lmax = 40;
    # delta = ceil(100 * 0.5 / 4 / 2) = ceil(6.25) = 7.
    # try(37) fails; 37 + 7 = 44 >= Lmax succeeds with no replicas (oracle not called).
    tau, probes, calls = _search(100, 40, 4, 1, 0.5, lambda t: False)
    assert probes == [37, 44] and calls == [37] and tau == 44


def test_search_small_span_duplicates_and_skipped_refine():
    # T=40, R=4, eps=0: tau0 = 10, delta = 1, Lmax = 20. lo = 13, span = 7:
    # c_1..4 = 13, c_5..9 = 14, c_10..13 = 15, c_14 = 16 (98 // 32 = 3) -> j* = 14;
    # refine 15 + i // 16 = 15 for every i: all skipped -> 16.
    tau, probes, _ = _search(40, 20, 4, 1, 0.0, lambda t: t >= 16)
    assert probes == [10, 11, 12, 13] + [13] * 4 + [14] * 5 + [15] * 4 + [16]
    assert tau == 16


@pytest.mark.parametrize(
    "T,Lmax,R,S,eps",
    [
        (0, 0, 4, 1, 0.0),
        (100, 100, 1, 2, 0.0),
        (100, 100, 4, 0, 0.0),
        (100, 25, 4, 1, 0.0),
        (100, 27, 4, 1, 0.1),
        (10, 3, 4, 1, 0.1),
    ],
)
def test_search_short_circuits(T, Lmax, R, S, eps):
    # T == 0, R == 1, S == 0, tau0 >= Lmax: 25 >= 25; floor(100.0 * 1.1 / 4.0) =
    # floor(27.500000000000004) = 27 >= 27; max(ceil(10 / 4), floor(2.75)) = max(3, 2) = 3 >= 3
    # (the ceil term alone reaches Lmax). No probe at all.
    tau, probes, _ = _search(T, Lmax, R, S, eps, lambda t: pytest.fail("probed"))
    assert tau == Lmax and probes == []


# ============================================================================================
# (b) properties
# ============================================================================================


def _make_expert_loads(rng, E, skew, scale):
    if scale == 0:
        return np.zeros(E, dtype=np.int64)
    if skew == "equal":
        return np.full(E, scale, dtype=np.int64)
    if skew == "uniform":
        return rng.integers(0, 2 * scale + 1, size=E).astype(np.int64)
    if skew == "hot":
        base = rng.integers(0, scale + 1, size=E).astype(np.int64)
        base[rng.integers(E)] += scale * int(rng.integers(1, E + 2))
        return base
    if skew == "zipf":
        s = float(rng.uniform(0.5, 2.5))
        w = 1.0 / np.arange(1, E + 1, dtype=np.float64) ** s
        w = w[rng.permutation(E)]
        total = scale * E
        return np.floor(w / w.sum() * total).astype(np.int64)
    if skew == "sparse":
        out = np.zeros(E, dtype=np.int64)
        k = int(rng.integers(1, E + 1))
        idx = rng.choice(E, size=k, replace=False)
        out[idx] = rng.integers(1, 2 * scale + 1, size=k)
        return out
    raise AssertionError(skew)


def _split_rows(rng, load_e, R):
    rows = np.zeros((R, load_e.size), dtype=np.int64)
    p = rng.dirichlet(np.ones(R))
    for e, n in enumerate(load_e):
        rows[:, e] = rng.multinomial(int(n), p)
    return rows


@st.composite
def planner_inputs(draw):
    R = draw(st.integers(1, 8))
    E_m = draw(st.integers(1, 4))
    S = draw(st.integers(0, 3))
    skew = draw(st.sampled_from(["equal", "uniform", "hot", "zipf", "sparse"]))
    scale = draw(st.sampled_from([0, 1, 3, 10, 100, 1000, 10**5, 10**6, 4 * 10**6]))
    F = draw(st.sampled_from([1, 2, 8, 64, 512, 4096, 10**5]))
    K = draw(st.sampled_from([0, 1, 2, 16, 1000]))
    eps = draw(st.sampled_from([0.0, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    E = R * E_m
    load_e = _make_expert_loads(rng, E, skew, scale)
    loads = _split_rows(rng, load_e, R)
    assert loads.max(initial=0) <= INT32_MAX
    return loads.astype(np.int32), S, F, K, eps


def _check_properties(loads, S, F, K, eps):
    plan, info = reference_plan_info(loads, S, F, eps, K)
    check_plan_invariants(loads, plan, S)
    R, E = loads.shape
    E_m = E // R
    before = rank_loads_before(loads)
    load_e = loads.astype(np.int64).sum(axis=0)
    after = plan["rank_load"].astype(np.int64)
    replicas = info["replicas"]
    tau = info["tau"]
    tau0 = info["tau0"]
    T = int(before.sum())
    Lmax = int(before.max(initial=0))
    mean_ceil = -(-T // R)
    # the spec's IEEE value of (1 + eps) * mean: 1.0 + eps, multiply, divide
    v = float(T) * (1.0 + float(eps)) / float(R)

    np.testing.assert_array_equal(before, np.asarray(info["L"], dtype=np.int64))
    assert after.max(initial=0) <= before.max(initial=0)
    # no plan beats the integer mean
    assert after.max(initial=0) >= mean_ceil

    # tau0 = max(ceil(T / R), floor(v)): never below the integer mean; equal to it when v is below
    # it, else the largest integer <= v.
    assert tau0 >= mean_ceil
    if v < mean_ceil:
        assert tau0 == mean_ceil
    else:
        assert tau0 <= v < tau0 + 1
    # A plan at tau0 (the search short-circuits because tau0 >= Lmax, or the winning threshold is
    # tau0) has max(rank_load) <= tau0; when (1 + eps) * mean >= ceil(mean), tau0 <= v, i.e.
    # max(rank_load) <= (1 + eps) * mean in the spec's IEEE evaluation. Against the exact rational
    # (1 + eps) * mean this holds up to the three roundings (cf. test_tau0_ieee_order_examples (2):
    # 13 vs 12.99999...).
    if tau0 >= Lmax or tau == tau0:
        assert after.max(initial=0) <= tau0
        if v >= mean_ceil:
            assert after.max(initial=0) <= v
            exact = Fraction(T) * (1 + Fraction(float(eps))) / R
            assert after.max(initial=0) <= exact * (1 + Fraction(1, 2**50))

    filled = plan["slot_expert"] >= 0
    assert len(replicas) == int(filled.sum())
    # slots fill from slot 0 in creation order: no empty slot before a filled one
    for d in range(R):
        row = list(filled[d])
        assert row == sorted(row, reverse=True), plan["slot_expert"][d]

    if replicas:
        # the winning threshold is below Lmax, at or above tau0, and every rank ends at <= tau;
        # the ranks that gave tokens away end at exactly tau.
        assert S >= 1 and R >= 2
        assert info["tau0"] <= tau < info["Lmax"]
        assert after.max() == tau
        assert after.max() < before.max()
        donors = {e // E_m for e, _, _ in replicas}
        for d in donors:
            assert after[d] == tau
            assert before[d] > tau
        # receivers had slack and stay at or below tau
        for _, t, _ in replicas:
            assert before[t] < tau and after[t] <= tau
        # masters that exported keep at least K tokens
        for e in {e for e, _, _ in replicas}:
            assert plan["master_quota"][e] >= K
        # a replica below the floor F is the last one its source rank made, and carries exactly
        # that rank's remaining need: at most one per source rank
        for d in donors:
            mine = [q for e, _, q in replicas if e // E_m == d]
            assert all(q >= F for q in mine[:-1]), (d, mine, F)
            assert sum(mine) == before[d] - tau
        # each source rank exports experts in expert order (load_e descending, index ascending)
        for d in donors:
            seq = [e for e, _, _ in replicas if e // E_m == d]
            keys = [(-load_e[e], e) for e in seq]
            assert keys == sorted(keys)
        # pick_target: replaying the replicas in creation order, each target is the spec's choice
        # for need = min(x, avail) among ranks with a free slot and slack: the least slack >= need
        # (ties -> smallest rank) and then q == need (it ends the source rank's excess or drains
        # the expert), else the most slack (ties -> smallest rank) and then q == its slack (it
        # fills the target to tau).
        slack = [max(tau - int(before[u]), 0) for u in range(R)]
        free = [S] * R
        rem = {d: int(before[d]) - tau for d in donors}
        exported = [0] * E
        for e, t, q in replicas:
            d = e // E_m
            need = min(rem[d], int(load_e[e]) - K - exported[e])
            cands = [u for u in range(R) if free[u] > 0 and slack[u] > 0]
            assert t in cands, (e, t, q, slack, free)
            if slack[t] >= need:
                assert not any(
                    need <= slack[u] < slack[t] or (slack[u] == slack[t] and u < t) for u in cands
                ), ("not the best fit", e, t, need, slack, free)
                assert q == need
            else:
                assert all(slack[u] < need for u in cands), ("a fit was skipped", t, need, slack)
                assert not any(
                    slack[u] > slack[t] or (slack[u] == slack[t] and u < t) for u in cands
                ), ("not the most slack", e, t, need, slack, free)
                assert q == slack[t]
            slack[t] -= q
            free[t] -= 1
            rem[d] -= q
            exported[e] += q
        assert all(r == 0 for r in rem.values())
    else:
        # no replicas: nothing moved
        np.testing.assert_array_equal(after, before)
        np.testing.assert_array_equal(plan["master_quota"].astype(np.int64), load_e)
        assert (plan["slot_quota"] == 0).all()
    return plan, info


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planner_inputs())
def test_properties_random(args):
    loads, S, F, K, eps = args
    _check_properties(loads, S, F, K, eps)


@settings(max_examples=100, deadline=None)
@given(planner_inputs(), st.integers(0, 2**32 - 1))
def test_plan_depends_only_on_expert_totals(args, seed):
    # The plan is a pure function of load_e: redistributing tokens over source rows (or calling
    # twice) gives the same plan.
    loads, S, F, K, eps = args
    p1 = reference_plan(loads, S, F, eps, K)
    p2 = reference_plan(loads, S, F, eps, K)
    R = loads.shape[0]
    rng = np.random.default_rng(seed)
    other = _split_rows(rng, loads.astype(np.int64).sum(axis=0), R).astype(np.int32)
    p3 = reference_plan(other, S, F, eps, K)
    for k in p1:
        np.testing.assert_array_equal(p1[k], p2[k])
        np.testing.assert_array_equal(p1[k], p3[k])


@settings(max_examples=150, deadline=None)
@given(
    R=st.integers(2, 8),
    E_m=st.integers(1, 4),
    S=st.integers(1, 3),
    hot_extra=st.integers(1, 5 * 10**6),
    base=st.integers(0, 1000),
    K=st.sampled_from([0, 1, 5]),
    eps=st.sampled_from([0.0, 0.01, 0.1]),
    seed=st.integers(0, 2**32 - 1),
)
def test_single_hot_expert_reaches_tau0(R, E_m, S, hot_extra, base, K, eps, seed):
    # With F = 1, one overloaded rank d whose hot expert alone can export the whole excess
    # x = L[d] - tau0. d's first expert in expert order has load_e >= the hot one's, so its avail
    # >= x too, and every need is min(x, avail) = x: pick_target either finds a slack >= x (best
    # fit; q = x ends d) or takes the most slack (q = slack < x, which empties that target, so no
    # target is picked twice and S >= 1 slots suffice). The total slack R * tau0 - T + x >= x
    # (tau0 >= ceil(T / R)), so try(tau0) succeeds and the plan lands exactly on tau0, which is
    # <= (1 + eps) * mean (IEEE) whenever that is >= ceil(mean).
    rng = np.random.default_rng(seed)
    E = R * E_m
    load_e = rng.integers(0, base + 1, size=E).astype(np.int64)
    hot = int(rng.integers(E))
    load_e[hot] += hot_extra
    loads = _split_rows(rng, load_e, R).astype(np.int32)
    L = rank_loads_before(loads)
    T = int(L.sum())
    tau0 = compute_tau0(T, R, eps)
    over = [d for d in range(R) if L[d] > tau0]
    plan, info = _check_properties(loads, S, 1, K, eps)
    if not over:
        assert info["replicas"] == []
        return
    if len(over) == 1 and over[0] == hot // E_m and load_e[hot] - K >= L[over[0]] - tau0:
        assert info["tau"] == tau0 and info["probes"] == [tau0]
        assert plan["rank_load"].max() == tau0
        v = float(T) * (1.0 + eps) / float(R)
        if v >= -(-T // R):
            assert plan["rank_load"].max() <= v


# ============================================================================================
# (c) edge cases
# ============================================================================================


@pytest.mark.parametrize("R,E_m,S", [(1, 1, 0), (1, 3, 2), (4, 2, 2), (8, 4, 3)])
def test_all_zero_loads(R, E_m, S):
    loads = np.zeros((R, R * E_m), dtype=np.int32)
    plan = reference_plan(loads, S, 1, 0.0)
    check_plan_invariants(loads, plan, S)
    assert_plan(
        plan,
        np.full((R, S), -1),
        np.zeros((R, S)),
        np.zeros(R * E_m),
        np.zeros(R),
    )


def test_no_experts():
    loads = np.zeros((4, 0), dtype=np.int32)
    plan = reference_plan(loads, 2, 1, 0.0)
    assert plan["slot_expert"].shape == (4, 2) and plan["master_quota"].shape == (0,)
    check_plan_invariants(loads, plan, 2)


def test_one_expert_takes_every_token():
    # R=4, E=8, S=2, eps=0: load_e[5] = 1000 (rank 2), all else 0; T = 1000,
    # tau0 = max(250, floor(250.0)) = 250.
    # try(250): d=2, x = 750; e5 (avail 999): slack [250, 250, 0, 250]. need 750 > 250 -> most
    # slack, tie -> rank 0 (q = 250, x = 500); need 500 > 250 -> rank 1 (q = 250, x = 250);
    # need 250: rank 3 (250) fits -> q = 250. Every rank ends at 250.
    load_e = [0] * 8
    load_e[5] = 1000
    loads = loads_from_expert_totals(load_e, 4)
    plan = reference_plan(loads, 2, 1, 0.0)
    assert_plan(
        plan,
        [[5, -1], [5, -1], [-1, -1], [5, -1]],
        [[250, 0], [250, 0], [0, 0], [250, 0]],
        [0, 0, 0, 0, 0, 250, 0, 0],
        [250, 250, 250, 250],
    )
    check_plan_invariants(loads, plan, 2)
    # The same through a single source row of int32 max: everything on one expert in one row.
    loads = np.zeros((4, 8), dtype=np.int32)
    loads[3, 5] = INT32_MAX
    plan = reference_plan(loads, 2, 1, 0.0)
    check_plan_invariants(loads, plan, 2)
    # tau0 = max(ceil((2^31 - 1) / 4), floor(536870911.75)) = 536870912; x = 2^31 - 1 - tau0 on
    # rank 2; need = x exceeds every slack (tau0), so ranks 0 and 1 (most slack, ties -> index)
    # take tau0 each; then need = x - 2 tau0 = 536870911 fits rank 3 (tau0), which takes it all;
    # the master (rank 2) ends at exactly tau0.
    tau0 = compute_tau0(INT32_MAX, 4, 0.0)
    assert tau0 == 536870912
    assert plan["slot_quota"][:, 0].tolist() == [tau0, tau0, 0, INT32_MAX - 3 * tau0]
    assert plan["rank_load"].tolist() == [tau0, tau0, tau0, INT32_MAX - 3 * tau0]


def test_single_token():
    # T = 1, R = 2: tau0 = max(ceil(1 / 2), floor(0.5)) = max(1, 0) = 1 >= Lmax = 1 -> no replicas.
    loads = loads_from_expert_totals([1, 0], 2)
    plan = reference_plan(loads, 1, 1, 0.0)
    assert_plan(plan, [[-1], [-1]], [[0], [0]], [1, 0], [1, 0])


def test_master_keep_blocks_everything():
    # K >= load_e: no expert can give anything; fast path and fallback fail -> no replicas.
    loads = loads_from_expert_totals([100, 0], 2)
    plan, info = reference_plan_info(loads, 1, 1, 0.0, 100)
    assert info["tau"] == 100
    assert_plan(plan, [[-1], [-1]], [[0], [0]], [100, 0], [100, 0])


@pytest.mark.parametrize("S", [0])
def test_no_spare_slots(S):
    loads = loads_from_expert_totals([1000, 1, 2, 3, 4, 5, 6, 7], 4)
    plan = reference_plan(loads, S, 1, 0.0)
    check_plan_invariants(loads, plan, S)
    assert plan["slot_expert"].shape == (4, 0) and plan["slot_quota"].shape == (4, 0)
    np.testing.assert_array_equal(plan["rank_load"], rank_loads_before(loads))


def test_single_rank():
    loads = np.array([[5, 1000, 3]], dtype=np.int32)
    plan = reference_plan(loads, 3, 1, 0.0)
    check_plan_invariants(loads, plan, 3)
    assert_plan(plan, [[-1, -1, -1]], [[0, 0, 0]], [5, 1000, 3], [1008])


@pytest.mark.parametrize(
    "R,E_m,S,v", [(2, 1, 1, 7), (4, 2, 2, 1), (8, 4, 3, 10**6), (8, 1, 3, 123457)]
)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_all_equal_loads_no_replicas(R, E_m, S, v, eps):
    # All equal: L = E_m * v everywhere, T = R * L, tau0 >= ceil(T / R) = L = Lmax (whatever the
    # floor term gives) -> the search short-circuits, no replicas.
    loads = loads_from_expert_totals([v] * (R * E_m), R)
    plan, info = reference_plan_info(loads, S, 1, eps)
    assert info["probes"] == [] and info["replicas"] == []
    check_plan_invariants(loads, plan, S)
    assert (plan["slot_expert"] == -1).all()
    np.testing.assert_array_equal(plan["rank_load"], np.full(R, E_m * v))


def test_already_balanced_within_eps():
    # L = [105, 100, 100, 95]: T = 400. 400 * (1.0 + 0.05) is 420 + 5 * 2^-48 exactly, less than
    # half an ulp (2^-45 = 8 * 2^-48) above 420, so it rounds to 420.0; / 4.0 = 105.0 ->
    # tau0 = max(100, 105) = 105 >= Lmax -> no replicas.
    assert Fraction(400) * Fraction(1.0 + 0.05) - 420 == Fraction(5, 2**48)
    assert 400.0 * (1.0 + 0.05) == 420.0
    assert compute_tau0(400, 4, 0.05) == 105
    loads = loads_from_expert_totals([105, 100, 100, 95], 4)
    plan, info = reference_plan_info(loads, 2, 1, 0.05)
    assert info["probes"] == [] and info["replicas"] == []
    # With eps = 0: tau0 = 100 < 105. try(100): slack = [0, 0, 0, 5]; d=0: x = 5, avail 104,
    # need 5: rank 3 (5) is the only candidate and fits -> one replica of 5 tokens from e0 to
    # rank 3.
    plan = reference_plan(loads, 2, 1, 0.0)
    assert_plan(
        plan,
        [[-1, -1], [-1, -1], [-1, -1], [0, -1]],
        [[0, 0], [0, 0], [0, 0], [5, 0]],
        [100, 100, 100, 95],
        [100, 100, 100, 100],
    )


def test_loads_in_the_millions():
    # R=8, E=32, S=2: a Zipf-like layer of ~8 million tokens.
    rng = np.random.default_rng(7)
    w = 1.0 / np.arange(1, 33) ** 1.2
    load_e = np.floor(w[rng.permutation(32)] / w.sum() * 8_000_000).astype(np.int64)
    loads = _split_rows(rng, load_e, 8).astype(np.int32)
    for F in (1, 1000, 100_000):
        for K in (0, 1, 50_000):
            plan, info = _check_properties(loads, 2, F, K, 0.02)
            assert plan["rank_load"].max() <= rank_loads_before(loads).max()
    # F = 1 balances this layer far below its initial max.
    plan, info = reference_plan_info(loads, 2, 1, 0.02, 1)
    before = rank_loads_before(loads)
    assert info["replicas"]
    assert plan["rank_load"].max() < before.max()


def test_limits_and_invalid_input():
    # L exactly 2^31 - 1 is valid; one more token is not.
    ok = np.zeros((2, 4), dtype=np.int64)
    ok[0, 0] = INT32_MAX - 10
    ok[1, 1] = 10
    plan = reference_plan(ok.astype(np.int32), 1, 1, 0.0)
    check_plan_invariants(ok, plan, 1)
    bad = ok.copy()
    bad[1, 1] = 11
    with pytest.raises(ValueError):
        reference_plan(bad.astype(np.int32), 1, 1, 0.0)
    # load_e above 2^31 - 1 through the sum over source rows
    big = np.zeros((2, 2), dtype=np.int32)
    big[:, 0] = INT32_MAX
    with pytest.raises(ValueError):
        reference_plan(big, 1, 1, 0.0)
    # negative loads
    with pytest.raises(ValueError):
        reference_plan(np.array([[1, -1], [0, 0]], dtype=np.int32), 1, 1, 0.0)
    # E % R != 0
    with pytest.raises(ValueError):
        reference_plan(np.zeros((2, 3), dtype=np.int32), 1, 1, 0.0)
    # bad parameters
    with pytest.raises(ValueError):
        reference_plan(np.zeros((2, 2), dtype=np.int32), -1, 1, 0.0)
    with pytest.raises(ValueError):
        reference_plan(np.zeros((2, 2), dtype=np.int32), 1, 0, 0.0)
    with pytest.raises(ValueError):
        reference_plan(np.zeros((2, 2), dtype=np.int32), 1, 1, -0.1)
    with pytest.raises(ValueError):
        reference_plan(np.zeros((2, 2), dtype=np.int32), 1, 1, 0.0, -1)


def test_check_plan_invariants_catches_violations():
    loads = loads_from_expert_totals(HOT8, 4)
    good = reference_plan(loads, 2, 1, 0.0)
    check_plan_invariants(loads, good, 2)

    def broken(mutate):
        p = {k: v.copy() for k, v in good.items()}
        mutate(p)
        with pytest.raises(AssertionError):
            check_plan_invariants(loads, p, 2)

    def quota_sum(p):
        p["slot_quota"][1, 0] += 1
        p["rank_load"][1] += 1

    def master_own_rank(p):  # a replica of e0 on rank 0, its own master's rank
        p["slot_expert"][0, 0] = 0
        p["slot_quota"][0, 0] = 1
        p["master_quota"][0] -= 1

    def twice(p):  # e0 twice on rank 1
        p["slot_expert"][1, 1] = 0
        p["slot_quota"][1, 1] = 1
        p["master_quota"][0] -= 1

    def empty_with_quota(p):
        p["slot_quota"][0, 1] = 1

    def filled_zero(p):  # an e1 replica with quota 0 on rank 1
        p["slot_expert"][1, 1] = 1

    def negative(p):
        p["master_quota"][1] = -1
        p["slot_expert"][2, 1] = 1
        p["slot_quota"][2, 1] = 11
        p["rank_load"][0] -= 11
        p["rank_load"][2] += 11

    def rank_load_off(p):
        p["rank_load"][0] += 1
        p["rank_load"][1] -= 1

    def shape(p):
        p["slot_expert"] = p["slot_expert"][:, :1]

    for m in (
        quota_sum,
        master_own_rank,
        twice,
        empty_with_quota,
        filled_zero,
        negative,
        rank_load_off,
        shape,
    ):
        broken(m)
