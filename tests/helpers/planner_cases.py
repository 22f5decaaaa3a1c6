"""What the planner test files share: the plan's fields, the random load kinds and the fuzz
configurations they run (tests/library/test_plan_vs_reference.py's), the native planner called by
name, batched plans as NumPy arrays, their comparison field by field, the first layers of a trace,
and the GPU checks' skewed load batches and configurations (tests/library/test_gpu.py,
tests/experiments/test_gpu_planner.py)."""

from __future__ import annotations

import functools
import itertools

import jax
import numpy as np
from conftest import skip_without_traces

import ultraep_jax as uep
from experiments.lab.loads import traces

#: A plan's arrays, in the order the comparisons report them.
FIELDS = ("slot_expert", "slot_quota", "master_quota", "rank_load")

#: The kinds of `random_loads`.
KINDS = ("uniform", "hot", "zipf", "one", "equal")

#: The fuzz configurations: (R, E, S, F, K, eps).
CONFIGS = [
    (1, 4, 2, 1, 1, 0.01),
    (2, 2, 1, 1, 1, 0.0),
    (4, 8, 0, 16, 1, 0.01),
    (4, 8, 2, 1, 0, 0.0),
    (4, 16, 3, 50, 1, 0.05),
    (8, 8, 1, 10, 1, 0.01),
    (8, 16, 2, 100, 1, 0.01),
    (8, 32, 4, 1, 2, 0.1),
    (16, 64, 2, 1024, 1, 0.01),
    (64, 256, 2, 1024, 1, 0.01),
]

#: Fast domain sizes the random cases run with (None: one domain), each where it divides R
#: (`domains_of`).
DOMAINS = [None, 1, 2, 4]


def domains_of(R: int) -> list[int | None]:
    """The sizes of `DOMAINS` that split R ranks evenly (None, one domain, always): the cases
    are built from these only, so that no impossible combination is generated."""
    return [g for g in DOMAINS if g is None or R % g == 0]


def random_loads(rng, R, E, kind, scale) -> np.ndarray:
    """int32 [R, E] loads of ``kind`` (`KINDS`) up to about ``scale`` tokens per entry."""
    if kind == "uniform":
        loads = rng.integers(0, scale + 1, size=(R, E))
    elif kind == "hot":  # a few experts take most tokens
        loads = rng.integers(0, scale // 20 + 1, size=(R, E))
        hot = rng.choice(E, size=max(1, E // 8), replace=False)
        loads[:, hot] += rng.integers(scale // 2, scale + 1, size=(R, hot.size))
    elif kind == "zipf":
        p = 1.0 / np.arange(1, E + 1) ** rng.uniform(0.5, 2.0)
        p = p[rng.permutation(E)] / p.sum()
        loads = np.stack([rng.multinomial(scale * E // 4 + 1, p) for _ in range(R)])
    elif kind == "one":  # a single expert takes every token
        loads = np.zeros((R, E), np.int64)
        loads[:, rng.integers(E)] = rng.integers(0, scale + 1, size=R)
    elif kind == "equal":
        loads = np.full((R, E), rng.integers(0, scale + 1))
    else:
        raise ValueError(kind)
    return loads.astype(np.int32)


def balancer(S, F, K, eps, g=None) -> uep.BalancerConfig:
    """The balancer of a case, in the reference planner's argument names (E and R: `uep.plan`
    reads them from the loads' shape; ``g``: ranks per fast domain)."""
    return uep.BalancerConfig(
        slots_per_rank=S,
        min_tokens_per_replica=F,
        master_keep_tokens=K,
        balance_eps=eps,
        ranks_per_domain=g,
    )


def native_plan(loads, cfg, capacity=None, parallel=False) -> uep.Plan:
    """``uep.plan`` with the native planner named: "auto" (the same plan on the CPU) would also
    trace the portable planner, its branch for other platforms, for every new size (seconds under
    vmap; tests/library/test_portable.py checks what "auto" chooses)."""
    return uep.plan(loads, cfg, capacity=capacity, parallel=parallel, planner="native")


def batched_plans(cfg, batch, capacity=None, *, planner="native", parallel=False) -> dict:
    """The plans of ``batch`` [N, R, E] by ``planner`` (jitted, vmapped), as NumPy arrays
    [N, ...] by field."""
    fn = jax.jit(jax.vmap(lambda l: uep.plan(l, cfg, capacity, parallel=parallel, planner=planner)))
    plans = fn(batch)
    return {n: np.asarray(getattr(plans, n)) for n in FIELDS}


def plan_item(plans: dict, i: int) -> dict:
    """Item ``i`` of batched plans (a dict of arrays [N, ...] by field)."""
    return {n: plans[n][i] for n in FIELDS}


def assert_same_plan(got, want, context) -> None:
    """Every field of ``got`` equals ``want``'s (dicts by field, or plans), bit for bit."""
    for name in FIELDS:
        np.testing.assert_array_equal(
            np.asarray(got[name]), np.asarray(want[name]), err_msg=f"{name} differs: {context}"
        )


def skewed_load_batch(rng, n, R, E, tokens=4096, exponent=(0.0, 2.0)) -> np.ndarray:
    """int32 [n, R, E]: skewed loads (a random Zipf-like popularity per matrix), some zeros."""
    out = np.empty((n, R, E), np.int32)
    for i in range(n):
        p = rng.permutation(E) + 1.0
        p = p ** -rng.uniform(*exponent)
        p /= p.sum()
        out[i] = rng.multinomial(int(rng.integers(0, tokens)), p, size=R)
    return out


@functools.cache
def trace_batch(trace: str, ep_size: int) -> np.ndarray:
    """int32 [N, R, E]: the first 120 layers of a trace as the benchmarks plan them."""
    try:
        rows = itertools.islice(traces.trace_workloads(trace, ep_size, 8192, 8, 0), 120)
        return np.stack([loads for _, loads in rows])
    except FileNotFoundError as err:
        skip_without_traces(f"traces not available: {err}")


# Configurations whose searches between them take every branch of PLANNER.md's threshold search
# (fast path; coarse probes then refine probes; nothing found), large R * S, and no search.
PLANNER_CASES = {
    "EP8_E64_S2": (
        {"num_experts": 64, "ep_size": 8, "slots_per_rank": 2, "min_tokens_per_replica": 16},
        (200, 8, 64, 4096, (0.0, 2.0)),
    ),
    "EP16_E32_S1_F256_eps0": (
        {
            "num_experts": 32,
            "ep_size": 16,
            "slots_per_rank": 1,
            "min_tokens_per_replica": 256,
            "balance_eps": 0.0,
        },
        (100, 16, 32, 8192, (1.0, 3.0)),
    ),
    "EP8_E16_S1_K200": (
        {
            "num_experts": 16,
            "ep_size": 8,
            "slots_per_rank": 1,
            "min_tokens_per_replica": 64,
            "balance_eps": 0.05,
            "master_keep_tokens": 200,
        },
        (100, 8, 16, 4096, (0.5, 3.0)),
    ),
    "EP256_E256_S4": (
        {"num_experts": 256, "ep_size": 256, "slots_per_rank": 4, "min_tokens_per_replica": 16},
        (5, 256, 256, 4096, (0.0, 2.0)),
    ),
    "EP4_E8_S0": (
        {"num_experts": 8, "ep_size": 4, "slots_per_rank": 0},
        (10, 4, 8, 4096, (0.0, 2.0)),
    ),
    "EP1_E8_S2": (
        {"num_experts": 8, "ep_size": 1, "slots_per_rank": 2, "min_tokens_per_replica": 16},
        (10, 1, 8, 4096, (0.0, 2.0)),
    ),
    # fast domains: the fit rule (ffi/PLANNER.md, pick_target) in either kernel
    "EP64_E256_S2_D8": (
        {"num_experts": 256, "ep_size": 64, "slots_per_rank": 2, "ranks_per_domain": 8},
        (50, 64, 256, 8192, (0.5, 2.0)),
    ),
    "EP16_E32_S1_F256_eps0_D4": (
        {
            "num_experts": 32,
            "ep_size": 16,
            "slots_per_rank": 1,
            "min_tokens_per_replica": 256,
            "balance_eps": 0.0,
            "ranks_per_domain": 4,
        },
        (100, 16, 32, 8192, (1.0, 3.0)),
    ),
}


KERNELS = {"core": False, "parallel": True}  # the CUDA kernels: uep.plan(..., parallel=...)
