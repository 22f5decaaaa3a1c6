"""The parallel form of the planner (ffi/planner_parallel.h) against the sequential core and the
NumPy reference on the experiments' generated workloads (`experiments.lab.loads.workloads`) and on
the traces (the rest of the comparison, and how the parallel form is reached on the CPU:
tests/library/test_plan_parallel.py)."""

import functools

import numpy as np
import pytest

import ultraep_jax as uep
from experiments.lab.loads import workloads
from tests.helpers.planner_cases import (
    FIELDS,
    assert_same_plan,
    batched_plans,
    native_plan,
    plan_item,
    random_loads,
    trace_batch,
)
from tests.references.planner import reference_plan
from ultraep_jax.planning import native as _native


@pytest.mark.parametrize("g", [None, 4])
@pytest.mark.parametrize("mean_frac", [1.0, 1.02, 0.9])
@pytest.mark.parametrize("eps", [0.0, 0.01])
def test_parallel_equals_core_with_capacity(eps, mean_frac, g):
    # The capacity window at, just above and below (unreachable) the mean rank load.
    R, E, S, F = 16, 64, 2, 256
    cfg = uep.BalancerConfig(E, R, S, F, eps, ranks_per_domain=g)
    rng = np.random.default_rng(12)
    batch = np.stack([workloads.rank_zipf_loads(R, E, 4096, 4, 2.5, s) for s in range(6)])
    batch = np.concatenate([batch, np.stack([random_loads(rng, R, E, "hot", 5000)] * 2)])
    cap = int(mean_frac * -(-int(batch[0].sum(dtype=np.int64)) // R))
    core = batched_plans(cfg, batch, capacity=cap)
    par = batched_plans(cfg, batch, capacity=cap, parallel=True)
    for i, loads in enumerate(batch):
        want = reference_plan(loads, S, F, eps, 1, capacity=cap, ranks_per_domain=g)
        assert_same_plan(plan_item(par, i), want, f"item {i}, capacity {cap}")
        assert_same_plan(plan_item(core, i), want, f"item {i}, capacity {cap}")


# -- EP64/E256/S2 and the traces -------------------------------------------------------------


@functools.cache
def _ep64_batch() -> np.ndarray:
    """int32 [3, 64, 256]: UltraEP's reference setup at initial max/mean 1.5, 2 and 3."""
    return np.stack([workloads.rank_zipf_loads(64, 256, 8192, 8, t, 0) for t in (1.5, 2.0, 3.0)])


@pytest.mark.parametrize("g", [None, 8])
@pytest.mark.parametrize("eps, capacity", [(0.01, None), (0.0, None), (0.01, 1.0), (0.0, 1.001)])
def test_parallel_equals_core_and_reference_at_ep64(eps, capacity, g):
    # EP64/E256/S2 runs on parallel_warps = 14 warps; one domain or 8-GPU domains.
    R, E, S, F = 64, 256, 2, 1024
    assert _native.parallel_warps(R, E, S) == 14
    batch = _ep64_batch()
    cap = None if capacity is None else int(capacity * batch[0].sum(dtype=np.int64) / R)
    cfg = uep.BalancerConfig(E, R, S, F, eps, ranks_per_domain=g)
    core = batched_plans(cfg, batch, cap)
    par = batched_plans(cfg, batch, cap, parallel=True)
    for i, loads in enumerate(batch):
        assert_same_plan(plan_item(par, i), plan_item(core, i), f"item {i}")
        want = reference_plan(loads, S, F, eps, 1, cap or 0, ranks_per_domain=g)
        assert_same_plan(plan_item(par, i), want, f"item {i}")


@pytest.mark.parametrize(
    "trace, ep_size, eps, g",
    [
        ("deepseek-r1", 64, 0.01, None),
        ("deepseek-r1", 64, 0.01, 8),
        ("deepseek-r1", 64, 0.0, None),
        ("deepseek-r1", 64, 0.0, 8),
        ("qwen1.5-moe", 12, 0.01, None),
        ("qwen1.5-moe", 12, 0.01, 4),
        ("switch-base-128", 64, 0.01, None),
        ("switch-base-128", 64, 0.01, 8),
    ],
)
def test_parallel_equals_core_on_traces(trace, ep_size, eps, g):
    batch = trace_batch(trace, ep_size)
    cfg = uep.BalancerConfig(batch.shape[2], ep_size, 2, 1024, eps, ranks_per_domain=g)
    core, par = batched_plans(cfg, batch), batched_plans(cfg, batch, parallel=True)
    for name in FIELDS:
        np.testing.assert_array_equal(par[name], core[name], err_msg=f"{trace}: {name}")
    assert (par["slot_expert"] >= 0).sum() > len(batch)  # the layers were balanced


def test_sizes_beyond_the_shared_memory_budget_run_the_core():
    # EP512/E512/S8: one warp's state (58 KB) exceeds a block's shared memory, so the parallel
    # target runs the sequential core (the same plan by definition); smaller sizes do not.
    assert _native.parallel_warps(512, 512, 8) == 0
    assert _native.parallel_warps(256, 256, 4) == 2
    assert _native.parallel_warps(8, 64, 2) == 16
    loads = workloads.rank_zipf_loads(512, 512, 64, 2, 2.0, 0)
    cfg = uep.BalancerConfig(512, 512, 8, 16)
    core, par = native_plan(loads, cfg), native_plan(loads, cfg, parallel=True)
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(par, name), getattr(core, name), err_msg=name)
