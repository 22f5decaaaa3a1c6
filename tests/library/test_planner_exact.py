"""The planner against an exact solver: `exact_plan_exists` (ultraep_jax/oracle.py), a
mixed-integer program over the planner's constraints (S slots per rank, masters keep K, no rank
holds an expert twice), independent of the planner.

- Where ffi/PLANNER.md promises completeness (R = 2, or S >= E - E / R), exact mode reaches
  M = ceil(T / R) and a capacity C is met whenever some plan does.
- Two cases that an earlier planner missed, and a fixed sample of small S = 1 cases in
  which the planner before the repairs missed M (the repairs are a heuristic there, not a promise).
"""

import numpy as np
import pytest

import ultraep_jax as uep
from tests.references.planner import check_plan_invariants, reference_plan, reference_plan_info
from ultraep_jax.oracle import exact_plan_exists, random_cases

FIELDS = ("slot_expert", "slot_quota", "master_quota", "rank_load")


def _loads(R, load_e):
    """int32 [R, E] with the expert totals ``load_e`` (only the totals matter to the planner)."""
    loads = np.zeros((R, len(load_e)), np.int32)
    loads[0] = load_e
    return loads


def _plan(loads, S, F, eps, K, capacity=None, g=None):
    """The native plan (fast domains of ``g`` ranks; None: one) as NumPy arrays, checked against
    the NumPy reference and the invariants. (Named: "auto" would also trace the portable planner,
    its branch for other platforms, at every new size.)"""
    cfg = uep.BalancerConfig(loads.shape[1], loads.shape[0], S, F, eps, K, ranks_per_domain=g)
    plan = uep.plan(loads, cfg, capacity=capacity, planner="native")
    got = {name: np.asarray(getattr(plan, name)) for name in FIELDS}
    want = reference_plan(loads, S, F, eps, K, capacity=capacity or 0, ranks_per_domain=g)
    for name in FIELDS:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    check_plan_invariants(loads, got, S)
    return got


def _mean_ceil(R, load_e):
    return -(-int(np.sum(load_e)) // R)


# -- two cases an earlier planner missed ----------------------------------------------------------


def test_exact_mode_reaches_the_mean_where_a_plan_exists():
    # E=6, R=3 (E_m=2), S=1, F=1, K=1, eps=0: load_e = [0, 4, 0, 0, 2, 3], L = [4, 0, 5], T = 9,
    # M = 3. A plan at 3: e1 sends 3 to rank 1, e5 sends 2 to rank 0.
    # The plain attempts give in rank order, rank 2 (5) first: e5 (avail 2) fits rank 1 (slack
    # 3), leaving it 1 of slack and no slot, and rank 0 finds no target (the old plan: [4, 1, 4]).
    # The repair moves rank 0, where that attempt failed, to the front: e1 (avail 3), need 1,
    # goes to rank 1 (the only candidate) and fills it (q = min(3, 3, x + X = 1 + 2) = 3); rank
    # 0 is then 2 below the mean and takes e5's 2 in its own slot.
    load_e = [0, 4, 0, 0, 2, 3]
    loads = _loads(3, load_e)
    assert exact_plan_exists(load_e, 3, 1, 1, 3)
    got = _plan(loads, 1, 1, 0.0, 1)
    assert got["rank_load"].tolist() == [3, 3, 3]
    _, info = reference_plan_info(loads, 1, 1, 0.0, 1)
    assert info["how"] == ("repair", 1, "loose", [0, 2])
    assert info["replicas"] == [(1, 1, 3), (5, 0, 2)]


@pytest.mark.parametrize("eps", [0.0, 0.01, 0.1, 0.7])
def test_capacity_met_where_a_plan_exists(eps):
    # E=9, R=3, S=1, F=1, K=1, capacity 80: L = [133, 97, 7], T = 237, M = 79; a plan at 79:
    # e1 sends 54 to rank 1, e3 sends 72 to rank 2. The old planner went over the capacity
    # ([82, 82, 73] with eps <= 0.01; with eps 0.1 and 0.7, where tau0 >= 80, it probed 80 alone
    # and then planned 86 or nothing at all: [133, 97, 7]).
    loads = np.array(
        [
            [15, 19, 0, 31, 8, 2, 0, 2, 2],
            [26, 22, 0, 24, 6, 0, 0, 0, 1],
            [27, 24, 0, 19, 6, 1, 0, 1, 1],
        ],
        np.int32,
    )
    load_e = loads.sum(axis=0)
    assert exact_plan_exists(load_e, 3, 1, 1, 79)
    got = _plan(loads, 1, 1, eps, 1, capacity=80)
    assert got["rank_load"].max() <= 80
    assert got["rank_load"].sum() == 237


# -- the complete cases -------------------------------------------------------------------------


def _complete_cases(seed, n):
    """``n`` cases ``(R, load_e, K, S)`` that PLANNER.md calls complete: R = 2 with S in 1..3, or
    R in {3, 4} with S = E - E / R."""
    rng = np.random.default_rng(seed)
    two = random_cases(rng, n // 2, ranks=(2,), experts_per_rank=(1, 2, 3, 4))
    more = random_cases(rng, n - n // 2, ranks=(3, 4), experts_per_rank=(1, 2))
    cases = [(R, e, K, int(rng.integers(1, 4))) for R, e, K in two]
    return cases + [(R, e, K, len(e) - len(e) // R) for R, e, K in more]


@pytest.mark.parametrize("g", [None, 1])
def test_exact_mode_is_complete_for_two_ranks_or_enough_slots(g):
    # With fast domains too (g = 1: each rank its own): the proofs hold whichever candidate
    # pick_target chooses, so the fit rule keeps them.
    reached = infeasible = 0
    for R, load_e, K, S in _complete_cases(0, 240):
        got = _plan(_loads(R, load_e), S, 1, 0.0, K, g=g)["rank_load"].max()
        M = _mean_ceil(R, load_e)
        if got > M:
            assert not exact_plan_exists(load_e, R, S, K, M), (R, S, K, load_e.tolist(), got)
            infeasible += 1
        elif load_e.reshape(R, -1).sum(axis=1).max() > M:  # reached M with replicas
            reached += 1
    assert reached >= 100 and infeasible >= 1  # the sample is not trivial either way


def test_capacity_is_complete_for_two_ranks_or_enough_slots():
    # Any tolerance and floor: the capacity window gives up the floor, and C is always probed.
    rng = np.random.default_rng(1)
    met = missed = 0
    for R, load_e, K, S in _complete_cases(2, 160):
        loads = _loads(R, load_e)
        L = loads.sum(axis=0).reshape(R, -1).sum(axis=1)
        M, Lmax = _mean_ceil(R, load_e), int(L.max())
        if Lmax <= M:
            continue
        C = min(M + int(rng.integers(0, 3)), Lmax - 1)  # at or just above M, where it binds
        eps = float(rng.choice([0.0, 0.05, 0.5, 1e17]))
        F = int(rng.choice([1, 4, 1000]))
        plan, info = reference_plan_info(loads, S, F, eps, K, capacity=C)
        check_plan_invariants(loads, plan, S)
        if plan["rank_load"].max() > C:
            assert not exact_plan_exists(load_e, R, S, K, C), (R, S, K, load_e.tolist(), C)
            missed += 1
        else:
            met += 1
    assert met >= 60 and missed >= 1


# -- beyond the promise: a fixed sample of small S = 1 cases --------------------------------------


def test_exact_mode_reaches_the_mean_on_small_single_slot_cases():
    # 400 seeded cases with R in {3, 4}, S = 1: the plain attempts alone (the planner before the
    # repairs) missed M in 7 of them where a plan at M exists. Outside the complete cases this is
    # not a promise (PLANNER.md measures 1 in 80,000 such misses), but on this sample the
    # repairs find every plan at M that exists.
    rng = np.random.default_rng(17)
    reached = 0
    for R, load_e, K in random_cases(rng, 400, ranks=(3, 4), experts_per_rank=(2, 3)):
        got = _plan(_loads(R, load_e), 1, 1, 0.0, K)["rank_load"].max()
        M = _mean_ceil(R, load_e)
        if got > M:
            assert not exact_plan_exists(load_e, R, 1, K, M), (R, K, load_e.tolist(), got)
        else:
            reached += 1
    assert reached >= 300
