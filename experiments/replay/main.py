"""Per-rank replay: expert parallelism at any EP size, each rank's work timed one rank at a time
on one device with the layer's kernels.

        python -m experiments.replay                       # CPU, scaled shapes, minutes
        python -m experiments.replay --workloads=deepseek-r1 --mode=train --matrices=2
        python -m experiments.replay --transfer_model=deepseek_v3   # + the layer at real ratios
        python -m experiments.replay --shape=deepseek_v3   # real shapes, for a GPU

For each load matrix (layers of the real traces, or generated rank-level Zipf), each EP size and
each policy (none, eplb_periodic, eplb_exact, ultraep at balance_eps 0.01, exact mode at 0), the
replay computes every rank's received rows per local group, its replica slots and its exchanges
exactly as the layer does (`replay.work`), then times each rank's own work with the layer's code
and kernels (`replay.timing`): the planner call, the dispatch bookkeeping and gathers, and the
experts (forward and backward for ``--mode=train``, forward only for ``--mode=prefill``, which
serves more tokens). Measured: those three, per rank; the step's time for each is the busiest
rank's. Modelled: the token all-to-alls and the replica weight transfer (and the gradients'
return in training) from their exact bytes per rank at ``--link_gbps`` per direction, charged by
the step model's one rule (`experiments.lab.stepmodel.layer`: the transfer beside the all-to-all of
its pass, what outlasts it exposed; `replay.cell`). The force-balanced ideal is plain EP with
every rank at the mean rows (same kernel, E_m groups, the layer's buffer), timed the same way.

What the headline measures is the busiest rank's expert kernel time at the replayed shape against
the ideal's: at the CPU shape (D=128, F=64) an expert's weights are 98 KB against 88 MB for a bf16
DeepSeek-V3 expert, so the exchanges are far smaller relative to compute than on real hardware.
It is not an end-to-end throughput. ``--transfer_model`` also charges each layer at a real
model's bytes against its compute on a stated GPU (`replay.real_ratio`). ``--calibration_out``
writes the experts' fitted cost per row and per group with its provenance
(`experiments.lab.stepmodel.calibration`), for ``python -m experiments.sim --calibration``.
"""

from __future__ import annotations

import os

import jax
from absl import app, flags

from experiments.lab import cli
from experiments.lab.loads import traces
from experiments.lab.output_files import write_json
from experiments.lab.pinned_ranks import keep_freed_memory
from experiments.lab.stepmodel import calibration as stepcal
from experiments.lab.stepmodel import shapes
from experiments.replay import cell as replay_cell
from experiments.replay import real_ratio, report
from experiments.replay import timing as replay_timing

#: Layer shape presets: the anchor's real shape (a GPU), and one scaled so that the default
#: replay runs on a 2-core CPU in minutes: rows per rank are the anchor's pairs per rank divided
#: by 4 (train) and 2 (prefill), D and F by 56 and 32 (a tiled kernel's cost per group is a
#: fraction of a group's rows, so rows per group matter more than width).
_ANCHOR = shapes.ANCHOR
_SHAPES = {
    "cpu": {
        "d_model": 128,
        "d_ff": 64,
        "dtype": "float32",
        "pairs": _ANCHOR.pairs_per_rank // 4,
        "prefill_pairs": _ANCHOR.pairs_per_rank // 2,
    },
    "deepseek_v3": {
        "d_model": _ANCHOR.shape.hidden,
        "d_ff": _ANCHOR.shape.expert_ffn,
        "dtype": "bfloat16",
        "pairs": _ANCHOR.pairs_per_rank,
        "prefill_pairs": _ANCHOR.pairs_per_rank,
    },
}
#: Target setups of ``--transfer_model``.
_TARGETS = {"deepseek_v3": _ANCHOR}

_WORKLOADS = flags.DEFINE_list(
    "workloads",
    list(traces.TRACE_NAMES),
    f"Traces ({', '.join(traces.TRACE_NAMES)}) or zipfX (rank-level Zipf at initial max/mean X, "
    "--num_experts and --top_k).",
)
_EP = flags.DEFINE_list(
    "ep_sizes",
    ["32", "64"],
    "EP sizes; a workload whose experts an EP size does not divide runs at its largest divisor "
    "below it (Qwen1.5-MoE's 60 experts: 30 and 60).",
)
_MATRICES = flags.DEFINE_integer(
    "matrices", 2, "Load matrices per workload (trace layers drawn at random, seeded)."
)
_HISTORY = flags.DEFINE_integer(
    "history",
    4,
    "Other matrices of the same layer that eplb_periodic plans on: for DeepSeek-R1 (one matrix "
    "per layer and serving run) that layer in other serving runs, for Qwen1.5-MoE and Switch the "
    "iterations before it (cyclic); for zipfX, matrices of other seeds.",
)
_EXPERTS = flags.DEFINE_enum(
    "experts",
    "timed",
    ["timed", "rows"],
    "timed: run every rank's experts (the measurement); rows: time nothing, each rank's expert "
    "time its rows over the mean rows (a model without the kernel's per-group costs or noise, "
    "for --transfer_model's modelled terms on a machine too busy to time on).",
)
_MODE = flags.DEFINE_enum(
    "mode", "both", ["train", "prefill", "both"], "Forward+backward, forward only, or both."
)
_SHAPE = flags.DEFINE_enum(
    "shape", "cpu", list(_SHAPES), "Layer shape preset (cpu: scaled; deepseek_v3: real)."
)
_D = flags.DEFINE_integer("d_model", None, "Token width D (default: the preset's).")
_F = flags.DEFINE_integer("d_ff", None, "Expert hidden width F (default: the preset's).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Dtype (default: the preset's).")
_PAIRS = flags.DEFINE_integer(
    "pairs_per_rank", None, "Training (token, choice) pairs per rank (default: the preset's)."
)
_PREFILL_PAIRS = flags.DEFINE_integer(
    "prefill_pairs_per_rank", None, "Prefill pairs per rank (default: the preset's)."
)
_KERNEL = flags.DEFINE_string(
    "kernel", "auto", "Expert kernel (ultraep_jax.config.execution.KERNELS)."
)
_E = flags.DEFINE_integer("num_experts", 256, "Experts of the zipfX workloads.")
_K = flags.DEFINE_integer("top_k", 8, "Top-k of the zipfX workloads (traces use their model's).")
_BALANCER = cli.define_balancer_flags(
    min_tokens_per_replica=None,
    helps={
        "min_tokens_per_replica": "Least tokens per replica (default: 1/64 of the pairs per rank, "
        "UltraEP's 1024 of 65536)."
    },
)
_CF = cli.define_capped_capacity_factor(
    1.05,
    "The layer's receive buffer, as a multiple of the pairs per rank.",
    "it would give every replayed rank the worst-case buffer, which no balanced layer uses",
)
_LINK = flags.DEFINE_float(
    "link_gbps",
    shapes.CLUSTERS["hgx-h100"].ib_gbps,
    "Modelled link bandwidth per rank and direction, GB/s (default: one 400 Gb/s "
    "InfiniBand NDR port per GPU, as in a DGX H100).",
)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed rounds per rank (medians).")
_REFINE = flags.DEFINE_integer(
    "refine", 3, "Costliest ranks per policy timed again, up to --refine_rounds rounds each."
)
_REFINE_ROUNDS = flags.DEFINE_integer(
    "refine_rounds",
    24,
    "Rounds the --refine costliest ranks of each policy get in all (the busiest rank is a "
    "maximum over noisy estimates: more rounds shrink what noise adds to it).",
)
_BOOK_RANKS = flags.DEFINE_integer(
    "bookkeeping_ranks", 4, "Ranks per policy whose bookkeeping is timed (those receiving most)."
)
_CORE = flags.DEFINE_integer("cpu_core", 0, "Pin the process to this CPU core (-1: no pinning).")
_SEED = flags.DEFINE_integer(
    "seed", 0, "Seed of the trace layers drawn, their splits and the pairs' order."
)
_TRACES = cli.define_traces_dir()
_JSON = cli.define_json_out()
_TRANSFER_MODEL = flags.DEFINE_enum(
    "transfer_model",
    None,
    list(_TARGETS),
    "Also charge each layer at this model's bytes against its compute on --gpu "
    "(experiments.replay.real_ratio): experts from the measured ratio to the ideal, exchanges "
    "and relayed replica copies modelled; prints the exposed transfer as a share of the step.",
)
_GPU = flags.DEFINE_string(
    "gpu", stepcal.GPU_GMM, "The GPU --gpu_tflops describes (printed with the figures)."
)
_GPU_TFLOPS = flags.DEFINE_float(
    "gpu_tflops",
    stepcal.GPU_GMM_TFLOPS,
    f"Grouped-matmul rate of --gpu in TFLOP/s ({stepcal.GPU_GMM_TFLOPS:g}: "
    "stepmodel.calibration.GPU_GMM_TFLOPS, docs/gpu.md).",
)
_CALIBRATION = flags.DEFINE_string(
    "calibration_out",
    None,
    "Write the experts' per-row and per-group cost here (for "
    "python -m experiments.sim --calibration).",
)

for _name in ("matrices", "repeats"):
    flags.register_validator(_name, lambda v: v >= 1, "must be >= 1")
flags.register_validator("history", lambda v: v >= 0, "must be >= 0")
flags.register_validator("refine", lambda v: v >= 0, "must be >= 0")
flags.register_validator("refine_rounds", lambda v: v >= 1, "must be >= 1")
flags.register_validator("bookkeeping_ranks", lambda v: v >= 1, "must be >= 1")
flags.register_validator("link_gbps", lambda v: v > 0, "must be > 0")
flags.register_validator("gpu_tflops", lambda v: v > 0, "must be > 0")
flags.register_validator("capacity_factor", lambda v: v >= 1, "must be >= 1")
flags.register_validator(
    "ep_sizes", lambda v: all(s.isdigit() and int(s) >= 2 for s in v), "each must be an int >= 2"
)


def _workload_ok(name: str) -> bool:
    if name in traces.TRACE_NAMES:
        return True
    try:
        return name.startswith("zipf") and float(name[4:]) >= 1
    except ValueError:
        return False


flags.register_validator(
    "workloads",
    lambda v: all(map(_workload_ok, v)),
    f"each must be one of {traces.TRACE_NAMES} or zipfX",
)


def _settings() -> replay_cell.Settings:
    """Every cell's settings, from the flags (``--shape``'s preset where a flag is unset)."""
    preset = _SHAPES[_SHAPE.value]
    shape = replay_timing.Shape(
        d_model=_D.value or preset["d_model"],
        d_ff=_F.value or preset["d_ff"],
        dtype=_DTYPE.value or preset["dtype"],
        kernel=_KERNEL.value,
    )
    return replay_cell.Settings(
        shape=shape,
        pairs={
            "train": _PAIRS.value or preset["pairs"],
            "prefill": _PREFILL_PAIRS.value or preset["prefill_pairs"],
        },
        slots=_BALANCER()["slots_per_rank"],
        floor=_BALANCER()["min_tokens_per_replica"],
        eps=_BALANCER()["balance_eps"],
        capacity_factor=_CF.value,
        link_gbps=_LINK.value,
        repeats=_REPEATS.value,
        refine=_REFINE.value,
        refine_rounds=_REFINE_ROUNDS.value,
        bookkeeping_ranks=_BOOK_RANKS.value,
        seed=_SEED.value,
        zipf_experts=_E.value,
        zipf_top_k=_K.value,
        target=(
            real_ratio.TargetLayer.of(
                _TARGETS[_TRANSFER_MODEL.value], _GPU.value, _GPU_TFLOPS.value, _LINK.value
            )
            if _TRANSFER_MODEL.value
            else None
        ),
        timed=_EXPERTS.value == "timed",
    )


def _clock_name(timed: bool) -> str:
    """What the expert times are measured with (or that nothing is timed)."""
    if not timed:
        return "none: expert time = rows / mean rows (--experts=rows), nothing timed"
    on_cpu = jax.default_backend() == "cpu"
    if on_cpu and _CORE.value >= 0:
        return f"process CPU time, pinned to core {_CORE.value}"
    return "process CPU time" if on_cpu else "wall time"


def _run_cells(settings: replay_cell.Settings, modes) -> list[dict]:
    """Replays every (workload, EP size, mode) cell, printing each cell's table."""
    cells = []
    for workload in _WORKLOADS.value:
        for ep_flag in dict.fromkeys(int(s) for s in _EP.value):
            ep = replay_cell.ep_for(replay_cell.num_experts_of(workload, settings), ep_flag)
            for mode in modes:
                print(f"{workload} EP{ep} {mode}:", flush=True)
                samples = replay_cell.samples_for(
                    workload, ep, mode, _MATRICES.value, _HISTORY.value, settings, _TRACES.value
                )
                cell = replay_cell.replay_cell(workload, ep, mode, samples, settings)
                cells.append(cell)
                print("\n".join(report.cell_table(cell)), flush=True)
    return cells


def main(argv):
    """Replays every (workload, EP size, mode) cell and prints its table and the headline."""
    del argv
    if _CORE.value >= 0:
        os.sched_setaffinity(0, {_CORE.value})  # before JAX starts its threads
    keep_freed_memory()
    settings = _settings()
    shape = settings.shape
    if not settings.timed and _CALIBRATION.value:
        raise app.UsageError("--calibration_out needs --experts=timed (it fits timed ranks)")
    modes = replay_timing.MODES if _MODE.value == "both" else (_MODE.value,)
    clock_name = _clock_name(settings.timed)
    print(
        f"Per-rank replay on {jax.devices()[0].device_kind} ({jax.default_backend()}), clock: "
        f"{clock_name}; shape D={shape.d_model} F={shape.d_ff} {shape.dtype}, kernel "
        f"{shape.kernel}; pairs per rank {settings.pairs}; {settings.slots} slots per rank, "
        f"capacity factor {settings.capacity_factor}; modelled links {settings.link_gbps:g} GB/s "
        f"per rank and direction",
        flush=True,
    )
    cells = _run_cells(settings, modes)
    print("\n* modelled from exact bytes per rank (not timed)\n")
    print("\n".join(report.headline(cells)))
    if _CALIBRATION.value:
        write_json(_CALIBRATION.value, report.calibration(cells, settings, clock_name))
        print(f"calibration written to {_CALIBRATION.value}")
    write_json(_JSON.value, cells)
