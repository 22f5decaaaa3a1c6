"""The C++ planner (FFI custom call) against the independent NumPy reference on the experiments'
generated workloads (`experiments.lab.loads.workloads`), and its balance quality on the UltraEP
reference setup and on real DeepSeek-R1 loads (the rest of the comparison, on random loads:
tests/library/test_plan_vs_reference.py)."""

import functools

import jax
import numpy as np
import pytest
from conftest import skip_without_traces

import ultraep_jax as uep
from experiments.lab.loads import traces, workloads
from tests.helpers.planner_cases import FIELDS, assert_same_plan, native_plan, random_loads
from tests.references.planner import check_plan_invariants, rank_loads_before, reference_plan


@pytest.mark.parametrize("eps", [1e17, 1e19, 1e300, float(np.finfo(np.float64).max)])
def test_huge_eps_means_no_replicas(eps):
    # floor(T * (1 + eps) / R) is far beyond int64 here (mean 65536 * 1e17 > 2^63); converting it
    # used to be undefined (INT64_MIN on x86), which turned balancing fully on. A tolerance that
    # reaches the most loaded rank means: leave every token on its master.
    cfg = uep.BalancerConfig(num_experts=256, ep_size=64, slots_per_rank=2, balance_eps=eps)
    loads = workloads.rank_zipf_loads(64, 256, 8192, 8, 3.0, 0)
    got = native_plan(loads, cfg)
    before = rank_loads_before(loads)
    assert float(loads.sum()) * (1.0 + eps) / 64 > 2.0**63
    assert int(got.num_replicas) == 0
    np.testing.assert_array_equal(np.asarray(got.rank_load), before)
    np.testing.assert_array_equal(np.asarray(got.master_quota), loads.sum(axis=0))
    assert_same_plan(
        {n: getattr(got, n) for n in FIELDS}, reference_plan(loads, 2, 1024, eps), "eps"
    )


@pytest.mark.parametrize("g", [None, 4])
@pytest.mark.parametrize("eps", [0.0, 0.01])
@pytest.mark.parametrize("mean_frac", [1.0, 1.02, 0.9])
def test_ffi_equals_reference_with_capacity(eps, mean_frac, g):
    # EP16/E64 batches with the capacity at, just above and below the mean rank load (the last
    # is unreachable: every plan is then the one without a capacity); one fast domain or four.
    R, E, S, F = 16, 64, 2, 256
    cfg = uep.BalancerConfig(E, R, S, F, eps, ranks_per_domain=g)
    rng = np.random.default_rng(11)
    batch = np.stack([workloads.rank_zipf_loads(R, E, 4096, 4, 2.5, s) for s in range(6)])
    batch = np.concatenate([batch, np.stack([random_loads(rng, R, E, "hot", 5000)] * 2)])
    totals = batch.sum(axis=(1, 2), dtype=np.int64)
    assert (totals[:6] == totals[0]).all()  # the generated loads all have T = R * 4096 * 4
    cap = int(mean_frac * -(-int(totals[0]) // R))
    got = jax.jit(jax.vmap(lambda l: native_plan(l, cfg, cap)))(batch)
    unbounded = jax.jit(jax.vmap(lambda l: native_plan(l, cfg)))(batch)
    for i, loads in enumerate(batch):
        want = reference_plan(loads, S, F, eps, 1, capacity=cap, ranks_per_domain=g)
        assert_same_plan({n: np.asarray(getattr(got, n))[i] for n in FIELDS}, want, f"item {i}")
        check_plan_invariants(loads, want, S)
        free = np.asarray(unbounded.rank_load[i])
        if want["rank_load"].max() > cap:  # nothing fits: exactly the plan without a capacity
            np.testing.assert_array_equal(want["rank_load"], free)
        if free.max() <= cap:
            assert want["rank_load"].max() <= cap
    if mean_frac >= 1.0:
        assert (np.asarray(got.rank_load)[:6].max(axis=1) <= cap).all()


# -- balance quality ---------------------------------------------------------------------------

# UltraEP's reported replica counts at initial max/mean 1.5 / 2.0 / 3.0 (EP64, 256 experts, 2 spare
# slots per rank, top-8, 8192 tokens per rank); we must balance to <= 1.01 with no more.
ULTRAEP_REPLICAS = {1.5: 38, 2.0: 46, 3.0: 51}


@pytest.mark.parametrize("g", [None, 8])
@pytest.mark.parametrize("initial", sorted(ULTRAEP_REPLICAS))
def test_ultraep_reference_setup(initial, g):
    # With 8-GPU domains too: the fit rule keeps the balance and the replica budget here.
    cfg = uep.BalancerConfig(
        num_experts=256,
        ep_size=64,
        slots_per_rank=2,
        min_tokens_per_replica=1024,
        balance_eps=0.01,
        ranks_per_domain=g,
    )
    batch = np.stack(
        [workloads.rank_zipf_loads(64, 256, 8192, 8, initial, seed) for seed in range(5)]
    )
    plans = jax.jit(jax.vmap(lambda l: native_plan(l, cfg)))(batch)
    for i, loads in enumerate(batch):
        before = rank_loads_before(loads)
        assert abs(before.max() / before.mean() - initial) < 0.01 * initial
        after = np.asarray(plans.rank_load[i])
        assert after.max() / after.mean() <= 1.01, f"seed {i}"
        assert int(plans.num_replicas[i]) <= ULTRAEP_REPLICAS[initial], f"seed {i}"
        check_plan_invariants(loads, {n: np.asarray(getattr(plans, n))[i] for n in FIELDS}, 2)


@functools.cache
def _deepseek_r1(ep_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The DeepSeek-R1 trace's loads [N, R, E] for ``ep_size`` ranks and their max/mean before
    balancing by the reference (in Python: seconds), the same for every domain size."""
    try:
        rows = list(traces.trace_workloads("deepseek-r1", ep_size, 8192, 8, seed=0))
    except FileNotFoundError as err:
        skip_without_traces(f"traces not available: {err}")
    batch = np.stack([loads for _, loads in rows])
    return batch, np.asarray(uep.imbalance(np.stack([rank_loads_before(l) for l in batch])))


@pytest.mark.parametrize("g", [None, 8])
@pytest.mark.parametrize("ep_size", [32, 64])
def test_deepseek_r1_traces(ep_size, g):
    batch, before = _deepseek_r1(ep_size)
    cfg = uep.BalancerConfig(
        num_experts=256,
        ep_size=ep_size,
        slots_per_rank=2,
        min_tokens_per_replica=1024,
        balance_eps=0.01,
        ranks_per_domain=g,
    )
    plans = jax.jit(jax.vmap(lambda l: native_plan(l, cfg)))(batch)
    after = np.asarray(uep.imbalance(plans.rank_load))
    assert before.mean() > 1.3  # the real loads really are imbalanced
    assert after.mean() <= 1.02, f"mean final max/mean {after.mean():.4f} over {len(batch)} layers"
    assert np.all(after <= before + 1e-6)
