"""Helpers every experiment shares: simulated CPU devices and the batched planner.

``force_cpu_devices`` must run before JAX initialises a backend; it is the only place the
experiments touch ``XLA_FLAGS``.
"""

from __future__ import annotations

import functools
import os
import time

_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def force_cpu_devices(count: int, *, cpu_only: bool = False) -> None:
    """Asks XLA's host platform for ``count`` devices (a no-op if ``XLA_FLAGS`` already names a
    count, so a caller's choice wins). ``cpu_only`` also pins JAX to the CPU platform unless
    ``JAX_PLATFORMS`` is set. Only the host platform reads the flag: on a GPU it changes nothing."""
    if count < 1:
        raise ValueError(f"cpu device count must be >= 1, got {count}")
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={count}".strip()
    if cpu_only:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


@functools.cache
def batched_planner(cfg):
    """``jax.jit(jax.vmap(uep.plan))`` for one ``BalancerConfig``: plans ``[N, R, E]`` int32
    loads in one call. Cached per config."""
    import jax

    import ultraep_jax as uep

    return jax.jit(jax.vmap(lambda loads: uep.plan(loads, cfg)))


def time_batched_plan(loads, cfg, repeats: int = 5) -> float:
    """Median seconds of one ``batched_planner(cfg)`` call on ``loads`` [N, R, E] (after a
    warm-up call that compiles), over ``repeats`` calls."""
    import jax
    import numpy as np

    fn = batched_planner(cfg)
    data = jax.device_put(np.asarray(loads, dtype=np.int32))
    jax.block_until_ready(fn(data))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(data))
        times.append(time.perf_counter() - start)
    return float(np.median(times))
