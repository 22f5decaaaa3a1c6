"""Tests of the NumPy reference planner (tests/reference_planner.py) against ffi/PLANNER.md.

(a) hand-worked plans, derived step by step in the comments from the spec's pseudo-code;
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
    # tau0 = ceil(12 * 1.0 / 2) = 6 < 10; delta = max(1, ceil(0)) = 1.
    # try(6): slack = [0, 4]; rank order 0, 1. d=0: x = 4. expert 0: fl = 1, avail = 10-1-0 = 9,
    #   target: only rank 1 has slack (4) -> q = min(4, 4, 9) = 4. x = 0 -> success.
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
    # Same loads with F=5: at try(6) x = 4, so fl = min(5, 4) = 4 (adaptive floor), q = 4 >= 4.
    loads = np.array([[6, 1], [4, 1]], dtype=np.int32)
    plan, info = reference_plan_info(loads, 1, 5, 0.0, 1)
    assert info["tau"] == 6
    assert_plan(plan, [[-1], [0]], [[0], [4]], [6, 2], [6, 6])


def test_hand_r2_e2_s1_third_fast_probe_master_keep():
    # Same loads, K=8: avail = 10 - 8 = 2 tokens may leave expert 0.
    # try(6): x=4; replica q = min(4, 4, 2) = 2, x = 2; then avail = 0 < fl=1 -> break;
    #   no more experts on rank 0, x > 0 -> failure.
    # try(7) (tau0 + delta): x=3, q = 2, x = 1 -> failure.
    # try(8): x=2, q = min(2, 6, 2) = 2 -> success.
    # Plan: rank 1 slot 0 = expert 0 with 2 tokens; master_quota = [8, 2]; rank_load = [8, 4].
    loads = np.array([[6, 1], [4, 1]], dtype=np.int32)
    plan, info = reference_plan_info(loads, 1, 1, 0.0, 8)
    assert info["probes"] == [6, 7, 8]
    assert info["tau"] == 8
    assert_plan(plan, [[-1], [0]], [[0], [2]], [8, 2], [8, 4])
    check_plan_invariants(loads, plan, 1)


def test_hand_fallback_coarse_probe_refine_skipped():
    # R=2, E=2, S=1, F=1, K=16, eps=0. load_e = [20, 2]; L = [20, 2]; T = 22; tau0 = 11;
    # delta = 1. try(tau) needs x = 20 - tau <= avail = 20 - 16 = 4, i.e. tau >= 16.
    # Fast path 11, 12, 13, 14 fails. lo = 14, span = 20 - 14 = 6, c_j = 14 + (6 j) // 32:
    #   j = 1..5 -> 14, j = 6..10 -> 15, j = 11 -> 16 (66 // 32 = 2). j* = 11.
    # Refine between c_10 = 15 and c_11 = 16: r_i = 15 + i // 16 = 15 for i = 1..15, all skipped
    #   (r_i <= c_10). So c_11 = 16 wins.
    # try(16): x = 4, slack[1] = 14, q = min(4, 14, 4) = 4.
    loads = loads_from_expert_totals([20, 2], 2)
    plan, info = reference_plan_info(loads, 1, 1, 0.0, 16)
    assert info["tau0"] == 11 and info["delta"] == 1
    assert info["probes"] == [11, 12, 13, 14] + [14] * 5 + [15] * 5 + [16]
    assert info["tau"] == 16
    assert_plan(plan, [[-1], [0]], [[0], [4]], [16, 2], [16, 6])
    check_plan_invariants(loads, plan, 1)


def test_hand_fallback_refine_wins():
    # R=2, E=2, S=1, F=1, K=1490, eps=0. load_e = [2000, 0]; L = [2000, 0]; T = 2000;
    # tau0 = 1000; delta = 1. Success iff x = 2000 - tau <= avail = 510, i.e. tau >= 1490.
    # Fast path 1000..1003 fails. lo = 1003, span = 997; c_j = 1003 + (997 j) // 32:
    #   c_15 = 1003 + 14955 // 32 = 1003 + 467 = 1470 (fails),
    #   c_16 = 1003 + 15952 // 32 = 1003 + 498 = 1501 (first success) -> j* = 16.
    # Refine: r_i = 1470 + (31 i) // 16: i = 10 -> 1470 + 19 = 1489 (fails),
    #   i = 11 -> 1470 + 341 // 16 = 1470 + 21 = 1491 (succeeds) -> tau = 1491.
    # try(1491): x = 509, avail = 510, slack[1] = 1491 -> q = 509.
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
    # tau0 = ceil(42.5) = 43; Lmax = 110.
    # try(43): slack = [0, 23, 23, 23]; rank order 0, 1, 2, 3. d=0: x = 67; expert order e0 (100),
    #   e1 (10). e0: avail 99, largest slack 23, ties -> rank 1: q = 23, x = 44.
    #   avail 76, rank 2 (23): q = 23, x = 21. avail 53, rank 3 (23): q = min(21, 23, 53) = 21.
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
    # As above with F = 30.
    # try(43): x = 67, fl = 30, best slack 23 -> q = 23 < 30 -> failure. Likewise try(44), try(45),
    #   try(46) (slack 24..26 < 30; delta = 1).
    # Fallback: lo = 46, span = 64, c_j = 46 + 2 j. c_1 = 48: slack 28 < fl = 30 -> failure.
    #   c_2 = 50: x = 60, slack 30: (e0 -> rank 1, 30), x = 30, fl = 30, (e0 -> rank 2, 30),
    #   x = 0 -> success. j* = 2.
    # Refine between 48 and 50: r_i = 48 + (2 i) // 16: i = 1..7 -> 48 (skipped), i = 8..15 -> 49:
    #   try(49): x = 61, slack 29 < 30 -> failure (probed 8 times). c_2 = 50 wins.
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
    # R=4, E=4 (E_m=1), S=1, F=1, K=1, eps=0. load_e = [30, 30, 0, 0]; T = 60; tau0 = 15.
    # Rank order: 0, 1 (tie on L=30 -> index), 2, 3.
    # d=0: x = 15; slack = [0, 0, 15, 15] -> tie -> rank 2, q = 15.
    # d=1: x = 15; rank 2 has no slack left -> rank 3, q = 15.
    loads = loads_from_expert_totals([30, 30, 0, 0], 4)
    plan = reference_plan(loads, 1, 1, 0.0)
    assert_plan(plan, [[-1], [-1], [0], [1]], [[0], [0], [15], [15]], [15, 15, 0, 0], [15, 15, 15, 15])
    check_plan_invariants(loads, plan, 1)


def test_hand_expert_order_tie_break_and_slot_order():
    # R=2, E=4 (E_m=2), S=2, F=1, K=1, eps=0. load_e = [5, 5, 0, 0]; L = [10, 0]; tau0 = 5.
    # try(5): d=0, x = 5; expert order e0, e1 (tie -> index).
    #   e0: avail = 4, rank 1 (slack 5): q = min(5, 5, 4) = 4, x = 1; then avail = 0 -> break.
    #   e1: fl = 1, avail = 4, rank 1 (slack 1, one free slot): q = 1, x = 0.
    # Rank 1: slot 0 = e0 (4), slot 1 = e1 (1) (creation order). master_quota = [1, 4, 0, 0].
    loads = loads_from_expert_totals([5, 5, 0, 0], 2)
    plan = reference_plan(loads, 2, 1, 0.0)
    assert_plan(plan, [[-1, -1], [0, 1]], [[0, 0], [4, 1]], [1, 4, 0, 0], [5, 5])
    check_plan_invariants(loads, plan, 2)

    # With S=1, try(5) fails: after the e0 replica rank 1 has no free slot. try(6): x = 4,
    # e0: q = min(4, 6, 4) = 4 -> success. master_quota = [1, 5, 0, 0]; rank_load = [6, 4].
    plan, info = reference_plan_info(loads, 1, 1, 0.0)
    assert info["probes"] == [5, 6]
    assert_plan(plan, [[-1], [0]], [[0], [4]], [1, 5, 0, 0], [6, 4])
    check_plan_invariants(loads, plan, 1)


def test_hand_master_keep_zero_drains_a_master():
    # R=3, E=6 (E_m=2), S=2, F=1, K=0, eps=0. load_e = [9, 9, 0, 0, 0, 0]; L = [18, 0, 0];
    # tau0 = 6. try(6): slack = [0, 6, 6]; d=0: x = 12; e0 (tie -> index 0 first):
    #   avail 9, rank 1 (6, tie -> 1): q = 6, x = 6; avail 3, rank 2 (6): q = 3, x = 3;
    #   avail 0 -> break. e1: avail 9, rank 2 (slack 3, one slot left): q = 3, x = 0.
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
    #   e3: fl 40, avail 86, rank 0 (46): q = 46, x = 44; fl 40, avail 40, rank 2 (44):
    #   q = min(44, 44, 40) = 40 >= 40, x = 4; fl 4, avail 0 -> break.
    #   e2: fl 4, avail 34, rank 3 (33): q = 4, x = 0 -> success.
    # try(51): slack = [47, 0, 45, 34]; x = 89. e3: rank 0: q = 47, x = 42; fl 40, avail 39 -> break.
    #   e2: fl 40, avail 34 -> break. x > 0 -> failure.
    load_e = NONMONO_LOAD_E
    L = [4, 140, 6, 17]
    ok, reps = oracle(50, load_e, L, 1, 40, 10)
    assert ok and reps == [(3, 0, 46), (3, 2, 40), (2, 3, 4)]
    assert oracle(51, load_e, L, 1, 40, 10) == (False, [])


def test_hand_nonmonotone_case_full_plan():
    # Same input through the search, eps = 0: T = 167, tau0 = ceil(41.75) = 42, delta = 1.
    # try(42), try(43): best slack 38, 39 < fl 40 -> failure.
    # try(44): (e3 -> rank 0, 40), x = 56, avail 46, rank 2 slack 38 < 40 -> failure.
    # try(45): (e3 -> rank 0, 41), x = 54, avail 45, rank 2 slack 39 < 40 -> failure.
    # Fallback: lo = 45, span = 95, c_1 = 45 + 95 // 32 = 47:
    #   slack [43, 0, 41, 30], x = 93: (e3 -> 0, 43), x = 50, avail 43; (e3 -> 2, min(50,41,43)=41),
    #   x = 9, avail 2 < 9 -> break; e2: fl 9, avail 34, rank 3 (30): q = 9 -> success. j* = 1.
    # Refine between c_0 = 45 and c_1 = 47: r_i = 45 + (2 i) // 16: i = 1..7 -> 45 (skipped),
    #   i = 8 -> 46: slack [42, 0, 40, 29], x = 94: (e3 -> 0, 42), x = 52, avail 44;
    #   (e3 -> 2, min(52, 40, 44) = 40), x = 12, avail 4 < 12 -> break; e2: fl 12, avail 34,
    #   rank 3 (29): q = 12 -> success. tau = 46.
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


# --- the IEEE-double formulas -----------------------------------------------------------------


def test_tau0_ieee_order_examples():
    # double(20) * (1.0 + 0.1) / 2.0 == 11.0 exactly in IEEE double, although the exact value
    # with the binary 0.1 (slightly above 1/10) is just above 11: the spec's order gives 11.
    assert compute_tau0(20, 2, 0.1) == 11
    assert math.ceil(Fraction(20) * (1 + Fraction(0.1)) / 2) == 12
    # 90 * 1.1 / 3 rounds to just above 33 -> 34, while 90 / 3 * 1.1 would give 33.
    assert compute_tau0(90, 3, 0.1) == 34
    assert math.ceil(90 / 3 * (1.0 + 0.1)) == 33
    # 300 * 1.1 / 3 == 110.0 (while 300 / 3 * 1.1 == 110.00000000000001 -> 111).
    assert compute_tau0(300, 3, 0.1) == 110
    # 50 * 1.1 / 5 == 11.000000000000002 -> 12.
    assert compute_tau0(50, 5, 0.1) == 12
    assert compute_tau0(1000, 4, 0.0) == 250
    assert compute_tau0(170, 4, 0.0) == 43


def test_delta_ieee_examples():
    # 40 * 0.1 / 2 / 2 == 1.0 in IEEE double (exact binary value is just above 1 -> 2).
    assert compute_delta(40, 2, 0.1) == 1
    assert math.ceil(Fraction(40) * Fraction(0.1) / 2 / 2) == 2
    assert compute_delta(1000, 4, 0.0) == 1  # max(1, 0)
    assert compute_delta(100, 4, 0.5) == 7  # ceil(6.25)
    assert compute_delta(10**6, 8, 0.05) == 3125


def test_tau0_ieee_order_in_a_full_plan():
    # R=2, E=2, S=1, eps=0.1, load_e = [20, 0]: tau0 = 11 (see above). try(11): x = 9,
    # slack[1] = 11, q = 9. rank_load = [11, 9] (an exact-rational tau0 would give [12, 8]).
    loads = loads_from_expert_totals([20, 0], 2)
    plan = reference_plan(loads, 1, 1, 0.1)
    assert_plan(plan, [[-1], [0]], [[0], [9]], [11, 0], [11, 9])
    # R=3, E=3, S=1, eps=0.1, load_e = [90, 0, 0]: tau0 = 34. x = 56: (e0 -> 1, 34), (e0 -> 2, 22).
    loads = loads_from_expert_totals([90, 0, 0], 3)
    plan = reference_plan(loads, 1, 1, 0.1)
    assert_plan(plan, [[-1], [0], [0]], [[0], [34], [22]], [34, 0, 0], [34, 34, 22])


def test_delta_ieee_in_a_full_plan():
    # R=2, E=2, S=1, eps=0.1, load_e = [40, 0]: T = 40, tau0 = ceil(40 * 1.1 / 2) = 22,
    # delta = 1 (IEEE). With K = 23 the oracle needs 40 - tau <= 40 - 23, i.e. tau >= 23:
    # try(22) fails, try(23) = tau0 + delta succeeds (an exact delta of 2 would give 24).
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
    # T=100, R=4, eps=0.5: tau0 = ceil(37.5) = 38 < Lmax = 40; delta = ceil(6.25) = 7.
    # try(38) fails; 45 >= Lmax succeeds with no replicas (oracle not called).
    tau, probes, calls = _search(100, 40, 4, 1, 0.5, lambda t: False)
    assert probes == [38, 45] and calls == [38] and tau == 45


def test_search_small_span_duplicates_and_skipped_refine():
    # T=40, R=4, eps=0: tau0 = 10, delta = 1, Lmax = 20. lo = 13, span = 7:
    # c_1..4 = 13, c_5..9 = 14, c_10..13 = 15, c_14 = 16 (98 // 32 = 3) -> j* = 14;
    # refine 15 + i // 16 = 15 for every i: all skipped -> 16.
    tau, probes, _ = _search(40, 20, 4, 1, 0.0, lambda t: t >= 16)
    assert probes == [10, 11, 12, 13] + [13] * 4 + [14] * 5 + [15] * 4 + [16]
    assert tau == 16


@pytest.mark.parametrize(
    "T,Lmax,R,S,eps",
    [(0, 0, 4, 1, 0.0), (100, 100, 1, 2, 0.0), (100, 100, 4, 0, 0.0), (100, 25, 4, 1, 0.0),
     (100, 27, 4, 1, 0.1)],
)
def test_search_short_circuits(T, Lmax, R, S, eps):
    # T == 0, R == 1, S == 0, tau0 >= Lmax (25 >= 25; ceil(27.5) = 28 >= 27): no probe at all.
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

    np.testing.assert_array_equal(before, np.asarray(info["L"], dtype=np.int64))
    assert after.max(initial=0) <= before.max(initial=0)

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
    # With F = 1, one overloaded rank whose hottest expert alone can export the whole excess:
    # each target takes all of its slack (q = min(x, slack)), the total slack
    # R * tau0 - T + x >= x, so try(tau0) succeeds and the plan lands exactly on tau0.
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
    # R=4, E=8, S=2, eps=0: load_e[5] = 1000 (rank 2), all else 0; T = 1000, tau0 = 250.
    # try(250): d=2, x = 750; e5 (avail 999): slack [250, 250, 0, 250] -> ranks 0, 1, 3 take
    # 250 each. Every rank ends at 250.
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
    # tau0 = ceil((2^31 - 1) / 4) = 536870912; x = 2^31 - 1 - tau0 on rank 2; ranks 0 and 1
    # (slack tau0 each, ties -> index) take tau0, rank 3 takes the rest x - 2 tau0 = 536870911;
    # the master (rank 2) ends at exactly tau0.
    tau0 = compute_tau0(INT32_MAX, 4, 0.0)
    assert tau0 == 536870912
    assert plan["slot_quota"][:, 0].tolist() == [tau0, tau0, 0, INT32_MAX - 3 * tau0]
    assert plan["rank_load"].tolist() == [tau0, tau0, tau0, INT32_MAX - 3 * tau0]


def test_single_token():
    # T = 1, R = 2: tau0 = ceil(0.5) = 1 >= Lmax = 1 -> no replicas.
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


@pytest.mark.parametrize("R,E_m,S,v", [(2, 1, 1, 7), (4, 2, 2, 1), (8, 4, 3, 10**6), (8, 1, 3, 123457)])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_all_equal_loads_no_replicas(R, E_m, S, v, eps):
    # All equal: L = E_m * v everywhere, tau0 = ceil(L * (1 + eps)) >= L = Lmax -> no replicas.
    loads = loads_from_expert_totals([v] * (R * E_m), R)
    plan, info = reference_plan_info(loads, S, 1, eps)
    assert info["probes"] == [] and info["replicas"] == []
    check_plan_invariants(loads, plan, S)
    assert (plan["slot_expert"] == -1).all()
    np.testing.assert_array_equal(plan["rank_load"], np.full(R, E_m * v))


def test_already_balanced_within_eps():
    # L = [105, 100, 100, 95]: T = 400, tau0 = ceil(400 * 1.05 / 4) = 105 >= Lmax -> no replicas.
    loads = loads_from_expert_totals([105, 100, 100, 95], 4)
    plan, info = reference_plan_info(loads, 2, 1, 0.05)
    assert info["probes"] == [] and info["replicas"] == []
    # With eps = 0: tau0 = 100 < 105 -> one replica of 5 tokens from e0 to rank 3 (largest slack).
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

    for m in (quota_sum, master_own_rank, twice, empty_with_quota, filled_zero, negative,
              rank_load_off, shape):
        broken(m)
