"""The CUDA planner against the CPU planner with the GPU check's planner section
(`experiments.gpu.planner`): through its benchmark hook, and the parallel kernel at its target
size on its reference workloads and the DeepSeek-R1 traces. Both skip without a GPU; on a GPU
machine run

    JAX_PLATFORMS=cuda,cpu python -m pytest tests/experiments/test_gpu_planner.py -q

(the configurations are tests/library/test_gpu.py's)."""

import itertools

import jax
import numpy as np
import pytest

import ultraep_jax as uep
from experiments.lab.loads import traces
from tests.helpers import needs_gpu
from tests.helpers.planner_cases import KERNELS, PLANNER_CASES, skewed_load_batch
from ultraep_jax.planning import native as _native


@needs_gpu
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("with_capacity", [False, True], ids=["unbounded", "capacity"])
def test_cuda_planner_hook_equals_cpu_planner(with_capacity, kernel):
    """Either CUDA kernel through the library's benchmark hook (no XLA), with and without a
    capacity (a little above the mean rank load, so that the capacity window runs); the hook
    poisons the outputs first, so an unwritten entry shows."""
    from experiments.gpu.planner import BENCH_LIB, cuda_bench

    if _native.library_path(BENCH_LIB) is None:
        pytest.skip(f"{BENCH_LIB} was not built into this install (ULTRAEP_BUILD_CUDA_BENCH=ON)")

    for kwargs, (n, R, E, tokens, exponent) in PLANNER_CASES.values():
        cfg = uep.BalancerConfig(**kwargs)
        loads = skewed_load_batch(np.random.default_rng(1), min(n, 50), R, E, tokens, exponent)
        cap = max(1, int(1.1 * np.median(loads.sum(axis=(1, 2))) / R)) if with_capacity else None
        want = jax.jit(jax.vmap(lambda x, cfg=cfg, cap=cap: uep.plan(x, cfg, capacity=cap)))(
            jax.device_put(loads, jax.devices("cpu")[0])
        )
        got, _ = cuda_bench(cfg, loads, 0, capacity=cap, parallel=KERNELS[kernel])
        for a, b in zip(jax.tree.leaves(want), got, strict=True):
            np.testing.assert_array_equal(np.asarray(a), b, err_msg=f"{kwargs} capacity={cap}")


@needs_gpu
@pytest.mark.parametrize("eps, capacity", [(0.01, None), (0.0, None), (0.01, 1.0)])
def test_cuda_parallel_planner_equals_cpu_planner_at_ep64(eps, capacity):
    """The parallel kernel at its target size, EP64/E256/S2 (14 warps per plan), on UltraEP's
    reference workloads and DeepSeek-R1 layers, against the CPU core."""
    if not _native.has_cuda_handler():
        pytest.skip("the CUDA planner handler was not built into this install (ULTRAEP_BUILD_CUDA)")
    from experiments.gpu.planner import reference_loads

    loads = reference_loads(64, 256, 8192, 6)
    try:
        rows = itertools.islice(traces.trace_workloads("deepseek-r1", 64, 8192, 8, 0), 58)
        loads = np.concatenate([loads, np.stack([l for _, l in rows])])
    except FileNotFoundError:
        pass  # the generated workloads alone
    cap = None if capacity is None else int(capacity * loads[0].sum(dtype=np.int64) / 64)
    cfg = uep.BalancerConfig(256, 64, 2, 1024, eps)
    cpu = jax.devices("cpu")[0]
    want = jax.jit(jax.vmap(lambda x: uep.plan(x, cfg, cap)))(jax.device_put(loads, cpu))
    planner = jax.jit(jax.vmap(lambda x: uep.plan(x, cfg, cap, parallel=True)))
    got = planner(jax.device_put(loads, jax.devices("gpu")[0]))
    for name in ("slot_expert", "slot_quota", "master_quota", "rank_load"):
        a, b = np.asarray(getattr(want, name)), np.asarray(getattr(got, name))
        np.testing.assert_array_equal(b, a, err_msg=name)
