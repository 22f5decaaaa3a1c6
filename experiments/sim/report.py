"""The simulator's output: the calibration, the tables and the verdict, as lists of lines (its
assumptions: `experiments.sim.assumptions`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def calibration_lines(cost, cells: Sequence[dict], name: str = "ultraep") -> list[str]:
    """What a calibrated run measured and modelled, and its figure beside the replay's measured
    one, which it restates: the calibration is the replay's own fit of its timed ranks."""
    prov = cost.provenance
    rows = [c["rows"][name] for c in cells if name in c["rows"]]
    lines = [
        f"Calibration: {prov.get('command', '?')} on {prov.get('machine', '?')}, device "
        f"{cost.device}, commit {prov.get('commit', '?')}, {prov.get('date', '?')}.",
        "Measured: each rank's expert compute (fixed, per-row and per-group cost, from the "
        "replay's timed ranks). Modelled: their scaling to each model's width and rows, and "
        "every other term (attention and dense layers, the all-to-alls, replica transfer, the "
        "load all-gather) from the stated hardware; the planner is CPU-timed here.",
    ]
    if "cpu" in cost.device.lower():
        lines.append(
            "The calibration comes from a CPU: the expert term is that CPU's seconds beside "
            "GPU-modelled terms, so the step is almost all expert time and the percentages "
            "describe the CPU kernels' balance, not a GPU cluster's step."
        )
    lines.append(
        f"{name}, % of the force-balanced ideal and speed-up over none. The calibrated figure is "
        "not a second measurement: it runs the replay's fit of rows and groups through the model, "
        "so it restates the replay's figure rather than confirming it:"
    )
    if rows:
        lines.append(
            f"  simulator, calibrated: {np.mean([r['pct_ideal'] for r in rows]):.1f} % and "
            f"{np.mean([r['speedup'] for r in rows]):.2f}x (mean over {len(rows)} cells)"
        )
    for m in cost.measured:
        lines.append(
            f"  replay, measured ({m['workload']} EP{m['ep']} {m['mode']}): expert kernel time "
            f"{m['ultraep_experts_pct_ideal']:.1f} % and {m['ultraep_experts_x_none']:.2f}x; "
            f"with the exchanges modelled {m['ultraep_step_pct_ideal']:.1f} % and "
            f"{m['ultraep_step_x_none']:.2f}x"
        )
    return lines


def headline_table(cells: Sequence[dict], baselines: Sequence[str]) -> list[str]:
    """Per model and baseline, averaged over layouts and workloads."""
    lines = [
        (
            f"{'model':17s} {'baseline':20s} {'% of ideal':>10s} {'x none':>7s} {'final imb':>9s} "
            f"{'peak rows':>9s} {'x mean':>6s} {'replicas':>8s} {'plan ms':>8s}"
        )
    ]
    for model in dict.fromkeys(c["model"] for c in cells):
        mine = [c for c in cells if c["model"] == model]
        mean_rows = mine[0]["mean_rows"]
        for name in baselines:
            rows = [c["rows"][name] for c in mine if name in c["rows"]]
            if not rows:
                continue
            peak = max(r["peak_rows"] for r in rows)
            lines.append(
                f"{model:17s} {name:20s} {np.mean([r['pct_ideal'] for r in rows]):9.1f}% "
                f"{np.mean([r['speedup'] for r in rows]):6.2f}x "
                f"{np.mean([r['final_imbalance'] for r in rows]):9.3f} {peak:9d} "
                f"{peak / mean_rows:6.2f} {np.mean([r['replicas'] for r in rows]):8.1f} "
                f"{np.mean([r['plan_ms'] for r in rows]):8.3f}"
            )
    return lines


def detail_table(cells: Sequence[dict], baselines: Sequence[str]) -> list[str]:
    """% of ideal per cell, one column per baseline (relay rows only; direct is in the headline)."""
    baselines = [n for n in baselines if not n.endswith("(direct)")]
    head = f"{'model':17s} {'layout':11s} {'EP':>4s} {'DP':>3s} {'workload':26s} {'init':>5s}"
    head += "".join(f" {n[:16]:>16s}" for n in baselines)
    lines = [head]
    for c in cells:
        line = (
            f"{c['model']:17s} {c['scenario']:11s} {c['ep']:4d} {c['dp']:3d} {c['workload']:26s} "
            f"{c['initial_imbalance']:5.2f}"
        )
        for n in baselines:
            line += f" {c['rows'][n]['pct_ideal']:15.1f}%" if n in c["rows"] else f" {'-':>16s}"
        lines.append(line)
    return lines


def regime_table(cells: Sequence[dict]) -> list[str]:
    """Ideal per-layer terms (ms, forward + backward) per model and layout, with copy time."""
    lines = [
        (
            f"{'model':17s} {'layout':11s} {'other':>7s} {'experts':>8s} {'4 x a2a':>8s} "
            f"{'1 copy':>7s} {'plan (CPU)':>10s}"
        )
    ]
    seen = set()
    for c in cells:
        key = (c["model"], c["scenario"])
        if key in seen:
            continue
        seen.add(key)
        t = c["ideal_layer_ms"]
        plan = c["rows"].get("ultraep", {}).get("plan_ms", float("nan"))
        lines.append(
            f"{c['model']:17s} {c['scenario']:11s} {t['other']:7.2f} {t['experts']:8.2f} "
            f"{t['a2a']:8.2f} {c['copy_ms']:7.2f} {plan:10.4f}"
        )
    return lines


def _gap_shares(rows) -> np.ndarray:
    """[3] % of the step lost to residual imbalance, planner and exposed transfer, averaged over
    the (cell, row) ``rows``."""
    gaps = np.zeros(3)  # residual imbalance, planner, exposed transfer (share of step)
    for c, r in rows:
        t, step = r["terms_s"], r["step_s"]
        gaps += np.array(
            [
                (step - c["ideal_step_s"] - t["plan"] - t["transfer_exposed"]) / step,
                t["plan"] / step,
                t["transfer_exposed"] / step,
            ]
        )
    return 100.0 * gaps / len(rows)


def _pct_with_gpu_planner(rows, gpu_plan_ms: float) -> float:
    """The mean % of the ideal of ``rows`` (the same steps) with UltraEP's GPU planner time in
    place of our CPU-measured one."""
    return float(
        np.mean(
            [
                100.0
                * c["ideal_step_s"]
                / (r["step_s"] + (gpu_plan_ms - r["plan_ms"]) * 1e-3 * c["planned_layers"])
                for c, r in rows
            ]
        )
    )


def _best_other_lines(cells, name: str, rows, pct: float) -> list[str]:
    """The best other baseline against ``name`` (``pct`` % of the ideal): why it trails."""
    lines = []
    others = {
        n: [c["rows"][n] for c in cells if n in c["rows"]]
        for n in dict.fromkeys(n for c in cells for n in c["rows"])
        if n not in (name, "none") and not n.endswith("(direct)")
    }
    if others:
        best = max(others, key=lambda n: np.mean([r["pct_ideal"] for r in others[n]]))
        b = others[best]
        b_pct = float(np.mean([r["pct_ideal"] for r in b]))
        b_xfer = 100.0 * float(np.mean([r["terms_s"]["transfer_exposed"] / r["step_s"] for r in b]))
        b_plan = 100.0 * float(np.mean([r["terms_s"]["plan"] / r["step_s"] for r in b]))
        lines.append(
            f"Against the best other baseline, {best} ({b_pct:.1f} %), ultraep gains "
            f"{pct - b_pct:.1f} points: {best} ends at max/mean "
            f"{np.mean([r['final_imbalance'] for r in b]):.3f}, moves "
            f"{np.mean([r['replicas'] for r in b]):.0f} copies per layer (ultraep "
            f"{np.mean([r['replicas'] for _, r in rows]):.0f}), and loses {b_plan:.1f} % of its "
            f"step to its planner and {b_xfer:.1f} % to exposed transfer."
        )
    return lines


def _relay_lines(direct) -> list[str]:
    """Relay against direct: the largest gain and how many cells tie."""
    lines = []
    if direct:
        gap, cell = max(direct, key=lambda dc: dc[0])
        equal = sum(abs(d) < 0.05 for d, _ in direct)
        lines.append(
            f"Relay vs direct: relay gains at most {gap:.1f} points ({cell['model']} "
            f"{cell['scenario']} {cell['workload']}); in {equal} of {len(direct)} cells the copies "
            "finish inside the dispatch all-to-all they overlap, so the two are equal."
        )
    return lines


def verdict(cells: Sequence[dict], name: str = "ultraep", gpu_plan_ms: float = 0.078) -> list[str]:
    """Where our average lands against UltraEP's 94.3 % / 1.49x, and why (from the numbers)."""
    rows = [(c, c["rows"][name]) for c in cells if name in c["rows"]]
    if not rows:
        return []
    pct = float(np.mean([r["pct_ideal"] for _, r in rows]))
    speed = float(np.mean([r["speedup"] for _, r in rows]))
    init = float(np.mean([c["initial_imbalance"] for c, _ in rows]))
    final = float(np.mean([r["final_imbalance"] for _, r in rows]))
    expert_share = 100.0 * float(np.mean([c["expert_share"] for c, _ in rows]))
    a2a_share = 100.0 * float(np.mean([c["a2a_share"] for c, _ in rows]))
    gaps = _gap_shares(rows)
    pct_gpu = _pct_with_gpu_planner(rows, gpu_plan_ms)
    direct = [
        (r["pct_ideal"] - c["rows"][f"{name} (direct)"]["pct_ideal"], c)
        for c, r in rows
        if f"{name} (direct)" in c["rows"]
    ]
    worst_c, worst_r = min(rows, key=lambda cr: cr[1]["pct_ideal"])
    trace_max = max(
        [c["initial_imbalance"] for c, _ in rows if c["workload"].startswith("trace")] or [init]
    )
    lines = [
        (
            f"Where ours lands: ultraep (relay) averages {pct:.1f} % of the force-balanced ideal "
            f"and {speed:.2f}x over none over {len(rows)} (model, layout, workload) cells; UltraEP "
            "reports 94.3 % and 1.49x."
        ),
        (
            f"Why: balancing leaves max/mean at {final:.3f} on average, so ultraep loses "
            f"{gaps[0]:.1f} % of its step to residual imbalance, {gaps[1]:.2f} % to the "
            f"(CPU-measured) planner and {gaps[2]:.2f} % to exposed replica transfer (worst cell "
            f"{worst_c['model']} {worst_c['scenario']} {worst_c['workload']}: "
            f"{worst_r['pct_ideal']:.1f} % at final max/mean {worst_r['final_imbalance']:.3f}); "
            f"with UltraEP's "
            f"{gpu_plan_ms} ms GPU planner instead it would average {pct_gpu:.1f} %. The model "
            "leaves out the overheads a GPU run adds (grouped-GEMM efficiency lost to more, "
            "smaller groups, launch latency, the planner's GPU time), which UltraEP's measured "
            "94.3 % includes; `python -m experiments.stepmodel_programs.anchor` adds those that "
            "public GPU figures let us estimate, with their band, on the anchor's setup. "
            "The speedup over none is larger than 1.49x "
            f"because {expert_share + a2a_share:.0f} % of the ideal step scales with the busiest "
            f"rank's rows here (experts {expert_share:.0f} %, all-to-all {a2a_share:.0f} %, "
            "serial, no overlap), and our workloads start at "
            f"{init:.2f} max/mean on average (real traces up to {trace_max:.1f}), against "
            "UltraEP's 1.30-4.01."
        ),
    ]
    lines += _best_other_lines(cells, name, rows, pct)
    lines += _relay_lines(direct)
    return lines
