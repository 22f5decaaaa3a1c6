"""The parallel form of the planner (ffi/planner_parallel.h) against the sequential core and the
NumPy reference, bit for bit (on the experiments' generated workloads and the traces:
tests/experiments/test_plan_parallel_workloads.py).

On the CPU the parallel form runs as its host emulation: the same header code the CUDA kernel
runs, with the warps one after the other and each warp's lanes in a loop. It is reached two ways:
``uep.plan(..., parallel=True)`` (the FFI target ``ultraep_plan_parallel``, with the device's
number of warps), and the library's test hook with any number of warps, so that the boundaries of
the probe rounds fall everywhere in the search's probe lists.
"""

import ctypes

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ultraep_jax as uep
from tests.helpers.planner_cases import (
    CONFIGS,
    DOMAINS,
    FIELDS,
    KINDS,
    assert_same_plan,
    batched_plans,
    domains_of,
    native_plan,
    plan_item,
    random_loads,
)
from tests.references.planner import check_plan_invariants, reference_plan, reference_plan_info
from ultraep_jax.oracle import random_cases
from ultraep_jax.planning import native as _native


def _config(R, E, S, F, K, eps, g=None) -> uep.BalancerConfig:
    return uep.BalancerConfig(E, R, S, F, eps, K, ranks_per_domain=g)


def _host_hook():
    lib = _native.cpu_library()
    fn = lib.ultraep_plan_parallel_host
    i64, i32p = ctypes.c_int64, ctypes.POINTER(ctypes.c_int32)
    # R, E, S, F, K, eps, capacity, ranks_per_domain, warps, loads [R, E], the four outputs
    fn.argtypes = [i64] * 5 + [ctypes.c_double, i64, i64, i64] + [i32p] * 5
    fn.restype = ctypes.c_int32
    return fn


def host_plan(loads, S, F, eps, K=1, capacity=0, warps=1, g=None) -> dict:
    """The host form on ``warps`` warps through the test hook, with fast domains of ``g`` ranks
    (None: one; raises on a nonzero status)."""
    loads = np.ascontiguousarray(loads, np.int32)
    R, E = loads.shape
    outs = {
        "slot_expert": np.zeros((R, S), np.int32),
        "slot_quota": np.zeros((R, S), np.int32),
        "master_quota": np.zeros(E, np.int32),
        "rank_load": np.zeros(R, np.int32),
    }
    ptrs = [a.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)) for a in (loads, *outs.values())]
    status = _host_hook()(R, E, S, F, K, float(eps), capacity, R if g is None else g, warps, *ptrs)
    if status != 0:
        raise ValueError(f"ultraep_plan_parallel_host: status {status}")
    return outs


# -- uep.plan(..., parallel=True): the FFI target with the device's warps -----------------------


@pytest.mark.parametrize(
    "R, E, S, F, K, eps, g", [(*c, g) for c in CONFIGS for g in domains_of(c[0])]
)
def test_parallel_equals_core_and_reference_on_random_batches(R, E, S, F, K, eps, g):
    # The core's own fuzz configurations and load kinds (tests/library/test_plan_vs_reference.py);
    # the reference on every matrix up to EP16 and on four of the EP64 ones (it is slow there).
    cfg = _config(R, E, S, F, K, eps, g)
    rng = np.random.default_rng(R * 1000 + E + S + 1)
    batch = np.stack([random_loads(rng, R, E, k, s) for k in KINDS for s in (1, 7, 1000, 200_000)])
    core, par = batched_plans(cfg, batch), batched_plans(cfg, batch, parallel=True)
    replicas = 0
    for i, loads in enumerate(batch):
        assert_same_plan(plan_item(par, i), plan_item(core, i), f"{cfg}, item {i} (core)")
        if R <= 16 or i % 5 == 1:
            want = reference_plan(loads, S, F, eps, K, ranks_per_domain=g)
            assert_same_plan(plan_item(par, i), want, f"item {i} (ref)")
        check_plan_invariants(loads, plan_item(par, i), S)
        replicas += int((par["slot_expert"][i] >= 0).sum())
    if S > 0 and R > 1:
        assert replicas > 0  # the batch made replicas, not only trivial plans


@settings(max_examples=60, deadline=None)
@given(
    R=st.sampled_from([2, 4, 8]),
    experts_per_rank=st.integers(1, 4),
    S=st.integers(0, 3),
    F=st.sampled_from([1, 5, 64, 4096]),
    K=st.sampled_from([0, 1, 7]),
    eps=st.sampled_from([0.0, -0.0, 5e-324, 0.003, 0.01, 0.25, 1e17, 1e300]),
    seed=st.integers(0, 2**31),
    kind=st.sampled_from(KINDS),
    scale=st.sampled_from([3, 500, 60_000, 4_000_000]),
    capacity=st.one_of(st.none(), st.floats(0.9, 1.5)),
    warps=st.integers(1, 16),
    g=st.sampled_from(DOMAINS),
)
def test_parallel_equals_core_and_reference_property(
    R, experts_per_rank, S, F, K, eps, seed, kind, scale, capacity, warps, g
):
    E = R * experts_per_rank
    loads = random_loads(
        np.random.default_rng(seed), R, E, kind, scale // E + 1 if scale > 100_000 else scale
    )
    cap = None if capacity is None else max(1, int(capacity * loads.sum(dtype=np.int64) / R))
    g = g if g is None or R % g == 0 else R
    cfg = _config(R, E, S, F, K, eps, g)
    core = native_plan(loads, cfg, cap)
    par = native_plan(loads, cfg, cap, parallel=True)
    want = reference_plan(loads, S, F, eps, K, capacity=cap or 0, ranks_per_domain=g)
    context = f"{cfg}, capacity {cap}"
    assert_same_plan({n: np.asarray(getattr(par, n)) for n in FIELDS}, want, context)
    assert_same_plan({n: np.asarray(getattr(core, n)) for n in FIELDS}, want, context)
    hosted = host_plan(loads, S, F, eps, K, cap or 0, warps, g)
    assert_same_plan(hosted, want, f"{context}, {warps} warps")


def test_negative_and_overflowing_loads_are_reported_as_by_the_core():
    cfg = uep.BalancerConfig(num_experts=16, ep_size=4, slots_per_rank=2)
    loads = np.ones((4, 16), np.int32)
    loads[2, 5] = -3
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"loads\[0\]\[2, 5\] = -3"):
        jax.block_until_ready(uep.plan(loads, cfg, parallel=True))
    big = np.zeros((4, 16), np.int32)
    big[:, 0] = 2**30  # expert 0's total is 2^32
    with pytest.raises(jax.errors.JaxRuntimeError, match="exceeds int32"):
        jax.block_until_ready(uep.plan(big, cfg, parallel=True))
    with pytest.raises(TypeError, match="parallel must be a bool"):
        uep.plan(loads, cfg, parallel=1)


# -- the probe rounds: the host form on few warps ------------------------------------------------


@pytest.mark.parametrize("g", [None, 1])
@pytest.mark.parametrize(
    "S, F, eps, capacity", [(1, 1, 0.0, 0), (2, 3, 0.0, 0), (1, 2, 0.05, 40), (1, 1, 0.5, 40)]
)
def test_host_form_on_few_warps_where_repairs_and_windows_run(S, F, eps, capacity, g):
    # Small loads and one or two slots (the exact solver's cases, R 3..4): plain attempts fail,
    # the repairs and the capacity step's second window decide. On 1, 2 and 3 warps a search of
    # more probes than warps spans several rounds.
    rng = np.random.default_rng(S * 10 + F + 7)
    probes = []
    for R, load_e, K in random_cases(rng, 300, ranks=(3, 4), experts_per_rank=(2, 3)):
        if capacity and load_e.sum() > 0:
            load_e = np.round(load_e * (36 * R / load_e.sum())).astype(np.int32)
            K += 8
        loads = np.zeros((R, len(load_e)), np.int32)
        loads[0] = load_e
        want, info = reference_plan_info(loads, S, F, eps, K, capacity=capacity, ranks_per_domain=g)
        for warps in (1, 2, 3):
            got = host_plan(loads, S, F, eps, K, capacity, warps, g)
            assert_same_plan(got, want, f"{load_e}, K {K}, {warps} warps")
        probes.append(len(info["probes"]))
    probes = np.asarray(probes)
    assert (probes > 1).sum() >= 1  # searches that took several rounds on one warp
    if capacity:  # and on three warps (both windows, their coarse probes)
        assert (probes > 3).sum() >= 5, np.bincount(probes)


def test_host_form_on_few_warps_through_coarse_and_refine_probes():
    # Masters that must keep most of their tokens (K = 200..1000 of one hot expert's ~1100):
    # thresholds near the mean cannot be reached, so the ladder goes on to its coarse probes and
    # refines. Cut into rounds of 1, 2, 5 and 16 warps, every list ends at the same winner.
    rng = np.random.default_rng(3)
    probes = []
    for _ in range(24):
        load_e = rng.integers(50, 200, size=8)
        load_e[0] += 1000
        K = int(rng.integers(200, 1000))
        loads = np.zeros((4, 8), np.int32)
        loads[1] = load_e
        want, info = reference_plan_info(loads, 1, 16, 0.01, K)
        for warps in (1, 2, 5, 16):
            assert_same_plan(host_plan(loads, 1, 16, 0.01, K, 0, warps), want, f"{warps} warps")
        probes.append(len(info["probes"]))
    # searches whose coarse and refine lists span several rounds of 5 warps (and of 16)
    assert sum(p > 4 + 5 for p in probes) >= 10 and sum(p > 4 + 16 for p in probes) >= 5, probes


# -- ties: the packed keys' order is the core's tie rule -----------------------------------------


@pytest.mark.parametrize("parallel", [False, True], ids=["core", "parallel"])
def test_target_ties_go_to_the_smallest_rank(parallel):
    # Hand-worked (R = 3, one expert per rank, S = 1, F = 1, K = 1). Rank 0 has excess 3 over
    # tau, ranks 1 and 2 the same slack: the tie must go to rank 1.
    # Best fit: L = [23, 15, 15], eps 0.15: tau0 = floor(53 * 1.15 / 3) = 20, slacks 5 and 5 both
    # take the 3 tokens, so rank 1 gets all of them and rank 2 none.
    cfg = uep.BalancerConfig(3, 3, 1, 1, 0.15)
    plan = native_plan(np.diag([23, 15, 15]).astype(np.int32), cfg, parallel=parallel)
    assert np.asarray(plan.slot_expert).tolist() == [[-1], [0], [-1]]
    assert np.asarray(plan.slot_quota).tolist() == [[0], [3], [0]]
    assert np.asarray(plan.rank_load).tolist() == [20, 18, 15]
    # Most slack: L = [23, 18, 18], exact mode, tau = 20: slacks 2 and 2 cannot take 3, so the
    # most slack wins, tie to rank 1 (2 tokens); rank 2 then fits the last token.
    cfg = uep.BalancerConfig(3, 3, 1, 1, 0.0)
    plan = native_plan(np.diag([23, 18, 18]).astype(np.int32), cfg, parallel=parallel)
    assert np.asarray(plan.slot_quota).tolist() == [[0], [2], [1]]
    assert np.asarray(plan.master_quota).tolist() == [20, 18, 18]
    assert np.asarray(plan.rank_load).tolist() == [20, 20, 19]


# -- fast domains: the fit rule in the core and in the packed key --------------------------------


@pytest.mark.parametrize("parallel", [False, True], ids=["core", "parallel"])
def test_fit_prefers_a_near_target(parallel):
    # Hand-worked (tests/references/test_planner.py has the steps; S = 1, F = 1, K = 1).
    # R = 4, L = [30, 6, 10, 18], eps 0.25: tau = 20, rank 0's 10 tokens fit ranks 1 (slack 14)
    # and 2 (slack 10). One domain: the least slack, rank 2. Domains of 2: rank 1, in the
    # master's domain.
    loads = np.diag([30, 6, 10, 18]).astype(np.int32)
    for g, target in [(None, 2), (4, 2), (1, 2), (2, 1)]:
        cfg = uep.BalancerConfig(4, 4, 1, 1, 0.25, ranks_per_domain=g)
        plan = native_plan(loads, cfg, parallel=parallel)
        want = [[-1]] * 4
        want[target] = [0]
        assert np.asarray(plan.slot_expert).tolist() == want, g
        assert np.asarray(plan.rank_load).max() == 20
    # R = 6, L = [36, 20, 8, 10, 12, 20], eps 0.15: tau = 20; rank 0's first replica takes the
    # most slack (rank 2, 12 tokens), its last 4 tokens fit ranks 3 (slack 10) and 4 (slack 8).
    # Domains of 2: rank 3, whose domain now holds expert 0; otherwise rank 4.
    loads = np.diag([36, 20, 8, 10, 12, 20]).astype(np.int32)
    for g, second in [(None, 4), (6, 4), (3, 4), (2, 3)]:
        cfg = uep.BalancerConfig(6, 6, 1, 1, 0.15, ranks_per_domain=g)
        plan = native_plan(loads, cfg, parallel=parallel)
        quota = [0] * 6
        quota[2], quota[second] = 12, 4
        assert np.asarray(plan.slot_quota).ravel().tolist() == quota, g
        assert np.asarray(plan.rank_load).max() == 20


def test_hook_rejects_domains_that_do_not_split_the_ranks():
    loads = np.diag([30, 6, 10, 18]).astype(np.int32)
    for g in (0, 3, 8):
        with pytest.raises(ValueError, match="status -1"):
            host_plan(loads, 1, 1, 0.25, g=g)
