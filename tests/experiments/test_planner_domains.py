"""The domain experiment's planner copy (experiments.planner.domain_planner, used by
experiments.planner.domains): with no variant it is the planner of ffi/PLANNER.md with one
domain, and with the variant "fit" the planner with fast domains (the NumPy reference and the
native plan, on the default path); with one domain every variant is the planner; the slow-link
copy count on a hand-worked plan."""

import numpy as np
import pytest

import ultraep_jax as uep
from experiments.planner import domain_planner, domains
from tests.references.planner import reference_plan_info

VARIANTS = [("tie", 0), ("fit", 0), ("fit-home", 0), ("near", 0), (None, 4096)]


def _cases():
    rng = np.random.default_rng(7)
    for _ in range(60):
        R = int(rng.choice([2, 4, 8, 16]))
        E = R * int(rng.integers(1, 4))
        zipf = rng.zipf(1.6, size=E).astype(np.float64)
        loads = rng.multinomial(R * 2000, zipf / zipf.sum(), size=1)
        loads = np.repeat(loads // R, R, axis=0).astype(np.int32)
        yield loads, int(rng.integers(1, 4)), int(rng.choice([1, 64, 512]))


def test_no_variant_is_the_planner():
    for loads, S, F in _cases():
        R = loads.shape[0]
        replicas, rank_load = domain_planner.plan_replicas(loads, S, F, 1, 0.01, max(1, R // 2))
        _, info = reference_plan_info(loads, S, F, 0.01, 1)
        assert replicas == [tuple(r) for r in info["replicas"]]
        cfg = uep.BalancerConfig(loads.shape[1], R, S, F, 0.01, 1)
        np.testing.assert_array_equal(rank_load, np.asarray(uep.plan(loads, cfg).rank_load))


def test_fit_is_the_planner_with_domains():
    # The rule the library adopted: the copy's "fit" is uep.plan with ranks_per_domain = d (the
    # same replicas in the same slots, as the program asserts on every layer) and the reference.
    changed = 0
    for loads, S, F in _cases():
        R = loads.shape[0]
        for d in sorted({1, max(1, R // 4), max(1, R // 2)}):
            replicas, rank_load = domain_planner.plan_replicas(loads, S, F, 1, 0.01, d, "fit")
            _, info = reference_plan_info(loads, S, F, 0.01, 1, ranks_per_domain=d)
            assert replicas == [tuple(r) for r in info["replicas"]]
            cfg = uep.BalancerConfig(loads.shape[1], R, S, F, 0.01, 1, ranks_per_domain=d)
            library = uep.plan(loads, cfg)
            plan = {k: np.asarray(getattr(library, k)) for k in domain_planner.PLAN_FIELDS}
            domain_planner.assert_is_library(replicas, rank_load, plan, (R, S, F, d))
            changed += replicas != domain_planner.plan_replicas(loads, S, F, 1, 0.01, d)[0]
    assert changed > 0  # the domains changed some of these plans


@pytest.mark.parametrize(("mode", "far_floor"), VARIANTS)
def test_one_domain_every_variant_is_the_planner(mode, far_floor):
    for loads, S, F in _cases():
        R = loads.shape[0]
        want = domain_planner.plan_replicas(loads, S, F, 1, 0.01, R)
        got = domain_planner.plan_replicas(loads, S, F, 1, 0.01, R, mode, far_floor)
        assert got[0] == want[0]
        np.testing.assert_array_equal(got[1], want[1])


def test_slow_copies_count_expert_domain_pairs():
    # R = 8, E_m = 1, d = 2: expert 0 (domain 0) on ranks 1 (its own domain), 2 and 3 (domain 1,
    # one copy) and 6 (domain 3); expert 5 (domain 2) on rank 4 (its own domain).
    replicas = [(0, 1, 5), (0, 2, 5), (0, 3, 5), (0, 6, 5), (5, 4, 5)]
    assert domains.slow_copies(replicas, 1, 2) == 2
    assert domains.slow_copies(replicas, 1, 8) == 0
