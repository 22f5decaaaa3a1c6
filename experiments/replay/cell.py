"""One cell of the per-rank replay: every policy on one workload's load matrices at one EP size
and mode, each layer charged by the step model (`experiments.lab.stepmodel.layer`): the busiest
rank's measured experts, bookkeeping and planner, and the token all-to-alls and the replica
transfer modelled from their exact bytes per rank, the transfer beside the all-to-all of its
pass (what outlasts it is exposed)."""

from __future__ import annotations

import dataclasses
import time

import jax

import ultraep_jax as uep
from experiments.lab.loads import traces, workloads
from experiments.lab.stepmodel import layer, links
from experiments.lab.walltime import seconds_per_plan
from experiments.replay import real_ratio
from experiments.replay import timing as replay_timing
from experiments.replay import work as replay_work

#: A cell's per-layer figures, summed over its matrices (the last three then averaged).
_SUMMED = (
    "experts_s",
    "bookkeeping_s",
    "planner_s",
    "compute_s",
    "tokens_s",
    "weights_s",
    "exposed_s",
    "step_s",
    "imbalance",
    "replicas",
    "dropped",
)
#: The per-layer seconds of ``--transfer_model`` (`experiments.lab.stepmodel.layer.LayerTime`),
#: summed likewise.
_TARGET_SUMMED = (
    "target_experts_s",
    "target_tokens_s",
    "target_transfer_s",
    "target_exposed_s",
    "target_step_s",
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
    zipf_experts: int
    zipf_top_k: int
    target: real_ratio.TargetLayer | None = None
    timed: bool = True

    def balancer(self, ep: int, num_experts: int, mode: str) -> uep.BalancerConfig:
        """ultraep's `BalancerConfig` at this EP size and mode (its floor scales with the pairs)."""
        floor = self.floor if self.floor is not None else max(1, self.pairs[mode] // 64)
        return uep.BalancerConfig(num_experts, ep, self.slots, floor, self.eps)


def ep_for(num_experts: int, ep: int) -> int:
    """``ep``, or the largest divisor of ``num_experts`` below it."""
    return max(d for d in range(1, ep + 1) if num_experts % d == 0)


def samples_for(
    workload: str, ep: int, mode: str, count: int, history: int, settings: Settings, traces_dir
):
    """The `replay_work.Sample` list of one workload at one EP size and mode."""
    pairs, seed = settings.pairs[mode], settings.seed
    if workload in traces.TRACE_NAMES:
        return replay_work.trace_samples(workload, ep, pairs, count, history, seed, traces_dir)
    E, k = settings.zipf_experts, settings.zipf_top_k
    return replay_work.zipf_samples(float(workload[4:]), ep, E, k, pairs, count, history, seed)


def num_experts_of(workload: str, settings: Settings) -> int:
    """E of a workload."""
    return traces.TRACE_NUM_EXPERTS.get(workload, settings.zipf_experts)


def top_k_of(workload: str, settings: Settings) -> int:
    """Top-k of a workload."""
    return traces.TRACE_TOP_K.get(workload, settings.zipf_top_k)


def _planner_seconds(works, sample, cfg, capacity: int, settings: Settings, names) -> dict:
    """Each policy's planner seconds on one matrix: its host planner's time, with ultraep and
    exact re-timed at their own balance_eps (all 0 when nothing is timed)."""
    planner = {p: works[p].host_plan_seconds if settings.timed else 0.0 for p in names}
    for p, eps in (("ultraep", cfg.balance_eps), ("exact", 0.0)):
        if settings.timed:
            planner[p] = seconds_per_plan(
                sample.loads_RE,
                dataclasses.replace(cfg, balance_eps=eps),
                settings.repeats,
                capacity=capacity,
            )
    return planner


def _layer_figures(
    w, copies: float, expert_s: float, other_s: float, plan_s: float, mode, settings
):
    """One policy's layer on one matrix, the step model's at the replayed shape: measured
    planner, bookkeeping and experts, the exchanges modelled from their bytes
    (`experiments.lab.stepmodel.links`)."""
    one_a2a, one_transfer = links.exchange_and_transfer(
        w.token_rows_RR, copies, settings.shape.experts, links.Links.single(settings.link_gbps)
    )
    at = layer.layer_terms(expert_s, one_a2a, one_transfer, mode, other_s=other_s, plan_s=plan_s)
    return {
        "experts_s": at.experts,
        "bookkeeping_s": at.other,
        "planner_s": at.plan,
        "compute_s": at.plan + at.experts + at.other,
        "tokens_s": at.a2a,
        "weights_s": at.transfer,
        "exposed_s": at.transfer_exposed,
        "step_s": at.total,
        "imbalance": w.imbalance,
        "replicas": w.replicas,
        "dropped": w.dropped,
    }


def _target_figures(w, copies: float, expert_s: float, ideal_s: float, pairs, mode, target):
    """One policy's layer on one matrix at ``--transfer_model``'s shape
    (`real_ratio.layer_at_target`)."""
    at = real_ratio.layer_at_target(expert_s, ideal_s, w.token_rows_RR, copies, pairs, target, mode)
    return {
        "target_experts_s": at.experts,
        "target_tokens_s": at.a2a,
        "target_transfer_s": at.transfer,
        "target_exposed_s": at.transfer_exposed,
        "target_step_s": at.total,
    }


def _sample_line(sample, works, noise: float, timed: bool, seconds: float) -> str:
    """The progress line of one matrix."""
    noise_line = (
        f"the ideal timed again reaches {100.0 / noise:.1f} % of itself" if timed else "not timed"
    )
    return (
        f"  {sample.label}: max/mean none {works['none'].imbalance:.2f} -> ultraep "
        f"{works['ultraep'].imbalance:.3f}; {noise_line} "
        f"({seconds:.0f} s)"
    )


def _policy_row(s: dict, sums: dict, summed, n: int, target: bool) -> dict:
    """One policy's table row from its summed figures ``s`` over ``n`` matrices (``sums``: every
    policy's, for the ratios to the ideal and to plain EP)."""
    row = {key: s[key] for key in summed}
    for key in ("imbalance", "replicas", "dropped"):
        row[key] = s[key] / n
    for part in ("experts", "compute", "step") + (("target_step",) if target else ()):
        row[f"{part}_pct_ideal"] = 100.0 * sums["ideal"][f"{part}_s"] / s[f"{part}_s"]
        row[f"{part}_x_none"] = sums["none"][f"{part}_s"] / s[f"{part}_s"]
    # The balancer's own cost against the expert time it balances: planner and bookkeeping,
    # and what they add to plain EP's bookkeeping (which dispatches without a balancer too).
    own = s["planner_s"] + s["bookkeeping_s"]
    row["balancer_pct_experts"] = 100.0 * own / s["experts_s"]
    added = own - sums["none"]["bookkeeping_s"]
    row["balancer_added_pct_experts"] = 100.0 * added / s["experts_s"]
    if target:
        row["target_step_x_none"] = sums["none"]["target_step_s"] / s["target_step_s"]
        row["target_exposed_pct_step"] = 100.0 * s["target_exposed_s"] / s["target_step_s"]
        # Were nothing overlapped: the whole transfer on the step's critical path.
        serial = s["target_step_s"] - s["target_exposed_s"] + s["target_transfer_s"]
        row["target_serial_transfer_pct_step"] = 100.0 * s["target_transfer_s"] / serial
    return row


def _timed_experts(works, ep: int, E: int, k: int, mode: str, pairs: int, settings: Settings):
    """(experts, bookkeeping, noise) of one matrix: each policy's per-rank expert seconds, its
    bookkeeping seconds and the ideal's noise ratio; without timing (--experts=rows) the rows
    over the mean rows, no bookkeeping and noise 1."""
    if settings.timed:
        return replay_timing.time_ranks(works, ep, E // ep, k, mode, settings)
    names = (*replay_work.POLICIES, "ideal")
    return {p: list(w.rows_R / pairs) for p, w in works.items()}, dict.fromkeys(names, 0.0), 1.0


def replay_cell(workload: str, ep: int, mode: str, samples, settings: Settings) -> dict:
    """Every policy on ``samples`` at one EP size and mode: per-policy figures summed over the
    matrices (each matrix is one layer: the busiest rank's time per layer, summed), and every
    timed rank as a calibration point ``(policy, rows, groups, buffer rows, seconds)``."""
    E, k = num_experts_of(workload, settings), top_k_of(workload, settings)
    pairs = settings.pairs[mode]
    cfg = settings.balancer(ep, E, mode)
    capacity = replay_work.layer_capacity(settings.capacity_factor, pairs)
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
        experts, book, noise = _timed_experts(works, ep, E, k, mode, pairs, settings)
        noise_floor += 100.0 / noise / len(samples)
        planner = _planner_seconds(works, sample, cfg, capacity, settings, names)
        for p in names:
            w = works[p]
            copies = float(links.relay_copies(w.held_RC[None], E, cfg.max_fanout)["length"][0])
            add = _layer_figures(w, copies, max(experts[p]), book[p], planner[p], mode, settings)
            if settings.target:
                ideal_s = max(experts["ideal"])
                add |= _target_figures(
                    w, copies, max(experts[p]), ideal_s, pairs, mode, settings.target
                )
            for key, value in add.items():
                sums[p][key] += value
            points += [
                (p, int(rows), int(groups), w.capacity, t)
                for rows, groups, t in zip(w.rows_R, w.groups_R, experts[p], strict=True)
            ]
        seconds = time.perf_counter() - start
        print(_sample_line(sample, works, noise, settings.timed, seconds), flush=True)
    n = len(samples)
    rows = {p: _policy_row(sums[p], sums, summed, n, bool(settings.target)) for p in names}
    return {
        "workload": workload,
        "ep": ep,
        "mode": mode,
        "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
        "shape": dataclasses.asdict(settings.shape),
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
