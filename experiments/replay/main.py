"""Per-rank replay: expert parallelism at any EP size, each rank's work timed one rank at a time
on one device with the layer's kernels.

        python -m experiments.replay                       # CPU, scaled shapes, minutes
        python -m experiments.replay --workloads=deepseek-r1 --mode=train --matrices=2
        python -m experiments.replay --transfer_model=deepseek_v3   # + the layer at real ratios
        python -m experiments.replay --shape=deepseek_v3   # real shapes, for a GPU

For each load matrix (layers of the real traces, or generated rank-level Zipf), each EP size and
each policy (none, eplb_periodic, eplb_exact, ultraep at balance_eps 0.01, exact mode at 0), the
replay computes every rank's received rows per local group, its replica slots and its exchanges
exactly as the layer does (`replay_work`), then times each rank's own work with the layer's code
and kernels (`replay_timing`): the planner call, the dispatch bookkeeping and gathers, and the
experts (forward and backward for ``--mode=train``, forward only for ``--mode=prefill``, which
serves more tokens). Measured: those three, per rank; the step's time for each is the busiest
rank's. Modelled: the token all-to-alls (dispatch and combine, and their transposes in training)
and the replica weight transfer (and the gradients' return in training), from their exact bytes
per rank at ``--link_gbps`` per direction. The force-balanced ideal is plain EP with every rank at
the mean rows (same kernel, E_m groups, the layer's buffer), timed the same way.

What the headline measures is the busiest rank's expert kernel time at the replayed shape against
the ideal's: at the CPU shape (D=128, F=64) an expert's weights are 98 KB against 88 MB for a bf16
DeepSeek-V3 expert, so the exchanges modelled at that shape's bytes are far smaller relative to
compute than on real hardware, and "step" adds only those. It is not an end-to-end throughput.
``--transfer_model`` also charges each layer at a real model's bytes against its compute on a
stated GPU (`experiments.replay.real_ratio`) and prints the exposed transfer as a share of the
step.

``--calibration_out`` writes the experts' cost per row and per group (a least-squares fit over
every timed rank, constrained to non-negative costs) with its provenance, for
``python -m experiments.sim --calibration``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import jax
import numpy as np
from absl import app, flags

import ultraep_jax as uep
from experiments import cli, common
from experiments.loads import traces, workloads
from experiments.replay import real_ratio
from experiments.replay import timing as replay_timing
from experiments.replay import work as replay_work

_SHAPES = {
    # Scaled so that the default replay runs on a 2-core CPU in minutes: rows per rank are
    # UltraEP's 8192 tokens x top-8 divided by 4 (train) and 2 (prefill), D and F by 56 and 32
    # (a tiled kernel's cost per group is a fraction of a group's rows, so rows per group matter
    # more than width).
    "cpu": {"d_model": 128, "d_ff": 64, "dtype": "float32", "pairs": 16384, "prefill_pairs": 32768},
    # DeepSeek-V3: D=7168, expert F=2048, 8192 tokens per rank x top-8, bf16 (for a GPU).
    "deepseek_v3": {
        "d_model": 7168,
        "d_ff": 2048,
        "dtype": "bfloat16",
        "pairs": 65536,
        "prefill_pairs": 65536,
    },
}
#: Target models of ``--transfer_model`` (``real_ratio.TargetModel`` without the GPU and link).
_TARGETS = {
    "deepseek_v3": {
        "d_model": 7168,
        "d_ff": 2048,
        "itemsize": 2,
        "pairs_per_rank": {"train": 65536, "prefill": 65536},
    },
}

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
_KERNEL = flags.DEFINE_string("kernel", "auto", "Expert kernel (ultraep_jax.experts.KERNELS).")
_E = flags.DEFINE_integer("num_experts", 256, "Experts of the zipfX workloads.")
_K = flags.DEFINE_integer("top_k", 8, "Top-k of the zipfX workloads (traces use their model's).")
_BALANCER = cli.define_balancer_flags(
    min_tokens_per_replica=None,
    helps={
        "min_tokens_per_replica": "Least tokens per replica (default: 1/64 of the pairs per rank, "
        "UltraEP's 1024 of 65536)."
    },
)
_CF = flags.DEFINE_float(
    "capacity_factor", 1.05, "The layer's receive buffer, x the pairs per rank."
)
_LINK = flags.DEFINE_float(
    "link_gbps",
    50.0,
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
    "gpu",
    "H100 SXM, JAX's Mosaic GPU grouped matmul, bf16",
    "The GPU --gpu_tflops describes (printed with the figures).",
)
_GPU_TFLOPS = flags.DEFINE_float(
    "gpu_tflops",
    550.0,
    "Grouped-matmul rate of --gpu in TFLOP/s (550: the Mosaic GPU kernel measured on an H100, "
    "forward 549-566, docs/gpu.md).",
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


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every cell of one replay shares (from the flags)."""

    shape: replay_timing.Shape
    pairs: dict  # mode -> pairs per rank
    slots: int
    floor: int | None
    eps: float
    capacity_factor: float
    link_gbps: float
    repeats: int
    refine: int
    refine_rounds: int
    bookkeeping_ranks: int
    seed: int
    target: real_ratio.TargetModel | None = None
    timed: bool = True

    def balancer(self, ep: int, num_experts: int, mode: str) -> uep.BalancerConfig:
        """ultraep's `BalancerConfig` at this EP size and mode (its floor scales with the pairs)."""
        floor = self.floor if self.floor is not None else max(1, self.pairs[mode] // 64)
        return uep.BalancerConfig(num_experts, ep, self.slots, floor, self.eps)


def ep_for(num_experts: int, ep: int) -> int:
    """``ep``, or the largest divisor of ``num_experts`` below it."""
    return max(d for d in range(1, ep + 1) if num_experts % d == 0)


def samples_for(
    workload: str, ep: int, pairs: int, count: int, history: int, seed: int, traces_dir
):
    """The `replay_work.Sample` list of one workload at one EP size."""
    if workload in traces.TRACE_NAMES:
        return replay_work.trace_samples(workload, ep, pairs, count, history, seed, traces_dir)
    top_k = _K.value
    return replay_work.zipf_samples(
        float(workload[4:]), ep, _E.value, top_k, pairs, count, history, seed
    )


def num_experts_of(workload: str) -> int:
    """E of a workload."""
    return traces.TRACE_NUM_EXPERTS.get(workload, _E.value)


def top_k_of(workload: str) -> int:
    """Top-k of a workload."""
    return traces.TRACE_TOP_K.get(workload, _K.value)


def time_ranks(works: dict, ep: int, masters: int, top_k: int, mode: str, settings: Settings):
    """Each rank's measured seconds under each policy of ``works`` (which holds ``"ideal"``).

    Experts: every rank of every policy, ``settings.repeats`` rounds; in each round rank r's
    tasks run back to back, the ideal's rank r first, and each is taken relative to it: other
    processes sharing the core slow both alike, so the ratio cancels what the machine's load did
    at that moment (the ideal's ranks all do the same work). A rank's cost is its median ratio
    times the ideal's time (the median over its ranks of each one's fastest round). Then each
    policy's ``settings.refine`` costliest ranks are timed again until they all have
    ``settings.refine_rounds`` rounds (the busiest rank is a maximum, which noise inflates). The
    ideal's tasks also run a second time as if they were a policy's: its busiest rank against the
    ideal is what noise alone costs a policy whose ranks all do the ideal's work. Bookkeeping: its
    shapes (pairs, buffer rows) are the same on every rank of a policy, so it is
    timed on the ``settings.bookkeeping_ranks`` ranks that receive the most rows (fastest round,
    slowest rank).

    Returns:
      (experts, bookkeeping, noise): {policy: [R] seconds}, {policy: seconds}, and the busiest
      rank of the ideal timed again, relative to the ideal (1: no noise).
    """
    shape = settings.shape
    again_ideal = "ideal, timed again"
    order = ["ideal", *(p for p in works if p != "ideal"), again_ideal]
    tasks = {
        (p, r): replay_timing.experts_task(
            works["ideal" if p == again_ideal else p], r, masters, shape, mode
        )
        for r in range(ep)
        for p in order
    }
    rounds = replay_timing.sample_times(tasks, settings.repeats)

    def cost(p, r):
        return statistics.median(
            t[(p, r)] / t[("ideal", r)] for t in rounds if (p, r) in t and ("ideal", r) in t
        )

    # Racing: re-time each policy's costliest ranks until the `refine` costliest all have
    # `refine_rounds` paired rounds (a maximum over noisy estimates picks the noisiest).
    for _ in range(4 * -(-settings.refine_rounds // settings.repeats)):
        again = {
            (p, r)
            for p in order[1:]
            for r in sorted(range(ep), key=lambda r, p=p: -cost(p, r))[: settings.refine]
            if sum((p, r) in t for t in rounds) < settings.refine_rounds
        }
        if not again:
            break
        again |= {("ideal", r) for _, r in again}
        more = [k for k in tasks if k in again]  # rank-major, the ideal first
        rounds += replay_timing.sample_times({k: tasks[k] for k in more}, settings.repeats, False)
    ideal = statistics.median(
        min(t[("ideal", r)] for t in rounds if ("ideal", r) in t) for r in range(ep)
    )
    book_tasks = {
        (p, int(r)): replay_timing.bookkeeping_task(w, int(r), top_k, shape, mode, settings.seed)
        for p, w in works.items()
        for r in np.argsort(-w.rows_R, kind="stable")[: settings.bookkeeping_ranks]
    }
    book = replay_timing.sample_times(book_tasks, settings.repeats)
    return (
        {p: [ideal * cost(p, r) for r in range(ep)] for p in works},
        {p: max(min(t[k] for t in book) for k in book_tasks if k[0] == p) for p in works},
        max(cost(again_ideal, r) for r in range(ep)),
    )


def replay_cell(workload: str, ep: int, mode: str, samples, settings: Settings) -> dict:
    """Every policy on ``samples`` at one EP size and mode: per-policy figures summed over the
    matrices (each matrix is one layer: the busiest rank's time per layer, summed), and every
    timed rank as a calibration point ``(policy, rows, groups, buffer rows, seconds)``."""
    E, k = num_experts_of(workload), top_k_of(workload)
    pairs = settings.pairs[mode]
    cfg = settings.balancer(ep, E, mode)
    capacity = replay_work.layer_capacity(settings.capacity_factor, pairs)
    shape = settings.shape
    token_a2a, weight_moves = real_ratio.EXCHANGES[mode]
    names = (*replay_work.POLICIES, "ideal")
    summed = _SUMMED + (_TARGET_SUMMED if settings.target else ())
    sums = {p: dict.fromkeys(summed, 0.0) for p in names}
    points = []
    every = [replay_work.policy_work(s, cfg, pairs, capacity) for s in samples]
    noise_floor = 0.0
    buffers = {p: max(w[p].capacity for w in every) for p in replay_work.DROPLESS}
    for sample, works in zip(samples, every, strict=True):
        start = time.perf_counter()
        works = replay_work.with_buffers(works, buffers)
        if settings.timed:
            experts, book, noise = time_ranks(works, ep, E // ep, k, mode, settings)
        else:  # rows over the mean rows, nothing timed (--experts=rows)
            experts = {p: list(w.rows_R / pairs) for p, w in works.items()}
            book, noise = dict.fromkeys(names, 0.0), 1.0
        noise_floor += 100.0 / noise / len(samples)
        planner = {p: works[p].host_plan_seconds if settings.timed else 0.0 for p in names}
        for p, eps in (("ultraep", cfg.balance_eps), ("exact", 0.0)):
            if settings.timed:
                planner[p] = replay_timing.planner_seconds(
                    sample.loads_RE,
                    dataclasses.replace(cfg, balance_eps=eps),
                    capacity,
                    settings.repeats,
                )
        for p in names:
            w = works[p]
            tokens = token_a2a * replay_work.exchange_seconds(
                w.token_rows_RR, shape.row_bytes(), settings.link_gbps
            )
            weights = weight_moves * replay_work.exchange_seconds(
                w.weight_copies_RR, shape.expert_bytes(), settings.link_gbps
            )
            compute = planner[p] + max(experts[p]) + book[p]
            add = {
                "experts_s": max(experts[p]),
                "bookkeeping_s": book[p],
                "planner_s": planner[p],
                "compute_s": compute,
                "tokens_s": tokens,
                "weights_s": weights,
                "step_s": compute + tokens + weights,
                "imbalance": w.imbalance,
                "replicas": w.replicas,
                "dropped": w.dropped,
            }
            if settings.target:
                at = real_ratio.layer_at_target(
                    max(experts[p]),
                    max(experts["ideal"]),
                    w.token_rows_RR,
                    real_ratio.transfer_length(w.held_RC, E, cfg.max_fanout),
                    pairs,
                    settings.target,
                    mode,
                )
                add |= {
                    "target_experts_s": at.experts_s,
                    "target_tokens_s": at.tokens_s,
                    "target_transfer_s": at.transfer_s,
                    "target_exposed_s": at.exposed_s,
                    "target_step_s": at.step_s,
                }
            for key, value in add.items():
                sums[p][key] += value
            points += [
                (p, int(rows), int(groups), w.capacity, t)
                for rows, groups, t in zip(w.rows_R, w.groups_R, experts[p], strict=True)
            ]
        noise_line = (
            f"the ideal timed again reaches {100.0 / noise:.1f} % of itself"
            if settings.timed
            else "not timed"
        )
        print(
            f"  {sample.label}: max/mean none {works['none'].imbalance:.2f} -> ultraep "
            f"{works['ultraep'].imbalance:.3f}; {noise_line} "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    n = len(samples)
    rows = {}
    for p in names:
        s = sums[p]
        row = {key: s[key] for key in summed}
        for key in ("imbalance", "replicas", "dropped"):
            row[key] = s[key] / n
        for part in ("experts", "compute", "step") + (("target_step",) if settings.target else ()):
            row[f"{part}_pct_ideal"] = 100.0 * sums["ideal"][f"{part}_s"] / s[f"{part}_s"]
            row[f"{part}_x_none"] = sums["none"][f"{part}_s"] / s[f"{part}_s"]
        # The balancer's own cost against the expert time it balances: planner and bookkeeping,
        # and what they add to plain EP's bookkeeping (which dispatches without a balancer too).
        own = s["planner_s"] + s["bookkeeping_s"]
        row["balancer_pct_experts"] = 100.0 * own / s["experts_s"]
        added = own - sums["none"]["bookkeeping_s"]
        row["balancer_added_pct_experts"] = 100.0 * added / s["experts_s"]
        if settings.target:
            row["target_step_x_none"] = sums["none"]["target_step_s"] / s["target_step_s"]
            row["target_exposed_pct_step"] = 100.0 * s["target_exposed_s"] / s["target_step_s"]
            # Were nothing overlapped: the whole transfer on the step's critical path.
            serial = s["target_step_s"] - s["target_exposed_s"] + s["target_transfer_s"]
            row["target_serial_transfer_pct_step"] = 100.0 * s["target_transfer_s"] / serial
        rows[p] = row
    return {
        "workload": workload,
        "ep": ep,
        "mode": mode,
        "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
        "shape": dataclasses.asdict(shape),
        "matrices": [s.label for s in samples],
        "num_experts": E,
        "top_k": k,
        "pairs_per_rank": pairs,
        "capacity": capacity,
        "balancer": dataclasses.asdict(cfg),
        "initial_imbalance": float(
            sum(workloads.initial_imbalance(s.loads_RE) for s in samples) / n
        ),
        "noise_floor_pct": noise_floor,
        "timed": settings.timed,
        "target": dataclasses.asdict(settings.target) if settings.target else None,
        "rows": rows,
        "points": points,
    }


_SUMMED = (
    "experts_s",
    "bookkeeping_s",
    "planner_s",
    "compute_s",
    "tokens_s",
    "weights_s",
    "step_s",
    "imbalance",
    "replicas",
    "dropped",
)
#: The per-layer seconds of ``--transfer_model`` (`real_ratio.LayerAtTarget`), summed likewise.
_TARGET_SUMMED = (
    "target_experts_s",
    "target_tokens_s",
    "target_transfer_s",
    "target_exposed_s",
    "target_step_s",
)


def cell_table(cell: dict) -> list[str]:
    """The lines of one cell's table (ms are per layer, summed over the matrices)."""
    ms = 1e3
    lines = [
        f"{cell['workload']} EP{cell['ep']} {cell['mode']}: {len(cell['matrices'])} matrices, "
        f"initial max/mean {cell['initial_imbalance']:.2f}, {cell['pairs_per_rank']} pairs per "
        f"rank, buffer {cell['capacity']} rows; "
        + (
            f"noise floor: the ideal timed again reaches {cell['noise_floor_pct']:.1f} % of itself"
            if cell.get("timed", True)
            else "not timed (--experts=rows)"
        ),
        f"  {'policy':14s} {'max/mean':>8s} {'moved':>6s} {'drop':>5s} | {'experts':>8s} "
        f"{'%ideal':>6s} {'xnone':>5s} | {'bookk.':>7s} {'planner':>7s} {'compute':>8s} "
        f"{'%ideal':>6s} | {'a2a*':>7s} {'weights*':>8s} | {'step':>8s} {'%ideal':>6s} "
        f"{'xnone':>5s}",
    ]
    for p, r in cell["rows"].items():
        lines.append(
            f"  {p:14s} {r['imbalance']:8.3f} {r['replicas']:6.1f} {r['dropped']:5.0f} | "
            + f"{ms * r['experts_s']:8.2f} {r['experts_pct_ideal']:6.1f} "
            + f"{r['experts_x_none']:5.2f} | {ms * r['bookkeeping_s']:7.2f} "
            + f"{ms * r['planner_s']:7.3f} {ms * r['compute_s']:8.2f} "
            + f"{r['compute_pct_ideal']:6.1f} | {ms * r['tokens_s']:7.2f} "
            + f"{ms * r['weights_s']:8.2f} | {ms * r['step_s']:8.2f} "
            + f"{r['step_pct_ideal']:6.1f} {r['step_x_none']:5.2f}"
        )
    if cell.get("target"):
        lines += target_table(cell)
    return lines


def target_table(cell: dict) -> list[str]:
    """The lines of one cell at ``--transfer_model``'s ratios (ms per layer, summed)."""
    t = cell["target"]
    ms = 1e3
    lines = [
        f"  at {t['name']}'s ratios (D={t['d_model']} F={t['d_ff']}, "
        f"{t['pairs_per_rank'][cell['mode']]} pairs per rank, an expert copy "
        f"{3 * t['d_model'] * t['d_ff'] * t['itemsize'] / 1e6:.1f} MB) on {t['gpu']} at "
        f"{t['gpu_tflops']:g} TFLOP/s, links {t['link_gbps']:g} GB/s, relay f="
        f"{cell['balancer']['max_fanout']}: experts = the "
        + ("measured" if cell.get("timed", True) else "rows-modelled")
        + " ratio to the ideal x the ideal's FLOPs at that rate; the rest modelled",
        f"  {'policy':14s} | {'experts':>8s} {'a2a*':>8s} {'transfer*':>9s} {'exposed*':>8s} | "
        f"{'step':>8s} {'%ideal':>6s} {'xnone':>5s} {'exposed % step':>14s} "
        f"{'serial: transfer % step':>23s}",
    ]
    for p, r in cell["rows"].items():
        lines.append(
            f"  {p:14s} | {ms * r['target_experts_s']:8.2f} {ms * r['target_tokens_s']:8.2f} "
            f"{ms * r['target_transfer_s']:9.2f} {ms * r['target_exposed_s']:8.2f} | "
            f"{ms * r['target_step_s']:8.2f} {r['target_step_pct_ideal']:6.1f} "
            f"{r['target_step_x_none']:5.2f} {r['target_exposed_pct_step']:13.1f}% "
            f"{r['target_serial_transfer_pct_step']:22.1f}%"
        )
    return lines


def headline(cells: list[dict]) -> list[str]:
    """ultraep against the force-balanced ideal in every cell: what was measured, and what was
    modelled."""
    shape = cells[0]["shape"] if cells else {}
    lines = [
        "ultraep against the force-balanced ideal. Measured: the busiest rank's expert kernel "
        f"time at D={shape.get('d_model')} F={shape.get('d_ff')} on "
        f"{cells[0]['device'] if cells else '?'} (experts), and with the planner and the "
        "dispatch bookkeeping (compute). Modelled: step = compute + the exchanges at this "
        "shape's bytes, which are far smaller relative to compute than a real model's (use "
        "--transfer_model). Noise floor = the ideal's own ranks timed again as a policy (what "
        "noise alone takes off a busiest rank); balancer % experts = (planner + bookkeeping) / "
        "expert time, (added) = less none's bookkeeping. Not an end-to-end throughput:"
        if all(c.get("timed", True) for c in cells)
        else "Nothing was timed (--experts=rows): each rank's expert time is its rows over the "
        "mean rows, and the planner and bookkeeping count 0:",
        f"  {'workload':16s} {'EP':>3s} {'mode':8s} {'experts %ideal':>14s} {'x none':>6s} "
        f"{'compute %ideal':>14s} {'x none':>6s} {'step %ideal':>11s} {'x none':>6s} "
        f"{'exact mode: experts %ideal':>26s} {'noise floor':>11s} "
        f"{'balancer % experts (added)':>26s}",
    ]
    for c in cells:
        u, x = c["rows"]["ultraep"], c["rows"]["exact"]
        lines.append(
            f"  {c['workload']:16s} {c['ep']:3d} {c['mode']:8s} {u['experts_pct_ideal']:13.1f}% "
            f"{u['experts_x_none']:6.2f} {u['compute_pct_ideal']:13.1f}% "
            f"{u['compute_x_none']:6.2f} {u['step_pct_ideal']:10.1f}% {u['step_x_none']:6.2f} "
            f"{x['experts_pct_ideal']:25.1f}% {c['noise_floor_pct']:10.1f}% "
            f"{u['balancer_pct_experts']:16.1f}% ({u['balancer_added_pct_experts']:5.1f}%)"
        )
    targets = [c for c in cells if c.get("target")]
    if targets:
        t = targets[0]["target"]
        lines += [
            f"ultraep at {t['name']}'s ratios on {t['gpu']} ({t['gpu_tflops']:g} TFLOP/s, "
            f"{t['link_gbps']:g} GB/s): experts from the "
            + ("measured" if all(c.get("timed", True) for c in targets) else "rows-modelled")
            + " ratio to the ideal, the "
            "exchanges and the relayed replica copies modelled; exposed = the transfer that "
            "outlasts the token all-to-all of its pass; serial = the share the whole transfer "
            "would take were nothing overlapped:",
            f"  {'workload':16s} {'EP':>3s} {'mode':8s} {'step %ideal':>11s} {'x none':>6s} "
            f"{'exposed transfer % step':>23s} {'serial % step':>13s} {'transfer ms':>11s} "
            f"{'exposed ms':>10s}",
        ]
        for c in targets:
            u = c["rows"]["ultraep"]
            lines.append(
                f"  {c['workload']:16s} {c['ep']:3d} {c['mode']:8s} "
                f"{u['target_step_pct_ideal']:10.1f}% {u['target_step_x_none']:6.2f} "
                f"{u['target_exposed_pct_step']:22.1f}% "
                f"{u['target_serial_transfer_pct_step']:12.1f}% "
                f"{1e3 * u['target_transfer_s']:11.2f} {1e3 * u['target_exposed_s']:10.2f}"
            )
    return lines


def nonnegative_least_squares(a: np.ndarray, t: np.ndarray) -> np.ndarray:
    """float [n]: the ``x >= 0`` that minimises ``||a @ x - t||`` for ``a`` [m, n], ``t`` [m], with
    few columns (n <= 12): the unconstrained fit on every subset of columns, keeping the best one
    whose coefficients are all >= 0 (the constrained optimum is the unconstrained fit on its own
    support, so this finds it)."""
    a, t = np.asarray(a, np.float64), np.asarray(t, np.float64)
    n = a.shape[1]
    if n > 12:
        raise ValueError(f"nonnegative_least_squares: {n} columns, at most 12")
    best, best_err = np.zeros(n), float(t @ t)
    for mask in range(1, 2**n):
        cols = [j for j in range(n) if mask >> j & 1]
        x = np.zeros(n)
        x[cols] = np.linalg.lstsq(a[:, cols], t, rcond=None)[0]
        err = float(np.sum((a @ x - t) ** 2))
        if np.all(x >= 0) and err < best_err:
            best, best_err = x, err
    return best


def fit_costs(points, capacity: int) -> dict:
    """``seconds = fixed[buffer] + per_row * rows + per_group * groups`` fitted by least squares
    over timed ranks ``(policy, rows, groups, buffer rows, seconds)`` with every cost >= 0 (a cost
    model: no term may pay back time), one fixed term per buffer size (the tiled kernel's buffer
    work), reported at the layer's ``capacity``; with R^2 and the median and worst relative
    error."""
    buffers = sorted({c for *_, c, _ in points})
    a = np.array([[float(c == b) for b in buffers] + [r, g] for _, r, g, c, _ in points])
    t = np.array([s for *_, s in points])
    coef = nonnegative_least_squares(a, t)
    pred = a @ coef
    rel = np.abs(pred - t) / t
    return {
        "seconds_fixed": float(coef[buffers.index(capacity)]),
        "seconds_per_row": float(coef[-2]),
        "seconds_per_group": float(coef[-1]),
        "buffer_rows": capacity,
        "r2": float(1 - np.sum((t - pred) ** 2) / np.sum((t - t.mean()) ** 2)),
        "median_rel_error": float(np.median(rel)),
        "max_rel_error": float(rel.max()),
        "samples": len(points),
    }


def provenance() -> dict:
    """Machine, commit, command and date of this run."""
    root = pathlib.Path(__file__).resolve().parents[2]

    def git(*args) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
            return out.stdout.strip()
        except OSError:
            return ""

    cpu = ""
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {
        "machine": f"{platform.node()} ({cpu or platform.processor()}, {os.cpu_count()} cores)",
        "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
        "commit": git("rev-parse", "HEAD")
        + (
            " (uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
        ),
        "command": "python -m experiments.replay " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__,
    }


def calibration(cells: list[dict], settings: Settings, clock_name: str) -> dict:
    """The calibration file's content: per mode the fitted expert costs, the shape, and the
    replay's measured ultraep figures (see `experiments.sim`)."""
    shape = dataclasses.asdict(settings.shape)
    out = {"provenance": provenance(), "shape": shape, "clock": clock_name}
    for mode in ("train", "prefill"):
        mine = [c for c in cells if c["mode"] == mode]
        points = [pt for c in mine for pt in c["points"]]
        if points:
            fit = fit_costs(points, mine[0]["capacity"])
            out[mode] = {**fit, "pairs_per_rank": settings.pairs[mode]}
    out["measured"] = [
        {
            "workload": c["workload"],
            "ep": c["ep"],
            "mode": c["mode"],
            "ultraep_experts_pct_ideal": c["rows"]["ultraep"]["experts_pct_ideal"],
            "ultraep_experts_x_none": c["rows"]["ultraep"]["experts_x_none"],
            "ultraep_step_pct_ideal": c["rows"]["ultraep"]["step_pct_ideal"],
            "ultraep_step_x_none": c["rows"]["ultraep"]["step_x_none"],
            "noise_floor_pct": c["noise_floor_pct"],
        }
        for c in cells
    ]
    return out


def main(argv):
    """Replays every (workload, EP size, mode) cell and prints its table and the headline."""
    del argv
    if _CORE.value >= 0:
        os.sched_setaffinity(0, {_CORE.value})  # before JAX starts its threads
    common.keep_freed_memory()
    preset = _SHAPES[_SHAPE.value]
    shape = replay_timing.Shape(
        d_model=_D.value or preset["d_model"],
        d_ff=_F.value or preset["d_ff"],
        dtype=_DTYPE.value or preset["dtype"],
        kernel=_KERNEL.value,
    )
    settings = Settings(
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
        target=(
            real_ratio.TargetModel(
                name=_TRANSFER_MODEL.value,
                **_TARGETS[_TRANSFER_MODEL.value],
                gpu=_GPU.value,
                gpu_tflops=_GPU_TFLOPS.value,
                link_gbps=_LINK.value,
            )
            if _TRANSFER_MODEL.value
            else None
        ),
        timed=_EXPERTS.value == "timed",
    )
    if not settings.timed and _CALIBRATION.value:
        raise app.UsageError("--calibration_out needs --experts=timed (it fits timed ranks)")
    modes = replay_timing.MODES if _MODE.value == "both" else (_MODE.value,)
    on_cpu = jax.default_backend() == "cpu"
    clock_name = (
        f"process CPU time, pinned to core {_CORE.value}"
        if on_cpu and _CORE.value >= 0
        else "process CPU time"
        if on_cpu
        else "wall time"
    )
    if not settings.timed:
        clock_name = "none: expert time = rows / mean rows (--experts=rows), nothing timed"
    print(
        f"Per-rank replay on {jax.devices()[0].device_kind} ({jax.default_backend()}), clock: "
        f"{clock_name}; shape D={shape.d_model} F={shape.d_ff} {shape.dtype}, kernel "
        f"{shape.kernel}; pairs per rank {settings.pairs}; {settings.slots} slots per rank, "
        f"capacity factor {settings.capacity_factor}; modelled links {settings.link_gbps:g} GB/s "
        f"per rank and direction",
        flush=True,
    )
    cells = []
    for workload in _WORKLOADS.value:
        for ep_flag in dict.fromkeys(int(s) for s in _EP.value):
            ep = ep_for(num_experts_of(workload), ep_flag)
            for mode in modes:
                print(f"{workload} EP{ep} {mode}:", flush=True)
                samples = samples_for(
                    workload,
                    ep,
                    settings.pairs[mode],
                    _MATRICES.value,
                    _HISTORY.value,
                    settings.seed,
                    _TRACES.value,
                )
                cell = replay_cell(workload, ep, mode, samples, settings)
                cells.append(cell)
                print("\n".join(cell_table(cell)), flush=True)
    print("\n* modelled from exact bytes per rank (not timed)\n")
    print("\n".join(headline(cells)))
    if _CALIBRATION.value:
        common.write_json(_CALIBRATION.value, calibration(cells, settings, clock_name))
        print(f"calibration written to {_CALIBRATION.value}")
    common.write_json(_JSON.value, cells)
