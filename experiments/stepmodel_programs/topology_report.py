"""The report of `experiments.stepmodel_programs.topology`: its tables (markdown) and its plot, from
the rows of `topology_cells.evaluate`."""

from __future__ import annotations

import numpy as np

TRACE_LABELS = {
    "deepseek-r1": "DeepSeek-R1",
    "qwen1.5-moe": "Qwen1.5-MoE",
    "switch-base-128": "Switch-Base-128",
}
TOPOLOGY_LABELS = {"hgx-h100": "8-GPU nodes", "gb200-nvl72": "NVL72"}
#: The plot's panel titles per topology (the layouts EP32-128 take).
PLOT_TITLES = {
    "hgx-h100": "8-GPU nodes (d=8)",
    "gb200-nvl72": "NVL72 (EP32, EP64: one domain; EP128: 2 racks x 64)",
}


def _three(s: dict, digits: int) -> str:
    """``median / p90 / max`` of a `summary`, 0 when all are."""
    if s["max"] == 0:
        return "0"
    return " / ".join(f"{s[k]:.{digits}f}" for k in ("median", "p90", "max"))


def table(rows: list[dict]) -> list[str]:
    """The markdown table: per trace, EP, topology and policy, the per-layer figures (median /
    p90 / max over layers; % of ideal: median / min)."""
    lines = [
        "| trace (model) | EP | topology (d) | policy | slow-link GB per layer | transfer, ms "
        "| exposed, ms | exposed, % of ideal layer | % of ideal (median / min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pct = r["pct_ideal"]
        lines.append(
            f"| {TRACE_LABELS[r['trace']]} ({r['model']}) | {r['ep']} "
            f"| {TOPOLOGY_LABELS[r['topology']]} (d={r['domain']}) | {r['policy']} "
            f"| {_three(r['slow_gb'], 2)} | {_three(r['transfer_ms'], 1)} "
            f"| {_three(r['exposed_ms'], 1)} | {_three(r['exposed_pct'], 1)} "
            f"| {pct['median']:.1f} / {pct['min']:.1f} |"
        )
    return lines


def regime_table(rows: list[dict]) -> list[str]:
    """The markdown table of what each cell's transfer is weighed against."""
    lines = [
        "| trace (model) | EP | topology | layout | layers | one copy, MB | one all-to-all, ms "
        "| ideal layer, ms | aware vs blind, layers: fewer slow-link copies; transfer shorter "
        "/ longer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["policy"] != "aware":
            continue
        vs = r["vs_blind"]
        lines.append(
            f"| {TRACE_LABELS[r['trace']]} ({r['model']}, E={r['experts']}) | {r['ep']} "
            f"| {TOPOLOGY_LABELS[r['topology']]} | {r['layout']} | {r['layers']} "
            f"| {r['copy_mb']:.1f} | {r['a2a_ms']:.2f} | {r['ideal_layer_ms']:.1f} "
            f"| {vs['slow_fewer']}; {vs['transfer_shorter']} / {vs['transfer_longer']} |"
        )
    return lines


def plot(rows: list[dict], path) -> None:
    """Writes a PNG: per topology (rows of panels) the blind and aware schedules' slow-link GB
    and transfer per layer (bars at the median, whiskers to the worst layer) and the worst
    layer's exposed transfer, for each trace and EP size; the transfer panel marks one token
    all-to-all (what the transfer may take before any of it is exposed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    topos = list(dict.fromkeys(r["topology"] for r in rows))
    metrics = [
        ("slow_gb", "median", "slow-link GB per layer"),
        ("transfer_ms", "median", "transfer per layer, ms (one direction)"),
        ("exposed_ms", "max", "worst layer's exposed transfer, ms"),
    ]
    short = {"deepseek-r1": "DS-R1", "qwen1.5-moe": "Qwen1.5", "switch-base-128": "Switch"}
    fig = Figure(figsize=(15, 3.6 * len(topos)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(topos), len(metrics), squeeze=False)
    for i, name in enumerate(topos):
        cells = [r for r in rows if r["topology"] == name]
        groups = list(dict.fromkeys((r["trace"], r["ep"]) for r in cells))
        x = np.arange(len(groups))
        labels = [f"{short[t]}\nEP{ep}" for t, ep in groups]
        for j, (key, stat, title) in enumerate(metrics):
            ax = axes[i][j]
            for k, policy in enumerate(("blind", "aware")):
                got = {(r["trace"], r["ep"]): r[key] for r in cells if r["policy"] == policy}
                bar = np.array([got[g][stat] for g in groups])
                at = x + (k - 0.5) * 0.38
                ax.bar(at, bar, 0.38, label=policy)
                if stat == "median":
                    top = np.array([got[g]["max"] for g in groups])
                    whisker = [0 * bar, top - bar]
                    ax.errorbar(at, bar, yerr=whisker, fmt="none", ecolor="black", capsize=2)
            if key == "transfer_ms":
                a2a = {(r["trace"], r["ep"]): r["a2a_ms"] for r in cells}
                marks = [a2a[g] for g in groups]
                ax.scatter(x, marks, marker="_", s=300, color="red", label="one all-to-all")
            ax.set_xticks(x, labels, fontsize=8)
            ax.set_title(f"{PLOT_TITLES[name]}:\n{title}", fontsize=9)
            ax.grid(True, axis="y", alpha=0.3)
        axes[i][1].legend(fontsize=8)
    fig.suptitle(
        "Replica transfer per layer, topology-blind vs topology-aware relay schedule (f=2): "
        "bars at the median layer, whiskers to the worst. Modelled, not measured.",
        fontsize=10,
    )
    fig.savefig(str(path), dpi=100, format="png")
