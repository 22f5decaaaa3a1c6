"""Wall-clock timing: the median seconds of a call (`median_seconds`) and the one planner timing
of experiments/ (`time_batched_plan`, `seconds_per_plan`): every program that charges a planner
takes it from here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from experiments.lab.batched import batched_planner


def median_seconds(fn: Callable[[], object], repeats: int, inner: int = 1) -> float:
    """Median seconds per call of ``fn()`` over ``repeats`` samples, each ``inner`` back-to-back
    calls blocked on once (so the host's dispatch overlaps the device's work), after one warm-up
    call that compiles."""
    import jax

    if repeats < 1 or inner < 1:
        raise ValueError(f"repeats and inner must be >= 1, got {repeats} and {inner}")
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready([fn() for _ in range(inner)])
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def time_batched_plan(loads, cfg, repeats: int = 5, device=None, capacity=None) -> float:
    """Median seconds of one ``batched_planner(cfg, capacity)`` call on ``loads`` [N, R, E],
    placed on ``device`` (default: JAX's default device), over ``repeats`` calls after a warm-up.
    The one planner timing of experiments/: every program that charges a planner takes it from
    here (per plan: divide by N, or `seconds_per_plan`)."""
    import jax
    import numpy as np

    fn = batched_planner(cfg, capacity)
    data = jax.device_put(np.asarray(loads, dtype=np.int32), device)
    return median_seconds(lambda: fn(data), repeats)


def seconds_per_plan(loads_RE, cfg, repeats: int, batch: int = 32, capacity=None) -> float:
    """Seconds per plan of one load matrix [R, E] within ``capacity``: `time_batched_plan` on
    ``batch`` copies of it (so that the call's dispatch is amortised, as inside a jitted step),
    divided by ``batch``. Caches are warm: in a step the planner reads loads just gathered."""
    import numpy as np

    copies = np.repeat(np.asarray(loads_RE, np.int32)[None], batch, axis=0)
    return time_batched_plan(copies, cfg, repeats, capacity=capacity) / batch
