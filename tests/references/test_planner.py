"""Tests of the NumPy reference planner (tests/references/planner.py) against ffi/PLANNER.md.

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

from tests.references.planner import (
    INT32_MAX,
    attempt,
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
    # avail = 510 tokens: success iff x = 2000 - tau <= 510, i.e. tau >= 1490 (both attempts, loose
    # and strict, make the same single replica: rank 1 is the only candidate).
    # Fast path 1000..1003 fails. lo = 1003, span = 997; c_j = 1003 + (997 j) // 32:
    #   c_15 = 1003 + 14955 // 32 = 1003 + 467 = 1470 (fails),
    #   c_16 = 1003 + 15952 // 32 = 1003 + 498 = 1501 (first success) -> j* = 16.
    # Refine: r_i = 1470 + (31 i) // 16: i = 10 -> 1470 + 19 = 1489 (fails),
    #   i = 11 -> 1470 + 341 // 16 = 1470 + 21 = 1491 (succeeds) -> tau = 1491.
    # try(1491): x = 509, avail = 510, need = 509, rank 1 (slack 1491) fits; no rank after rank 0
    # has excess (X = 0), so q = min(1491, 510, 509 + 0) = 509.
    # master_quota = [1491, 0]; rank_load = [1491, 509].
    loads = loads_from_expert_totals([2000, 0], 2)
    plan, info = reference_plan_info(loads, 1, 1, 0.0, 1490)
    coarse = [1003 + (997 * j) // 32 for j in range(1, 17)]
    assert coarse[14] == 1470 and coarse[15] == 1501
    refine = [1470 + (31 * i) // 16 for i in range(1, 12)]
    assert refine[-2:] == [1489, 1491]
    assert info["probes"] == [1000, 1001, 1002, 1003] + coarse + refine
    assert info["tau"] == 1491
    assert info["replicas"] == [(0, 1, 509)]
    assert_plan(plan, [[-1], [0]], [[0], [509]], [1491, 0], [1491, 509])
    check_plan_invariants(loads, plan, 1)


HOT8 = [100, 10, 10, 10, 10, 10, 10, 10]
# HOT8 on R=4, S=2 planned at threshold 43 by attempt(43, 1, loose), worked out in
# test_hand_r4_e8_s2_one_hot_expert: e0's replicas (expert, target, quota), and the plan.
HOT8_AT_43_REPLICAS = [(0, 1, 23), (0, 2, 23), (0, 3, 21)]
HOT8_AT_43 = {
    "slot_expert": [[-1, -1], [0, -1], [0, -1], [0, -1]],
    "slot_quota": [[0, 0], [23, 0], [23, 0], [21, 0]],
    "master_quota": [33, 10, 10, 10, 10, 10, 10, 10],
    "rank_load": [43, 43, 43, 41],
}


def test_hand_r4_e8_s2_one_hot_expert():
    # R=4, E=8 (E_m=2), S=2, F=1, K=1, eps=0. load_e = HOT8; L = [110, 20, 20, 20]; T = 170;
    # tau0 = max(ceil(170 / 4), floor(42.5)) = max(43, 42) = 43 (the ceil term wins); Lmax = 110.
    # (eps = 0 is exact mode, but with F = 1 there is no floor to fall back from.)
    # try(43), attempt(43, 1, loose): slack = [0, 23, 23, 23]; rank order 0, 1, 2, 3. d=0: x = 67.
    #   The master with the most avail: e0 (99; e1 has 9). need = min(67, 99) = 67: no slack
    #   >= 67 -> the most slack, 23, ties -> rank 1: q = min(23, 99, 67 + 0) = 23, x = 44.
    #   e0 (avail 76), need 44: no fit -> most slack, rank 2 (23): q = 23, x = 21.
    #   e0 (avail 53), need 21: rank 3 (23 >= 21) is the only fit. No other rank has excess
    #   (X = 0), so the replica does not over-export: q = min(23, 53, 21 + 0) = 21.
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
    assert info["replicas"] == HOT8_AT_43_REPLICAS
    assert_plan(plan, **HOT8_AT_43)
    check_plan_invariants(loads, plan, 2)


def test_hand_r4_e8_s2_one_hot_expert_large_floor():
    # As above with F = 30 and eps = 0.001 (not exact mode): 170.0 * 1.001 / 4.0 = 42.54...,
    # floor 42, so tau0 = max(43, 42) = 43; delta = max(1, ceil(170 * 0.001 / 4 / 2 = 0.02)) = 1.
    # Every attempt below makes the same choices loose and strict (no candidate ever has exactly
    # one free slot when it is picked), so try(tau) is one attempt done twice.
    # try(43): x = 67, fl = 30, e0 (avail 99), need 67: no fit -> most slack, rank 1 (23):
    #   q = min(23, 99, 67) = 23 < 30 -> failure.
    #   Likewise try(44), try(45), try(46): need 66..64 > slack 24..26, q = slack < 30.
    # Fallback: lo = 46, span = 64, c_j = 46 + 2 j. c_1 = 48: need 62 > slack 28, q = 28 < 30
    #   -> failure. c_2 = 50: x = 60, need 60 > slack 30: most slack, tie -> rank 1, q = 30,
    #   x = 30; fl = 30, e0 avail 69, need 30: ranks 2 and 3 (30) both fit, tie -> rank 2,
    #   q = min(30, 69, 30) = 30, x = 0 -> success. j* = 2.
    # Refine between 48 and 50: r_i = 48 + (2 i) // 16: i = 1..7 -> 48 (skipped), i = 8..15 -> 49:
    #   try(49): x = 61, need 61 > slack 29, q = 29 < 30 -> failure (probed 8 times).
    #   c_2 = 50 wins.
    # Plan: e0 replicas on ranks 1, 2 with 30 each; master_quota[0] = 40;
    #   rank_load = [50, 50, 50, 20].
    loads = loads_from_expert_totals(HOT8, 4)
    plan, info = reference_plan_info(loads, 2, 30, 0.001, 1)
    assert info["tau0"] == 43 and info["delta"] == 1
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


def test_hand_exact_mode_falls_back_to_floor_one():
    # The same loads with F = 30 in exact mode (eps = 0): tau0 = 43, delta = 1.
    # try(43): attempt(43, 30, loose) and attempt(43, 30, strict) fail as in the test above
    #   (q = 23 < 30); then attempt(43, 1, loose) succeeds exactly as with F = 1 (the test before
    #   the one above): replicas of e0 with 23, 23, 21 tokens. No threshold above tau0 is probed.
    loads = loads_from_expert_totals(HOT8, 4)
    plan, info = reference_plan_info(loads, 2, 30, 0.0, 1)
    assert info["probes"] == [43] and info["tau"] == 43
    assert info["replicas"] == HOT8_AT_43_REPLICAS
    assert_plan(plan, **HOT8_AT_43)
    check_plan_invariants(loads, plan, 2)
    # The floor only gives way in exact mode: the attempts at floor 30 fail on their own.
    assert attempt(43, HOT8, [110, 20, 20, 20], 2, 30, 1, False) == (False, [])
    assert attempt(43, HOT8, [110, 20, 20, 20], 2, 30, 1, True) == (False, [])
    assert oracle(43, HOT8, [110, 20, 20, 20], 2, 30, 1) == (False, [])
    assert oracle(43, HOT8, [110, 20, 20, 20], 2, 30, 1, exact=True)[0]


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
    # R=2, E=4 (E_m=2), S=2, F=1, eps=0. load_e = [3, 3, 0, 0]; L = [6, 0]; T = 6;
    # tau0 = max(3, floor(3.0)) = 3. try(3): slack = [0, 3]; d=0: x = 3, X = 0.
    # K = 0: e0 and e1 both have avail 3 (tie -> e0), need = min(3, 3) = 3, rank 1 (slack 3)
    #   fits: q = min(3, 3, 3) = 3, x = 0. master_quota[0] = 0 (K = 0 lets a master keep nothing).
    loads = loads_from_expert_totals([3, 3, 0, 0], 2)
    plan = reference_plan(loads, 2, 1, 0.0, 0)
    assert_plan(plan, [[-1, -1], [0, -1]], [[0, 0], [3, 0]], [0, 3, 0, 0], [3, 3])
    check_plan_invariants(loads, plan, 2)
    # K = 1: e0 (tie -> e0) has avail 2: need 2, rank 1 fits: q = min(3, 2, 3) = 2, x = 1; now e1
    #   has the most avail (2 > 0): need 1, rank 1 (slack 1, one slot left) fits: q = 1.
    #   Every master keeps its token: master_quota = [1, 2, 0, 0].
    plan = reference_plan(loads, 2, 1, 0.0, 1)
    assert_plan(plan, [[-1, -1], [0, 1]], [[0, 0], [2, 1]], [1, 2, 0, 0], [3, 3])
    check_plan_invariants(loads, plan, 2)


NONMONO_LOAD_E = [1, 3, 44, 96, 1, 5, 9, 8]


def test_hand_oracle_is_not_monotone():
    # R=4, E_m=2, S=1, F=40, K=10. L = [4, 140, 6, 17], Lmax = 140.
    # attempt(50, 40, loose): slack = [46, 0, 44, 33]; d=1, x = 90, X = 0. avail: e3 86, e2 34.
    #   e3 (most avail): fl 40, need 86 > every slack -> most slack, rank 0 (46): q = 46, x = 44;
    #   e3 still has the most avail (40 vs 34): fl 40, need = min(44, 40) = 40: fits are slack
    #   >= 40 with a free slot: only rank 2 (44; rank 3 has 33): q = min(44, 40, 44) = 40, x = 4;
    #   now e2 (34 vs 0): fl 4, need 4: candidates rank 3 only (ranks 0 and 2 have no free slot),
    #   33 >= 4 fits: q = min(33, 34, 4) = 4, x = 0 -> success.
    # attempt(51, 40, *): slack = [47, 0, 45, 34]; x = 89. e3: need 86, no fit -> rank 0 (47):
    #   q = 47, x = 42; the most avail is now e3's 39 < fl 40 -> failure. (The strict attempt
    #   makes the same first choice: no candidate's slack exceeds e3's 86.)
    load_e = NONMONO_LOAD_E
    L = [4, 140, 6, 17]
    ok, reps = oracle(50, load_e, L, 1, 40, 10)
    assert ok and reps == [(3, 0, 46), (3, 2, 40), (2, 3, 4)]
    assert oracle(51, load_e, L, 1, 40, 10) == (False, [])
    assert attempt(51, load_e, L, 1, 40, 10, True) == (False, [])


def test_hand_nonmonotone_case_full_plan():
    # Same input through the search, eps = 0.001 (exact mode would give up the floor at tau0):
    # T = 167, tau0 = max(ceil(167 / 4), floor(167.0 * 1.001 / 4.0 = 41.79...)) = 42 (the ceil term
    # wins), delta = max(1, ceil(167 * 0.001 / 4 / 2 = 0.02)) = 1.
    # e3 (avail 86) always gives first and its first need, min(x, 86) = 86, exceeds every slack,
    # so its first replica goes to the most slack, rank 0. With S = 1 every candidate has one free
    # slot, but no slack below exceeds the avail of the expert being placed, so the strict attempt
    # makes the loose one's choices: each try(tau) below is one attempt, done twice.
    # try(42), try(43): rank 0's slack 38, 39 is the q, < fl 40 -> failure.
    # try(44): (e3 -> rank 0, 40), x = 56, e3 avail 46 (> e2's 34), need 46 > slacks 38, 27 ->
    #   most slack, rank 2: q = 38 < 40 -> failure.
    # try(45): (e3 -> rank 0, 41), x = 54, e3 avail 45, need 45 > 39, 28 -> rank 2: q = 39 < 40 ->
    #   failure.
    # Fallback: lo = 45, span = 95, c_1 = 45 + 95 // 32 = 47:
    #   slack [43, 0, 41, 30], x = 93: (e3 -> 0, 43), x = 50, e3 avail 43, need 43 > 41, 30 ->
    #   most slack: (e3 -> 2, min(41, 43, 50) = 41), x = 9; e3 avail 2, e2 avail 34 -> e2: fl 9,
    #   need 9, rank 3 (30) is the only candidate and fits: q = min(30, 34, 9) = 9 -> success.
    #   j* = 1.
    # Refine between c_0 = 45 and c_1 = 47: r_i = 45 + (2 i) // 16: i = 1..7 -> 45 (skipped),
    #   i = 8 -> 46: slack [42, 0, 40, 29], x = 94: (e3 -> 0, 42), x = 52, e3 avail 44, need 44 >
    #   40, 29: (e3 -> 2, min(40, 44, 52) = 40), x = 12; e3 avail 4 < e2 avail 34 -> e2: fl 12,
    #   need 12, rank 3 (29) fits: q = 12 -> success. tau = 46.
    # master_quota = [1, 3, 44-12, 96-82, 1, 5, 9, 8]; rank_load = [46, 46, 46, 29].
    loads = loads_from_expert_totals(NONMONO_LOAD_E, 4)
    plan, info = reference_plan_info(loads, 1, 40, 0.001, 10)
    assert info["tau0"] == 42 and info["delta"] == 1
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
    # In exact mode the first probe already succeeds with floor 1: attempt(42, 1, loose):
    #   slack [38, 0, 36, 25], x = 98: (e3 -> 0, 38), x = 60; e3 avail 48, need 48 > 36, 25 ->
    #   (e3 -> 2, 36), x = 24; e2 avail 34 > e3's 12: need 24, rank 3 (25) fits: q = 24.
    plan, info = reference_plan_info(loads, 1, 40, 0.0, 10)
    assert info["probes"] == [42]
    assert info["replicas"] == [(3, 0, 38), (3, 2, 36), (2, 3, 24)]
    assert plan["rank_load"].tolist() == [42, 42, 42, 41]


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
    # R=5, E=5 (E_m=1), S=1, F=3, K=0, eps=0.01 (not exact mode). load_e = L = [0, 6, 7, 0, 1];
    # T = 14; Lmax = 7; tau0 = max(ceil(14 / 5), floor(14.0 * 1.01 / 5.0 = 2.83)) = 3; delta = 1.
    # try(3), attempt(3, 3, loose): slack = [3, 0, 0, 3, 2]; rank order 2 (7), 1 (6), 4, 0, 3;
    #   X = 4 + 3 = 7.
    #   d=2: x = 4, X = 3. e2 (avail 7), fl = 3, need 4: no slack >= 4 -> the most slack, ties ->
    #     rank 0: q = min(3, 7, 4 + 3) = 3, x = 1. fl = 1, e2 (avail 4), need 1: ranks 3 (3) and
    #     4 (2) fit -> the least slack, rank 4: q = min(2, 4, 1 + 3) = 2, x = -1: rank 2
    #     over-exported one token and becomes a target (slack 1, one free slot).
    #   d=1: x = 3, X = 0. fl = 3, e1 (avail 6), need 3: ranks 3 (3) fits (rank 2 has 1) ->
    #     q = min(3, 6, 3) = 3, x = 0. Success at the first probe.
    # (Taking the most slack for e2's second replica would put it on rank 3 (q = min(3, 4, 4) =
    #  3, rank 2's slack 2); rank 1's 3 tokens would then meet slacks of 2 on ranks 2 and 4,
    #  q = 2 < F = 3: failure.)
    # Plan: replicas (e2 -> 0, 3), (e2 -> 4, 2), (e1 -> 3, 3); master_quota = [0, 3, 2, 0, 1];
    #   rank_load = [3, 3, 2, 3, 3].
    loads = loads_from_expert_totals([0, 6, 7, 0, 1], 5)
    plan, info = reference_plan_info(loads, 1, 3, 0.01, 0)
    assert info["tau0"] == 3 and info["probes"] == [3] and info["tau"] == 3
    assert info["replicas"] == [(2, 0, 3), (2, 4, 2), (1, 3, 3)]
    assert_plan(
        plan,
        [[2], [-1], [-1], [1], [2]],
        [[3], [0], [0], [3], [2]],
        [0, 3, 2, 0, 1],
        [3, 3, 2, 3, 3],
    )
    check_plan_invariants(loads, plan, 1)


def test_hand_fit_prefers_a_near_target_over_a_smaller_far_fit():
    # The fit rule. R=4, E=4 (E_m=1), S=1, F=1, K=1, eps=0.25; domains of 2 ranks: {0, 1}, {2, 3}.
    # load_e = L = [30, 6, 10, 18]; T = 64; tau0 = max(16, floor(64.0 * 1.25 / 4.0 = 20.0)) = 20.
    # try(20): slack = [0, 14, 10, 2]; only rank 0 is above 20 (x = 10, X after it 0).
    #   e0 (avail 29), need = min(10, 29) = 10: ranks 1 (14) and 2 (10) take all of it. Without
    #   domains the least slack wins: rank 2. With domains of 2, rank 1 is near (the master's
    #   domain) and rank 2 is not: rank 1, q = min(14, 29, 10) = 10. Both at the first probe.
    loads = loads_from_expert_totals([30, 6, 10, 18], 4)
    plan, info = reference_plan_info(loads, 1, 1, 0.25, 1, ranks_per_domain=2)
    assert info["probes"] == [20] and info["replicas"] == [(0, 1, 10)]
    assert_plan(
        plan, [[-1], [0], [-1], [-1]], [[0], [10], [0], [0]], [20, 6, 10, 18], [20, 16, 10, 18]
    )
    # One domain (None or 4) and domains of one rank (nothing near but the master): rank 2.
    for g in (None, 4, 1):
        plan, info = reference_plan_info(loads, 1, 1, 0.25, 1, ranks_per_domain=g)
        assert info["replicas"] == [(0, 2, 10)], g
        assert plan["rank_load"].tolist() == [20, 6, 20, 18]


def test_hand_fit_counts_a_domain_that_holds_a_replica_as_near():
    # R=6, E=6 (E_m=1), S=1, F=1, K=1, eps=0.15; domains of 2: {0, 1}, {2, 3}, {4, 5}.
    # load_e = L = [36, 20, 8, 10, 12, 20]; T = 106; tau0 = max(18, floor(121.9 / 6 = 20.3)) = 20.
    # try(20): slack = [0, 0, 12, 10, 8, 0]; only rank 0 is above 20 (x = 16).
    #   e0 (avail 35), need 16: no slack takes it -> the most slack, rank 2 (domain 1): q = 12,
    #   x = 4. e0 (avail 23), need 4: ranks 3 (10) and 4 (8) take it. Without domains, the least
    #   slack: rank 4. With domains of 2, rank 3 is near (domain 1 now holds a replica of e0) and
    #   rank 4 is not: rank 3, q = 4. e0 then crosses into one remote domain instead of two.
    #   Domains of 3 ({0, 1, 2}, {3, 4, 5}): ranks 3 and 4 are both far, so rank 4 as before.
    loads = loads_from_expert_totals([36, 20, 8, 10, 12, 20], 6)
    want = {None: (4, [20, 20, 20, 10, 16, 20]), 2: (3, [20, 20, 20, 14, 12, 20])}
    want[3], want[6] = want[None], want[None]
    for g, (second, rank_load) in want.items():
        plan, info = reference_plan_info(loads, 1, 1, 0.15, 1, ranks_per_domain=g)
        assert info["probes"] == [20] and info["replicas"] == [(0, 2, 12), (0, second, 4)], g
        assert plan["rank_load"].tolist() == rank_load, g
        check_plan_invariants(loads, plan, 1)


def test_hand_the_master_with_the_most_avail_gives_next():
    # R=4, E=8 (E_m=2), S=1, F=1, K=1, eps=0. load_e = [12, 12, 0, 0, 3, 2, 1, 5];
    # L = [24, 0, 5, 6]; T = 35; Lmax = 24; tau0 = max(ceil(35 / 4), floor(8.75)) = 9; delta = 1.
    # try(9), attempt(9, 1, loose): slack = [0, 9, 4, 3]; rank order 0 (24), 3 (6), 2 (5), 1 (0);
    #   X = 15.
    #   d=0: x = 15, X = 0. e0 and e1 both have avail 11 (tie -> e0), need = min(15, 11) = 11 >
    #     every slack -> the most slack, rank 1: q = min(9, 11, 15) = 9, x = 6.
    #     Now e1 has the most avail (11 vs e0's 2): need 6 > slacks 4, 3 -> the most slack,
    #     rank 2: q = min(4, 11, 6) = 4, x = 2. e1 (avail 7), need 2: rank 3 (3) is the only
    #     candidate and fits: q = min(3, 7, 2) = 2, x = 0.
    #   d=3: x = 6 - 9 <= 0 -> break. Success at tau0.
    # Plan: replicas (e0 -> 1, 9), (e1 -> 2, 4), (e1 -> 3, 2); master_quota = [3, 6, 0, 0, 3, 2,
    #   1, 5]; rank_load = [24 - 15, 0 + 9, 5 + 4, 6 + 2] = [9, 9, 9, 8].
    load_e = [12, 12, 0, 0, 3, 2, 1, 5]
    loads = loads_from_expert_totals(load_e, 4)
    plan, info = reference_plan_info(loads, 1, 1, 0.0, 1)
    assert info["tau0"] == 9 and info["probes"] == [9] and info["tau"] == 9
    assert info["replicas"] == [(0, 1, 9), (1, 2, 4), (1, 3, 2)]
    assert_plan(
        plan,
        [[-1], [0], [1], [1]],
        [[0], [9], [4], [2]],
        [3, 6, 0, 0, 3, 2, 1, 5],
        [9, 9, 9, 8],
    )
    check_plan_invariants(loads, plan, 1)


def test_hand_over_export_makes_a_source_a_target():
    # R=3, E=3 (E_m=1), S=1, F=1, K=0, eps=0. load_e = L = [0, 3, 3]; T = 6; tau0 = 2.
    # try(2), attempt(2, 1, loose): slack = [2, 0, 0]; rank order 1, 2 (tie on 3 -> index), 0;
    #   X = 1 + 1 = 2.
    #   d=1: x = 1, X = 1. e1 (avail 3), need 1: rank 0 (2) is the only candidate and fits:
    #     q = min(2, 3, 1 + 1) = 2: rank 0 filled to tau, rank 1 one token below it (x = -1), so
    #     rank 1 becomes a target with slack 1 and its own free slot.
    #   d=2: x = 1, X = 0. e2 (avail 3), need 1: rank 0 has no free slot; rank 1 (1) fits:
    #     q = min(1, 3, 1) = 1. Success.
    # (Without the over-export rank 0's one slot would take 1 token of e1 and rank 2 would find
    #  no candidate: with S = 1 no plan at tau = 2 sends every token to a rank below the mean.)
    loads = loads_from_expert_totals([0, 3, 3], 3)
    plan, info = reference_plan_info(loads, 1, 1, 0.0, 0)
    assert info["probes"] == [2] and info["replicas"] == [(1, 0, 2), (2, 1, 1)]
    assert_plan(plan, [[1], [2], [-1]], [[2], [1], [0]], [0, 1, 2], [2, 2, 2])
    check_plan_invariants(loads, plan, 1)


def test_hand_strict_attempt_keeps_a_last_slot_for_a_filler():
    # R=6, E=12 (E_m=2), S=1, F=2, K=0, eps=0 (exact mode; the strict attempt at F comes first).
    # load_e = [5, 0, 31, 10, 10, 10, 11, 9, 3, 2, 34, 12]; L = [5, 41, 20, 20, 5, 46]; T = 137;
    # tau0 = ceil(137 / 6) = 23; Lmax = 46. slack = [18, 0, 3, 3, 18, 0]; rank order 5 (46),
    # 1 (41), 2, 3 (20), 0, 4 (5); X = 23 + 18 = 41. With S = 1 every candidate has one free slot.
    # attempt(23, 2, loose):
    #   d=5: x = 23, X = 18. e10 (avail 34 > e11's 12), need 23 > every slack -> the most slack,
    #     ranks 0 and 4 tie -> rank 0: q = min(18, 34, 41) = 18, x = 5. e10 (avail 16), need 5:
    #     rank 4 (18) is the only fit: q = min(18, 16, 23) = 16, x = -11 -> slack[5] = 11.
    #   d=1: x = 18, X = 0. e2 (avail 31), need 18: candidates ranks 2, 3 (3) and 5 (11), no fit
    #     -> rank 5: q = 11, x = 7; then ranks 2 and 3 take 3 each (x = 4, then 1); e2 still has
    #     14 but the only rank with slack (rank 4, 2 left) has no free slot -> failure. Rank 4's
    #     last slot took 16 of its 18 and stranded 2.
    # attempt(23, 2, strict): a candidate whose last slot has more slack than the expert can give
    #   is left out while others exist.
    #   d=5: e10 (avail 34): no slack exceeds 34 -> as above, rank 0: q = 18, x = 5.
    #     e10 (avail 16), need 5: rank 4 (18 > 16) is left out; ranks 2, 3 (3) do not fit -> the
    #     most slack, tie -> rank 2: q = min(3, 16, 23) = 3, x = 2. e10 (avail 13 > 12), need 2:
    #     rank 4 (18 > 13) left out; rank 3 (3) fits: q = min(3, 13, 20) = 3, x = -1 ->
    #     slack[5] = 1.
    #   d=1: x = 18, X = 0. e2 (avail 31), need 18: ranks 4 (18) and 5 (1) (neither above 31):
    #     rank 4 fits: q = min(18, 31, 18) = 18, x = 0. Success at tau0 with floor F.
    loads = loads_from_expert_totals([5, 0, 31, 10, 10, 10, 11, 9, 3, 2, 34, 12], 6)
    L = [5, 41, 20, 20, 5, 46]
    load_e = [5, 0, 31, 10, 10, 10, 11, 9, 3, 2, 34, 12]
    assert attempt(23, load_e, L, 1, 2, 0, False) == (False, [])
    plan, info = reference_plan_info(loads, 1, 2, 0.0, 0)
    assert info["probes"] == [23]
    assert info["replicas"] == [(10, 0, 18), (10, 2, 3), (10, 3, 3), (2, 4, 18)]
    assert_plan(
        plan,
        [[10], [-1], [10], [10], [2], [-1]],
        [[18], [0], [3], [3], [18], [0]],
        [5, 0, 13, 10, 10, 10, 11, 9, 3, 2, 10, 12],
        [23, 23, 23, 23, 23, 22],
    )
    check_plan_invariants(loads, plan, 1)


# --- the capacity ------------------------------------------------------------------------------


def test_hand_capacity_below_the_tolerated_threshold():
    # HOT8, R=4, S=2, F=1, K=1, eps=0.5: T = 170, M = 43, tau0 = max(43, floor(170.0 * 1.5 / 4.0
    # = 63.75)) = 63, delta = ceil(170 * 0.5 / 4 / 2 = 10.6) = 11.
    # Without a capacity try(63): slack [0, 43, 43, 43]; x = 47, X = 0:
    #   e0 (99), need 47 > 43 -> rank 1: q = min(43, 99, 47) = 43; need 4: ranks 2, 3 fit, tie ->
    #   rank 2: q = 4. rank_load [63, 63, 24, 20].
    loads = loads_from_expert_totals(HOT8, 4)
    plan, info = reference_plan_info(loads, 2, 1, 0.5, 1)
    assert info["tau0"] == 63 and info["delta"] == 11 and info["probes"] == [63]
    assert plan["rank_load"].tolist() == [63, 63, 24, 20]
    # capacity 50 (M <= 50 < Lmax): window(min(63, 50), 50) = window(50, 50) probes 50 alone:
    #   slack [0, 30, 30, 30], x = 60: rank 1 takes 30 (no fit for 60), then need 30 fits ranks 2
    #   and 3, tie -> rank 2: q = 30. rank_load [50, 50, 50, 20] <= 50.
    plan, info = reference_plan_info(loads, 2, 1, 0.5, 1, capacity=50)
    assert info["probes"] == [50] and info["tau"] == 50
    assert info["replicas"] == [(0, 1, 30), (0, 2, 30)]
    assert plan["rank_load"].tolist() == [50, 50, 50, 20]


def test_hand_capacity_window_probes():
    # load_e = [2000, 0], R=2, S=1, F=1, K=1490, eps=0 (test_hand_fallback_refine_wins): try(tau)
    # succeeds iff tau >= 1490 (the master keeps 1490); tau0 = 1000 = M, delta = 1, Lmax = 2000.
    # Without a capacity the search ends at 1491 (31 probes).
    loads = loads_from_expert_totals([2000, 0], 2)
    _, free_info = reference_plan_info(loads, 1, 1, 0.0, 1490)
    assert free_info["tau"] == 1491 and len(free_info["probes"]) == 31
    # capacity 1600: window(1000, 1600): fast 1000..1003 (p = 1003), coarse c_j = 1003 +
    #   (597 j) // 32: c_26 = 1003 + 485 = 1488 fails, c_27 = 1003 + 503 = 1506 succeeds; refine
    #   r_i = 1488 + (18 i) // 16: 1489 fails, 1490 succeeds. rank_load [1490, 510] (x = 510).
    plan, info = reference_plan_info(loads, 1, 1, 0.0, 1490, capacity=1600)
    coarse = [1003 + (597 * j) // 32 for j in range(1, 28)]
    assert coarse[-2:] == [1488, 1506]
    assert info["probes"] == [1000, 1001, 1002, 1003] + coarse + [1489, 1490]
    assert info["tau"] == 1490 and plan["rank_load"].tolist() == [1490, 510]
    # capacity 1450: no threshold <= 1450 succeeds. The window probes 1000..1003 and c_j = 1003 +
    #   (447 j) // 32 up to c_32 = 1450 itself, all failing; then the search without a capacity
    #   runs, and the plan is that plan: max(rank_load) = 1491 > 1450 tells the caller.
    plan, info = reference_plan_info(loads, 1, 1, 0.0, 1490, capacity=1450)
    window = [1000, 1001, 1002, 1003] + [1003 + (447 * j) // 32 for j in range(1, 33)]
    assert window[-1] == 1450
    assert info["probes"] == window + free_info["probes"]
    assert info["tau"] == 1491 and plan["rank_load"].tolist() == [1491, 509]
    for cap in (999, 2000, 10**9):  # below M = 1000 (no window), or >= Lmax (no bound)
        _, capped = reference_plan_info(loads, 1, 1, 0.0, 1490, capacity=cap)
        assert capped["probes"] == free_info["probes"] and capped["tau"] == 1491


def test_hand_capacity_window_gives_up_the_floor():
    # HOT8 with F = 30, eps = 0.01 (test_hand_r4_e8_s2_one_hot_expert_large_floor: tau0 = 43,
    # delta = 1; with the floor no threshold below 50 succeeds, so the plan is at 50).
    # capacity 45: window(43, 45) probes 43 first; its attempts at floor 30 fail, and as a window
    # probe it may give up the floor: attempt(43, 1, loose) succeeds as in
    # test_hand_r4_e8_s2_one_hot_expert. rank_load [43, 43, 43, 41] fits the buffer of 45.
    loads = loads_from_expert_totals(HOT8, 4)
    plan, info = reference_plan_info(loads, 2, 30, 0.01, 1)
    assert info["tau"] == 50 and plan["rank_load"].tolist() == [50, 50, 50, 20]
    plan, info = reference_plan_info(loads, 2, 30, 0.01, 1, capacity=45)
    assert info["probes"] == [43] and info["tau"] == 43
    assert info["replicas"] == HOT8_AT_43_REPLICAS
    assert plan["rank_load"].tolist() == HOT8_AT_43["rank_load"]


def test_hand_capacity_where_eps_alone_plans_nothing():
    # HOT8, F = 1, eps = 1e17: 170.0 * (1 + 1e17) / 4.0 = 4.25e18 >= Lmax = 110, so tau0 = 110
    # (the clamp) and the plan keeps every token on its master. With capacity 43 (= M) the window
    # (43, 43) probes 43 alone; delta is computed for it: 170.0 * 1e17 / 4.0 / 2.0 >= 110 -> 110.
    # try(43) as in test_hand_r4_e8_s2_one_hot_expert.
    loads = loads_from_expert_totals(HOT8, 4)
    plan, info = reference_plan_info(loads, 2, 1, 1e17, 1)
    assert info["tau0"] == 110 and info["probes"] == [] and info["replicas"] == []
    plan, info = reference_plan_info(loads, 2, 1, 1e17, 1, capacity=43)
    assert info["tau0"] == 110 and info["delta"] == 110 and info["probes"] == [43]
    assert plan["rank_load"].tolist() == HOT8_AT_43["rank_load"]


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


def test_tau0_and_delta_clamp_to_lmax():
    # A tolerance whose double reaches Lmax means no replicas: tau0 and delta clamp to Lmax
    # instead of converting a double beyond int64 (1e17 * 65536 > 2^63; 1e308 * 2 is inf).
    T, R, Lmax = 65536 * 64, 64, 3 * 65536
    assert float(T) * (1.0 + 1e17) / float(R) > 2.0**63
    assert compute_tau0(T, R, 1e17, Lmax) == Lmax
    assert compute_delta(T, R, 1e17, Lmax) == Lmax
    assert math.isinf(float(T) * (1.0 + 1e308))
    assert compute_tau0(T, R, 1e308, Lmax) == Lmax
    assert compute_delta(T, R, 1e308, Lmax) == Lmax
    assert compute_tau0(T, R, math.inf, Lmax) == Lmax
    assert compute_tau0(0, R, math.inf, 0) == 0  # 0 * inf is NaN: clamped too
    with pytest.raises(ValueError, match="not a finite double"):
        compute_tau0(T, R, 1e308)  # no Lmax given: nothing to clamp to
    # Just below Lmax the formula stands: eps = 1.999 gives 3 * 65536 - 65.536 -> floor.
    assert compute_tau0(T, R, 1.999, Lmax) == math.floor(float(T) * 2.999 / float(R)) < Lmax
    assert compute_delta(T, R, 1.999, Lmax) == math.ceil(float(T) * 1.999 / float(R) / 2.0)
    # In a plan: no replicas, the loads stay where they are.
    loads = loads_from_expert_totals([100, 0, 5, 5], 2)
    for eps in (1e17, 1e300, 1.7e308):
        plan, info = reference_plan_info(loads, 2, 1, eps, 1)
        assert info["tau0"] == 100 and info["probes"] == [] and info["replicas"] == []
        assert plan["rank_load"].tolist() == [100, 10]


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

    tau, _, _ = search_tau(T, Lmax, R, S, eps, try_fn, probes)
    return tau, probes, calls


def test_search_capacity_probes_at_or_below_it_first():
    # T=1000, R=4, eps=0: tau0 = 250, delta = 1, Lmax = 1000. capacity 300: window(250, 300):
    # fast 250..253, then c_j = 253 + (47 j) // 32 for j = 1..32 (c_32 = 300), then refine.
    coarse = [253 + (47 * j) // 32 for j in range(1, 33)]
    assert coarse[-1] == 300
    tau, probes, _ = _search_cap(1000, 1000, 4, 1, 0.0, lambda t: t >= 290, 300)
    j = next(k for k, c in enumerate(coarse) if c >= 290)  # c_{j+1} is the first success
    assert probes[: 4 + j + 1] == [250, 251, 252, 253] + coarse[: j + 1]
    assert tau == 290 and max(probes) <= 300
    # Nothing at or below the capacity succeeds: the window's probes, then the search without one.
    tau, probes, _ = _search_cap(1000, 1000, 4, 1, 0.0, lambda t: t >= 600, 300)
    window = [250, 251, 252, 253] + coarse
    assert probes[: len(window)] == window and all(p <= 300 for p in window)
    _, free, _ = _search(1000, 1000, 4, 1, 0.0, lambda t: t >= 600)
    assert probes[len(window) :] == free and tau == 600
    # capacity below tau0 (eps tolerates 10 %): the window starts at the capacity itself.
    tau, probes, _ = _search_cap(1000, 1000, 4, 1, 0.1, lambda t: t >= 260, 260)
    assert probes == [260] and tau == 260
    # capacity below ceil(T / R), or at/above Lmax: no window.
    for cap in (249, 1000, 5000):
        assert _search_cap(1000, 1000, 4, 1, 0.0, lambda t: t >= 600, cap)[1] == free


def test_search_capacity_probes_below_the_first_threshold():
    # T=1000, R=4, eps=0.1: tau0 = max(250, floor(1000.0 * 1.1 / 4.0 = 275.00000000000006)) = 275,
    # delta = ceil(1000 * 0.1 / 4 / 2 = 12.5) = 13, M = 250. Capacity 260 < tau0: a = 260, and
    # window(260, 260) probes 260 alone. When it fails, window(M, a - 1) = window(250, 259):
    # fast 250, 263 > 259 (none more, p = 250), coarse c_j = 250 + (9 j) // 32: 250 (j = 1..3),
    # 251 (j = 4..7), 252, ..., and a success at 253 (c_11 = 250 + 99 // 32 = 253; c_10 = 252)
    # wins: refine r_i = 252 + i // 16 = 252 is skipped. (Before, only 260 was probed, and the
    # plan was the one without a capacity.)
    coarse = [250 + (9 * j) // 32 for j in range(1, 33)]
    tau, probes, delta = _search_cap(1000, 1000, 4, 1, 0.1, lambda t: t in (253, 600), 260)
    assert delta == 13 and coarse[9:11] == [252, 253]
    assert probes == [260, 250] + coarse[:11] and tau == 253
    # Nothing at or below the capacity succeeds: both windows, then the search without one.
    tau, probes, _ = _search_cap(1000, 1000, 4, 1, 0.1, lambda t: t >= 600, 260)
    _, free, _ = _search(1000, 1000, 4, 1, 0.1, lambda t: t >= 600)
    assert probes == [260, 250] + coarse + free and tau == free[-1] == 600
    # tau0 below the capacity 290: window(275, 290) (fast 275, 288; coarse 288 + (2 j) // 32),
    # then window(M, tau0 - 1) = window(250, 274), whose second fast probe, 263, succeeds.
    tau, probes, _ = _search_cap(1000, 1000, 4, 1, 0.1, lambda t: t == 263, 290)
    assert probes == [275, 288] + [288 + (2 * j) // 32 for j in range(1, 33)] + [250, 263]
    assert tau == 263


def _search_cap(T, Lmax, R, S, eps, pred, capacity):
    probes = []
    tau, _, delta = search_tau(T, Lmax, R, S, eps, pred, probes, capacity=capacity)
    return tau, probes, delta


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
    # fast domains: one (None), or any size that divides R
    g = draw(st.sampled_from([None] + [g for g in range(1, R + 1) if R % g == 0]))
    return loads.astype(np.int32), S, F, K, eps, g


def _giving_order(replicas, E_m) -> list[int]:
    """The source ranks in the order they gave: each source's replicas are consecutive."""
    order = []
    for e, _, _ in replicas:
        if not order or order[-1] != e // E_m:
            order.append(e // E_m)
    return order


def _is_repair_order(order, before, tau) -> bool:
    """Whether ``order`` is the plain order D (the overloaded ranks by load descending, ties by
    index) or one that repair(tau, f, rule) reaches: at most 3 ranks moved to the front, the others
    in D's order."""
    D = sorted((u for u in range(len(before)) if before[u] > tau), key=lambda u: (-before[u], u))
    if sorted(order) != sorted(D):
        return False
    return any(order[k:] == [u for u in D if u not in order[:k]] for k in range(4))


def _replays(replicas, before, load_e, tau, R, S, f, K, rule, order, g=None) -> bool:
    """Whether ``replicas`` (creation order) is what attempt(tau, f, rule, order) of PLANNER.md
    makes, checked step by step against the rules rather than recomputed: each source rank (in
    ``order``) gives until its excess is gone; each replica's expert is the source's master with
    the most avail (ties -> smallest index); its target is a candidate (free slot, slack) with, for
    rule "most", the most slack, else (strict: not a last slot that the expert cannot fill, unless
    no other candidate) the least slack >= need (one in a near domain if any: the source's, or one
    where an earlier replica of the expert went; domains of ``g`` ranks, None: one), else the most
    slack (ties -> smallest rank); its quota is min(slack, avail, x + X) and at least the adaptive
    floor min(f, x)."""
    g = R if g is None else g
    E_m = len(load_e) // R
    slack = [max(tau - int(before[u]), 0) for u in range(R)]
    free = [S] * R
    exported = [0] * len(load_e)
    X = sum(int(before[u]) - tau for u in order)
    i = 0
    for d in order:
        x = int(before[d]) - tau
        X -= x
        while x > 0:
            if i == len(replicas):
                return False
            e, t, q = replicas[i]
            i += 1
            avail = [int(load_e[m]) - K - exported[m] for m in range(d * E_m, (d + 1) * E_m)]
            a = max(avail)
            if e != d * E_m + avail.index(a):  # index() finds the first, i.e. the smallest
                return False
            need = min(x, a)
            cands = [u for u in range(R) if free[u] > 0 and slack[u] > 0]
            if rule == "strict" and any(not (free[u] == 1 and slack[u] > a) for u in cands):
                cands = [u for u in cands if not (free[u] == 1 and slack[u] > a)]
            if t not in cands:
                return False
            fits = [u for u in cands if slack[u] >= need]
            near = {d // g} | {u // g for x, u, _ in replicas[: i - 1] if x == e}
            fits = [u for u in fits if u // g in near] or fits
            want = min(fits, key=lambda u: (slack[u], u)) if fits and rule != "most" else None
            if want is None:
                want = min(cands, key=lambda u: (-slack[u], u))
            if t != want or q != min(slack[t], a, x + X) or q < min(f, x):
                return False
            slack[t] -= q
            free[t] -= 1
            x -= q
            exported[e] += q
        slack[d] = -x
    return i == len(replicas)


def _check_properties(loads, S, F, K, eps, g=None):
    plan, info = reference_plan_info(loads, S, F, eps, K, ranks_per_domain=g)
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

    # tau0 = max(ceil(T / R), clampfloor(v)): never below the integer mean; Lmax when v reaches
    # Lmax (the clamp); else equal to the mean's ceiling when v is below it, else the largest
    # integer <= v.
    assert tau0 >= mean_ceil
    if not v < Lmax:
        assert tau0 == Lmax
    elif v < mean_ceil:
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
        # the winning threshold is below Lmax, at or above tau0, and every rank ends at <= tau.
        assert S >= 1 and R >= 2
        assert info["tau0"] <= tau < info["Lmax"]
        assert after.max() <= tau
        assert after.max() < before.max()
        excess = {d: int(before[d]) - tau for d in range(R) if before[d] > tau}
        donors = {e // E_m for e, _, _ in replicas}
        assert donors == set(excess), (donors, excess)  # exactly the overloaded ranks give
        # they give one after the other, in the plain order or one that a repair reaches
        order = _giving_order(replicas, E_m)
        assert len(order) == len(donors) and _is_repair_order(order, before, tau), order
        sent = {d: sum(q for e, _, q in replicas if e // E_m == d) for d in donors}
        got = {t: sum(q for _, u, q in replicas if u == t) for t in range(R)}
        for k, d in enumerate(order):
            # each gives at least its excess, and no more than the excess of itself and the ranks
            # after it in the giving order could use (the over-export cap x + X)
            later = sum(excess[u] for u in order[k + 1 :])
            assert excess[d] <= sent[d] <= excess[d] + later, (d, sent[d], excess[d], later)
        for t in range(R):
            if got[t]:  # receivers had slack, or made it by over-exporting, and stay <= tau
                assert before[t] < tau or sent.get(t, 0) > excess.get(t, 0), t
                assert after[t] <= tau
        # masters that exported keep at least K tokens
        for e in {e for e, _, _ in replicas}:
            assert plan["master_quota"][e] >= K
        # The replicas replay, in creation order, as one of try(tau)'s attempts (floor f, a target
        # rule, the giving order): see _replays. The plain attempts give in the plain order with
        # the rules loose and strict; the repairs also with the rule most.
        floors = [F, 1] if eps == 0.0 and F > 1 else [F]
        modes = [(f, rule) for f in floors for rule in ("loose", "strict", "most")]
        assert any(
            _replays(replicas, before, load_e, tau, R, S, f, K, rule, order, g) for f, rule in modes
        ), (replicas, tau, modes)
    else:
        # no replicas: nothing moved
        np.testing.assert_array_equal(after, before)
        np.testing.assert_array_equal(plan["master_quota"].astype(np.int64), load_e)
        assert (plan["slot_quota"] == 0).all()
    return plan, info


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planner_inputs())
def test_properties_random(args):
    loads, S, F, K, eps, g = args
    _check_properties(loads, S, F, K, eps, g)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planner_inputs(), st.floats(0.0, 1.2))
def test_capacity_properties(args, frac):
    # capacity C between the mean's ceiling M and Lmax (frac picks where; below M and above Lmax
    # included): every probe at or below C comes before any above it; the plan stays within C
    # whenever the window finds a plan (and always when the plan without a capacity does);
    # otherwise it is exactly the plan without a capacity.
    loads, S, F, K, eps, g = args
    R = loads.shape[0]
    before = rank_loads_before(loads)
    T, Lmax = int(before.sum()), int(before.max(initial=0))
    M = -(-T // R)
    C = max(1, M - 1 + int(frac * (Lmax - M + 2)))
    free, free_info = reference_plan_info(loads, S, F, eps, K, ranks_per_domain=g)
    plan, info = _check_capacity_plan(loads, S, F, K, eps, C, g)
    probes = info["probes"]
    first_above = next((i for i, p in enumerate(probes) if p > C), len(probes))
    window = 0 < C < Lmax and C >= M and S > 0 and R > 1 and T > 0
    if window:
        assert first_above > 0  # the window's probes come first
        if info["tau"] > C:  # the window failed: it probed C itself, before anything above it
            assert C in probes[:first_above]
    else:
        assert probes == free_info["probes"]
    if max(plan["rank_load"], default=0) > C:
        for k in plan:
            np.testing.assert_array_equal(plan[k], free[k])
        assert max(free["rank_load"], default=0) > C
    if max(free["rank_load"], default=0) <= C:
        assert max(plan["rank_load"], default=0) <= C


def _check_capacity_plan(loads, S, F, K, eps, C, g=None):
    plan, info = reference_plan_info(loads, S, F, eps, K, capacity=C, ranks_per_domain=g)
    check_plan_invariants(loads, plan, S)
    assert max(plan["rank_load"], default=0) <= max(rank_loads_before(loads), default=0)
    return plan, info


@settings(max_examples=100, deadline=None)
@given(planner_inputs(), st.integers(0, 2**32 - 1))
def test_plan_depends_only_on_expert_totals(args, seed):
    # The plan is a pure function of load_e: redistributing tokens over source rows (or calling
    # twice) gives the same plan.
    loads, S, F, K, eps, g = args
    p1 = reference_plan(loads, S, F, eps, K, ranks_per_domain=g)
    p2 = reference_plan(loads, S, F, eps, K, ranks_per_domain=g)
    R = loads.shape[0]
    rng = np.random.default_rng(seed)
    other = _split_rows(rng, loads.astype(np.int64).sum(axis=0), R).astype(np.int32)
    p3 = reference_plan(other, S, F, eps, K, ranks_per_domain=g)
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
            for g in (None, 2):
                plan, info = _check_properties(loads, 2, F, K, 0.02, g)
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
    for g in (0, 3):  # fast domains must split the ranks evenly
        with pytest.raises(ValueError, match="ranks_per_domain"):
            reference_plan(np.zeros((4, 4), dtype=np.int32), 1, 1, 0.0, ranks_per_domain=g)


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
