"""Below how many tokens per rank does balancing stop paying? Balanced at capacity factor 1.05
against plain EP (dropless, and at 1.05), busiest rank's step, on pinned rank processes.

    python -m experiments.bench.breakeven                 # the full sweep (tens of minutes)
    python -m experiments.bench.breakeven --quick         # a smoke test: 2 sizes, 2 skews
    python -m experiments.bench.breakeven --modes=prefill --tokens=64,512,4096 --skews=0,3

For every mode (train: forward+backward; prefill: forward), router skew (bias toward the hot
experts, `experiments.lab.skewed_layer`'s skew; 0: none) and tokens per rank, the three layers are
compiled and timed interleaved (medians of ``--repeats`` rounds) on ``--pinned_ranks`` processes,
each pinned to a core of its own with one CPU device, so that the wall clock is the busiest rank's
(a calibration line says how close). The layer shape is the layer benchmarks' flags
(`cli.define_layer_flags`; default here D=128, F=512, E=8, top-2, all hot experts on rank 0).
Prints the table and the break-even per mode and skew (`breakeven_report`), writes ``--json_out``
and the plot ``--plot`` (default: runs/breakeven/;
``--json_out=docs/breakeven.json --plot=docs/breakeven.png`` replaces the committed ones that
docs/serving.md shows).
Needs a quiet machine: other load on the cores changes the clock.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import numpy as np
from absl import flags
from jax.sharding import AxisType

import ultraep_jax as uep
from experiments.bench import breakeven_report
from experiments.lab import cli, skewed_layer
from experiments.lab.concurrency import concurrency_check, concurrency_line
from experiments.lab.output_files import write_json
from experiments.lab.pinned_ranks import keep_freed_memory, launch_pinned_ranks, start_distributed
from experiments.lab.program import fail, run_main

_LAYER, _BALANCER = cli.define_layer_flags(
    pinned_ranks=2, swept=("tokens_per_device", "skew"), **skewed_layer.BREAKEVEN_SHAPE
)
cli.define_sweep_flags([2**i for i in range(6, 14)], skews=True)
_RUN = cli.run_folder("breakeven")
_PLOT = flags.DEFINE_string(
    "plot",
    f"{_RUN}/breakeven.png",
    "Write the plot here (empty: no plot; docs/breakeven.png: the committed one).",
)
cli.define_json_out()
cli.define_rank_flags()
flags.FLAGS.set_default("json_out", f"{_RUN}/breakeven.json")

FLAGS = flags.FLAGS
LAYERS = {
    "balanced": "balanced_ms",
    "dropless": "dropless_ms",
    "capped": "capped_ms",
    "no_replica": "no_replica_ms",
}
# A tolerance no load exceeds: with dropless buffers (nothing to save from the capacity) the
# balanced layer's program runs plans with no replica, to set against plain dropless.
NO_REPLICA_EPS = 1e9


def sweep() -> tuple[list[int], list[float], list[str], int]:
    """(tokens per rank, skews, modes, repeats) of the flags (``--quick``: its small sweep).

    Raises:
      ValueError: one line naming a bad value.
    """
    tokens, modes, repeats = skewed_layer.sweep(
        FLAGS.tokens, FLAGS.modes, FLAGS.repeats, FLAGS.seq_len, FLAGS.quick
    )
    if FLAGS.quick:
        return tokens, list(skewed_layer.QUICK_SKEWS), modes, repeats
    try:
        skews = [float(s) for s in FLAGS.skews]
    except ValueError as err:
        raise ValueError(f"--skews must be numbers: {err}") from None
    return tokens, skews, modes, repeats


def measure(mesh, layer: skewed_layer.SkewedLayer, mode: str, repeats: int) -> dict:
    """One point: the four layers compiled and timed interleaved (`skewed_layer`)."""
    R = mesh.size
    rng = np.random.default_rng(layer.seed)
    x, router = skewed_layer.skewed_inputs(mesh, layer, rng, one_rank=True)
    # Always balance, whatever the layer's default fallback threshold: this finds it.
    balancer = uep.BalancerConfig(
        num_experts=layer.num_experts, ep_size=R, min_tokens_per_rank=0, **_BALANCER()
    )
    never = dataclasses.replace(balancer, balance_eps=NO_REPLICA_EPS)
    cf = FLAGS.capacity_factor
    layers = {
        "balanced": skewed_layer.build(mesh, layer, balancer, router, cf),
        "dropless": skewed_layer.build(mesh, layer, None, router, None),
        "capped": skewed_layer.build(mesh, layer, None, router, cf),
        "no_replica": skewed_layer.build(mesh, layer, never, router, None),
    }
    runs = {
        name: skewed_layer.compile_step(moe, x, mode, layer.tokens_per_device)
        for name, moe in layers.items()
    }
    skewed_layer.time_interleaved(runs, repeats)
    point = {"mode": mode, "skew": layer.skew, "tokens": layer.tokens_per_device}
    point.update({key: runs[name]["step_ms"] for name, key in LAYERS.items()})
    point["capped_dropped"] = runs["capped"]["dropped"]
    point["imbalance_before"] = runs["balanced"]["imbalance_before"]
    point["imbalance_after"] = runs["balanced"]["imbalance_after"]
    point["replicas"] = runs["balanced"]["replicas"]
    point["no_replica_replicas"] = runs["no_replica"]["replicas"]
    point["minor_faults"] = {name: runs[name]["minor_faults"] for name in LAYERS}
    return point


def run() -> dict:
    """Every point of the sweep on this run's devices (every process runs it)."""
    tokens, skews, modes, repeats = sweep()
    mesh = jax.make_mesh((jax.device_count(),), ("expert",), axis_types=(AxisType.Auto,))
    base = skewed_layer.SkewedLayer(**_LAYER())
    skewed_layer.check_shape(base, mesh.size, one_rank=bool(FLAGS.pinned_ranks))
    rows = FLAGS.top_k * max(tokens)
    calibration = concurrency_check(rows, FLAGS.d_model, FLAGS.d_ff)
    if jax.process_index() == 0:
        print(concurrency_line(calibration), flush=True)
    points = []
    for mode in modes:
        for skew in skews:
            for t in tokens:
                layer = dataclasses.replace(base, tokens_per_device=t, skew=skew)
                points.append(measure(mesh, layer, mode, repeats))
                if jax.process_index() == 0:
                    p = points[-1]
                    print(
                        f"{mode} skew {breakeven_report.skew_text(skew)} {t} tokens/rank: "
                        f"balanced {p['balanced_ms']:.3f} ms, dropless {p['dropless_ms']:.3f}, "
                        f"plain@{FLAGS.capacity_factor:g} {p['capped_ms']:.3f}",
                        flush=True,
                    )
    return {
        "config": {
            "ep_size": mesh.size,
            "pinned_ranks": FLAGS.pinned_ranks,
            "device": str(jax.devices()[0].device_kind),
            "d_model": FLAGS.d_model,
            "d_ff": FLAGS.d_ff,
            "num_experts": FLAGS.num_experts,
            "top_k": FLAGS.top_k,
            "hot_experts": FLAGS.hot_experts,
            "capacity_factor": FLAGS.capacity_factor,
            "repeats": repeats,
            "quick": FLAGS.quick,
            **_BALANCER(),
        },
        "calibration": calibration,
        "points": points,
    }


def main(argv):
    """Starts the pinned rank processes, or (as one of them) measures; the first prints the table
    and writes the JSON and the plot."""
    if len(argv) > 1:
        fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if not FLAGS.pinned_ranks:
        fail("--pinned_ranks must be >= 2: the break-even is the busiest rank's clock")
    try:
        sweep()
    except ValueError as err:
        fail(err)
    if FLAGS.num_processes == 1:
        try:
            code = launch_pinned_ranks(
                FLAGS.pinned_ranks, "experiments.bench.breakeven", sys.argv[1:]
            )
        except ValueError as err:
            fail(err)
        sys.exit(code)
    keep_freed_memory()  # a pinned rank: time the kernels, not the page faults
    try:
        start_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
        res = run()
    except ValueError as err:
        fail(err)
    if jax.process_index() == 0:
        print(breakeven_report.table(res["points"]), flush=True)
        write_json(FLAGS.json_out, res)
        if _PLOT.value:
            cfg = res["config"]
            title = (
                f"EP={cfg['ep_size']} pinned ranks, D={cfg['d_model']} F={cfg['d_ff']} "
                f"E={cfg['num_experts']} top-{cfg['top_k']}"
            )
            breakeven_report.plot(res["points"], _PLOT.value, title)
        print(f"wrote {FLAGS.json_out}" + (f" and {_PLOT.value}" if _PLOT.value else ""))


if __name__ == "__main__":
    run_main(main)
