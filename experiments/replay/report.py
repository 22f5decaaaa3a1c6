"""The per-rank replay's output: each cell's table, its lines at ``--transfer_model``'s
ratios, the headline over every cell (ms are per layer, summed over the matrices), and the
calibration file's content."""

from __future__ import annotations

import dataclasses

from experiments.lab.stepmodel import calibration as stepcal
from experiments.lab.stepmodel.shapes import ExpertShape


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
        f"{'%ideal':>6s} | {'a2a*':>7s} {'weights*':>8s} {'exposed*':>8s} | {'step':>8s} "
        f"{'%ideal':>6s} "
        f"{'xnone':>5s}",
    ]
    for p, r in cell["rows"].items():
        lines.append(
            f"  {p:14s} {r['imbalance']:8.3f} {r['replicas']:6.1f} {r['dropped']:5.0f} | "
            + f"{ms * r['experts_s']:8.2f} {r['experts_pct_ideal']:6.1f} "
            + f"{r['experts_x_none']:5.2f} | {ms * r['bookkeeping_s']:7.2f} "
            + f"{ms * r['planner_s']:7.3f} {ms * r['compute_s']:8.2f} "
            + f"{r['compute_pct_ideal']:6.1f} | {ms * r['tokens_s']:7.2f} "
            + f"{ms * r['weights_s']:8.2f} {ms * r['exposed_s']:8.2f} | {ms * r['step_s']:8.2f} "
            + f"{r['step_pct_ideal']:6.1f} {r['step_x_none']:5.2f}"
        )
    if cell.get("target"):
        lines += target_table(cell)
    return lines


def target_table(cell: dict) -> list[str]:
    """The lines of one cell at ``--transfer_model``'s ratios (ms per layer, summed)."""
    t = cell["target"]
    copy_mb = ExpertShape(t["d_model"], t["d_ff"], t["itemsize"]).expert_bytes() / 1e6
    ms = 1e3
    lines = [
        f"  at {t['name']}'s ratios (D={t['d_model']} F={t['d_ff']}, "
        f"{t['pairs_per_rank'][cell['mode']]} pairs per rank, an expert copy "
        f"{copy_mb:.1f} MB) on {t['gpu']} at "
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
        "dispatch bookkeeping (compute). Modelled: step = compute + the token all-to-alls + "
        "the replica transfer that outlasts the all-to-all of its pass (the step model's rule, "
        "experiments.lab.stepmodel.layer), at this shape's bytes, which are far smaller relative "
        "to compute than a real model's (use --transfer_model). Noise floor = the ideal's own "
        "ranks timed again as a policy (what noise alone takes off a busiest rank); balancer % "
        "experts = (planner + bookkeeping) / expert time, (added) = less none's bookkeeping. "
        "Not an end-to-end throughput:"
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


def calibration(cells: list[dict], settings, clock_name: str) -> dict:
    """The calibration file's content (`experiments.lab.stepmodel.calibration.calibration_file`):
    per mode the experts' costs fitted over every timed rank, and the replay's measured ultraep
    figures; ``settings``: the run's `experiments.replay.cell.Settings`."""
    fits = {}
    for mode in ("train", "prefill"):
        mine = [c for c in cells if c["mode"] == mode]
        points = [pt for c in mine for pt in c["points"]]
        if points:
            fit = stepcal.fit_costs(points, mine[0]["capacity"])
            fits[mode] = {**fit, "pairs_per_rank": settings.pairs[mode]}
    measured = [
        {
            "workload": c["workload"],
            "ep": c["ep"],
            "mode": c["mode"],
            **{
                f"ultraep_{key}": c["rows"]["ultraep"][key]
                for key in ("experts_pct_ideal", "experts_x_none", "step_pct_ideal", "step_x_none")
            },
            "noise_floor_pct": c["noise_floor_pct"],
        }
        for c in cells
    ]
    shape = dataclasses.asdict(settings.shape)
    return stepcal.calibration_file(fits, shape, clock_name, measured, "experiments.replay")
