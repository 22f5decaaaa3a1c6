"""The portable planner's time per plan against the C++ core's, in the same run.

    python -m experiments.planner.portable_speed [--batch=64] [--repeats=5]

At EP32/E256/S2 and EP64/E256/S2 (rank-level Zipf loads at initial max/mean 2, top-8, 8192 tokens
per rank; the default balancer: F=1024, eps=0.01): the time per plan of `jit(vmap(plan))` over
``--batch`` load matrices, as the README's C++ figure is measured, and of one jitted call on one
matrix; each as a ratio to the C++ core (`planner="native"`) timed the same way in this run. The
plans are checked equal first. Medians over ``--repeats``
(`experiments.lab.walltime.median_seconds`).
"""

from __future__ import annotations

import jax
import numpy as np
from absl import app, flags

import ultraep_jax as uep
from experiments.lab.loads import workloads
from experiments.lab.walltime import median_seconds

BATCH = flags.DEFINE_integer("batch", 64, "load matrices per batched call")
REPEATS = flags.DEFINE_integer("repeats", 5, "timed calls per figure (median)")
SIZES = ((32, 256, 2), (64, 256, 2))


def _planner(cfg: uep.BalancerConfig, planner: str, batched: bool):
    """The jitted planner: over a batch [N, R, E] (vmap) or one matrix [R, E]."""
    one = lambda loads: uep.plan(loads, cfg, planner=planner)  # noqa: E731
    return jax.jit(jax.vmap(one) if batched else one)


def _per_plan(fn, loads, count: int) -> float:
    """Median seconds per plan of ``fn(loads)`` planning ``count`` matrices."""
    loads = jax.device_put(loads)
    return median_seconds(lambda: fn(loads), REPEATS.value) / count


def _row(R: int, E: int, S: int) -> str:
    """One size's figures, portable against native, batched and one call."""
    cfg = uep.BalancerConfig(E, R, S)
    batch = np.stack([workloads.rank_zipf_loads(R, E, 8192, 8, 2.0, s) for s in range(BATCH.value)])
    got = {p: _planner(cfg, p, True)(batch) for p in ("native", "portable")}
    for name in ("slot_expert", "slot_quota", "master_quota", "rank_load"):
        np.testing.assert_array_equal(getattr(got["portable"], name), getattr(got["native"], name))
    cells = []
    for batched, loads, n in ((True, batch, len(batch)), (False, batch[0], 1)):
        t = {p: _per_plan(_planner(cfg, p, batched), loads, n) for p in ("native", "portable")}
        cells.append(
            f"{t['native'] * 1e6:9.1f} {t['portable'] * 1e6:10.1f} "
            f"{t['portable'] / t['native']:6.1f}x"
        )
    return f"EP{R}/E{E}/S{S}  " + "  |  ".join(cells)


def main(argv):
    del argv
    print(f"Time per plan (us) on {jax.devices()[0].device_kind}, median of {REPEATS.value}:")
    print(
        f"{'':14s}jit(vmap) over {BATCH.value}: native portable ratio  |  one call: "
        "native portable ratio"
    )
    for R, E, S in SIZES:
        print(_row(R, E, S))


if __name__ == "__main__":
    app.run(main)
