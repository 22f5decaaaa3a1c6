r"""MoE layer benchmark: the cost of balancing and its win, on CPU devices.

        python -m experiments.bench.moe                      # 8 simulated devices, one process
        python -m experiments.bench.moe --pinned_ranks=2     # EP=2 as two pinned processes
        python -m experiments.bench.moe --pinned_ranks=2 --d_model=128 --d_ff=512 \
            --num_experts=8 --tokens_per_device=2048 --mode=prefill --json_out=moe.json

On mesh (R,) "expert" with a skewed router (a few hot experts take most tokens), five layers:
plain EP and balanced, each with dropless worst-case receive buffers (R x the pairs a rank routes)
and with buffers of ``--capacity_factor`` x those pairs, and the force-balanced ideal in the
latter (the router's pairs spread evenly over the experts, no planner, no replicas: what a free,
perfect balancer would cost, so ideal / plain dropless is the floor of balanced / plain
dropless on this machine). For each: compile time, step time
(``--mode=train``: forward+backward, the gradient w.r.t. x and every parameter; ``prefill``:
forward only; the five compiled steps run interleaved, ``--repeats`` rounds, medians, so that a
busy machine slows them alike), buffer rows, dropped pairs, per-rank load before and after
balancing, and the ratios between them.

Two ways to run the ranks. By default 8 simulated devices in one process share the host's cores,
so step times measure the total work of all ranks, not the busiest one. ``--pinned_ranks=N``
starts N processes (one command), one CPU device each, each pinned to a core of its own and
joined by gloo collectives: there the wall clock is the busiest rank's, as on real hardware, and
a calibration line (the ranks with equal work at once / one rank alone) says how close it is.
The hot experts sit on ranks 0, 1, ... (one each) with simulated devices, and all on rank 0 with
pinned ranks (two ranks with one hot expert each would be balanced already).
"""

from __future__ import annotations

from experiments.lab.concurrency import concurrency_check, concurrency_line
from experiments.lab.devices import force_cpu_devices
from experiments.lab.output_files import write_json
from experiments.lab.pinned_ranks import keep_freed_memory, launch_pinned_ranks, start_distributed
from experiments.lab.program import fail, run_main

force_cpu_devices(8, cpu_only=True)  # before JAX starts a backend (pinned ranks: 1 each)

import sys

import jax
import numpy as np
from absl import flags
from jax.sharding import AxisType

import ultraep_jax as uep
from experiments.lab import cli, skewed_layer

_LAYER, _BALANCER = cli.define_layer_flags(pinned_ranks=0)
_MODE = flags.DEFINE_enum(
    "mode", "train", list(skewed_layer.MODES), "train: forward+backward; prefill: forward only."
)
_JSON = cli.define_json_out()
_VERBOSE_RANKS = cli.define_verbose_ranks()
_MALLOC = flags.DEFINE_enum(
    "malloc",
    "auto",
    ["auto", "keep", "system"],
    "keep: glibc keeps freed memory (keep_freed_memory) so that XLA:CPU's per-call "
    "buffers do not page-fault in again on every call; system: glibc's defaults; auto: keep in "
    "pinned rank processes, system otherwise.",
)
_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID = cli.define_rank_flags()
FLAGS = flags.FLAGS


NAMES = {
    "plain_dropless": "plain EP, dropless",
    "plain_capped": "plain EP, capped",
    "balanced_capped": "balanced, capped",
    "balanced_dropless": "balanced, dropless",
    "ideal_capped": "ideal, capped",
}


def _print_report(res: dict) -> None:
    """The readable tables."""
    cfg, runs = res["config"], res["runs"]
    ranks = (
        f"{cfg['ep_size']} pinned processes x 1 {cfg['device']}"
        if cfg["pinned_ranks"]
        else f"{cfg['devices']} simulated {cfg['device']} devices in one process"
    )
    print(
        f"MoE layer, {cfg['mode']}, EP={cfg['ep_size']} on {ranks}: D={cfg['d_model']} "
        f"F={cfg['d_ff']} E={cfg['num_experts']} top-{cfg['top_k']} S={cfg['slots_per_rank']} "
        f"tokens/device={cfg['tokens_per_device']}, capped = capacity factor "
        f"{cfg['capacity_factor']}, skewed router ({cfg['hot_experts']} hot experts, bias "
        f"{cfg['skew']}), {cfg['repeats']} interleaved rounds"
    )
    if "calibration" in res:
        print(concurrency_line(res["calibration"]))
    print(
        f"\n{'':>20} {'buffer rows':>11} {'dropped':>8} {'compile s':>10} {'step ms':>9} "
        f"{'(min)':>8} {'temp MiB':>9} {'faults/step':>12}"
    )
    for key, name in NAMES.items():
        r = runs[key]
        temp = "n/a" if r["temp_mib"] is None else f"{r['temp_mib']:.2f}"
        print(
            f"{name:>20} {r['buffer_rows']:11d} {r['dropped']:8d} {r['compile_s']:10.2f} "
            f"{r['step_ms']:9.2f} {r['step_ms_min']:8.2f} {temp:>9} {r['minor_faults']:12.0f}"
        )
    print(
        f"(temp MiB: XLA:CPU's block of temporaries, allocated on every call; faults/step: minor "
        f"page faults of this process per step; glibc malloc: {cfg['malloc']})"
    )
    print("\nStep-time ratios (medians of the same run):")
    for key, (a, b, what) in RATIOS.items():
        print(f"  {NAMES[a]:>20} / {NAMES[b]:<20} {res['ratios'][key]:6.3f}   {what}")
    bal = runs["balanced_dropless"]
    R = len(bal["rank_load_before"])
    print(f"\nPer-rank load ((token, choice) pairs), skewed router:\n{'rank':>8}", end="")
    print("".join(f"{r:>6}" for r in range(R)) + f"{'max/mean':>10}")
    print(f"{'before':>8}" + "".join(f"{v:6d}" for v in bal["rank_load_before"]), end="")
    print(f"{bal['imbalance_before']:10.3f}")
    print(f"{'after':>8}" + "".join(f"{v:6d}" for v in bal["rank_load_after"]), end="")
    print(f"{bal['imbalance_after']:10.3f}   ({bal['replicas']} replicas)")


RATIOS = {
    "overhead_dropless": (
        "balanced_dropless",
        "plain_dropless",
        "same buffers and total work (pinned ranks: the busiest rank differs)",
    ),
    "capped_vs_plain_dropless": (
        "balanced_capped",
        "plain_dropless",
        "balanced in a small buffer vs plain EP that drops nothing",
    ),
    "capped_vs_plain_capped": (
        "balanced_capped",
        "plain_capped",
        "same buffer; plain EP drops pairs (less work)",
    ),
    "capped_vs_ideal": (
        "balanced_capped",
        "ideal_capped",
        "same buffer; the ideal's even routing, no planner or replicas",
    ),
    "ideal_vs_plain_dropless": (
        "ideal_capped",
        "plain_dropless",
        "the floor of balanced / plain dropless: a free, perfect balancer",
    ),
}


def run(pinned: bool) -> dict:
    """Builds, compiles and times the five layers on every device of this run; the results."""
    # Auto axes: the layer splits the work with shard_map itself.
    mesh = jax.make_mesh((jax.device_count(),), ("expert",), axis_types=(AxisType.Auto,))
    R = mesh.size
    layer = skewed_layer.SkewedLayer(**_LAYER())
    skewed_layer.check_shape(layer, R, one_rank=bool(FLAGS.pinned_ranks))
    calibration = None
    if pinned:
        rows = layer.top_k * layer.tokens_per_device
        calibration = concurrency_check(rows, layer.d_model, layer.d_ff)
    rng = np.random.default_rng(layer.seed)
    x, router = skewed_layer.skewed_inputs(mesh, layer, rng, one_rank=pinned)
    # Always balance (no fallback below the default threshold): this measures balancing.
    balancer = uep.BalancerConfig(
        num_experts=layer.num_experts, ep_size=R, min_tokens_per_rank=0, **_BALANCER()
    )
    cf = FLAGS.capacity_factor
    layers = {
        "plain_dropless": skewed_layer.build(mesh, layer, None, router, None),
        "plain_capped": skewed_layer.build(mesh, layer, None, router, cf),
        "balanced_capped": skewed_layer.build(mesh, layer, balancer, router, cf),
        "balanced_dropless": skewed_layer.build(mesh, layer, balancer, router, None),
        # The force-balanced ideal: the router's pairs spread evenly, no balancing cost.
        "ideal_capped": skewed_layer.build(mesh, layer, None, router, cf, force_balanced=True),
    }
    runs = {
        name: skewed_layer.compile_step(moe, x, _MODE.value, layer.tokens_per_device)
        for name, moe in layers.items()
    }
    skewed_layer.time_interleaved(runs, FLAGS.repeats)
    for r in runs.values():
        del r["run"]
    res = {
        "config": {
            "device": str(jax.devices()[0].device_kind),
            "devices": jax.device_count(),
            "ep_size": R,
            "pinned_ranks": FLAGS.pinned_ranks,
            "mode": _MODE.value,
            **layer.shape,
            **_BALANCER(),
            "tokens_per_device": layer.tokens_per_device,
            "capacity_factor": cf,
            "hot_experts": layer.hot_experts,
            "skew": layer.skew,
            "repeats": FLAGS.repeats,
            "malloc": _malloc_mode(),
        },
        "runs": runs,
        "ratios": {
            key: runs[a]["step_ms"] / runs[b]["step_ms"] for key, (a, b, _) in RATIOS.items()
        },
    }
    if calibration is not None:
        res["calibration"] = calibration
    return res


def _malloc_mode() -> str:
    """How glibc's malloc was set up in this process: "keep" or "system"."""
    keep = _MALLOC.value == "keep" or (_MALLOC.value == "auto" and _NUM_PROCESSES.value > 1)
    return "keep" if keep else "system"


def main(argv):
    """Starts the pinned rank processes (``--pinned_ranks``), or runs the benchmark in this
    process (one of them) and, on the first, prints the tables and writes ``--json_out``."""
    pinned = FLAGS.pinned_ranks
    if pinned and _NUM_PROCESSES.value == 1:
        try:
            code = launch_pinned_ranks(
                pinned, "experiments.bench.moe", sys.argv[1:], _VERBOSE_RANKS.value
            )
        except ValueError as err:
            fail(err)
        sys.exit(code)
    if _MALLOC.value == "keep" or (_MALLOC.value == "auto" and _NUM_PROCESSES.value > 1):
        keep_freed_memory()  # time the kernels, not the page faults
    try:
        start_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
        if pinned and jax.device_count() != pinned:
            raise ValueError(f"--pinned_ranks={pinned} found {jax.device_count()} devices")
        res = run(pinned=bool(pinned))
    except ValueError as err:
        fail(err)
    if jax.process_index() == 0:
        _print_report(res)
        write_json(_JSON.value, res)


if __name__ == "__main__":
    run_main(main)
