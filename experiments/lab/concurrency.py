"""The concurrency check of pinned ranks: how far the wall clock is from the busiest rank's
(`concurrency_check`), and its one line for a reader (`concurrency_line`). Programs keep its
result under the key ``"calibration"`` of their JSON and print it as ``calibration: ...``.
"""

from __future__ import annotations

import os

from experiments.lab.walltime import median_seconds

_CHECK_ROWS = 32768


def concurrency_check(rows: int, d_model: int, d_ff: int, repeats: int = 7) -> dict:
    """How far the wall clock is from the busiest rank's, across this run's processes.

    Every process times the same local SwiGLU-shaped matmul work (``rows`` x D x F, forward; at
    least 32768 rows),
    first process 0 alone while the others wait, then all at once. ``ratio`` (all at once / alone,
    medians of process 0) is 1.0 when the ranks truly run concurrently and the process count
    when they share one core. Must be called by every process.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    device = jax.local_devices()[0]
    rows = max(rows, _CHECK_ROWS)  # long enough for the clock to see it
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.normal(size=(rows, d_model)).astype(np.float32), device)
    w = jax.device_put(rng.normal(size=(d_model, d_ff)).astype(np.float32) * 0.05, device)
    work = jax.jit(lambda x, w: (jax.nn.silu(x @ w) * (x @ w)) @ w.T + jnp.float32(0))
    jax.block_until_ready(work(x, w))

    def timed():
        return median_seconds(lambda: work(x, w), repeats)

    multihost_utils.sync_global_devices("calibration:alone")
    alone = timed() if jax.process_index() == 0 else float("nan")
    multihost_utils.sync_global_devices("calibration:together")
    together = timed()
    multihost_utils.sync_global_devices("calibration:done")
    return {
        "processes": jax.process_count(),
        "realtime": os.sched_getscheduler(0) == os.SCHED_RR,
        "alone_ms": alone * 1e3,
        "together_ms": together * 1e3,
        "ratio": together / alone if jax.process_index() == 0 else float("nan"),
    }


def concurrency_line(cal: dict) -> str:
    """One line that tells a reader whether the clock is the busiest rank's."""
    return (
        f"calibration: {cal['processes']} pinned ranks with equal work take "
        f"{cal['together_ms']:.1f} ms, one rank alone {cal['alone_ms']:.1f} ms: "
        f"ratio {cal['ratio']:.2f} (1.00 = truly concurrent, {cal['processes']:.2f} = one core)"
        + ("" if cal.get("realtime") else "; not at real-time priority: other load counts")
    )
