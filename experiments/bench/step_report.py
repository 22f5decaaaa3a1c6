"""The whole-step benchmark's report (`experiments.bench.step`): each mode's figures over its
rounds, the ratios, the loss check, the step split into its terms, the table and the picture.

A run's ``terms`` are its ranks' profiles of its last steps (`experiments.lab.step_terms`), seconds
per step by term, averaged over the ranks: which rank is the busiest changes from step to step
with the load, and a rank's collectives include its wait for the busiest, so the mean rank's
terms sum to the step and the imbalance shows as time in collectives (mostly the exchange's).
"""

from __future__ import annotations

import pathlib
import statistics

import numpy as np

from experiments.lab.concurrency import concurrency_line
from experiments.lab.step_terms import TERMS
from experiments.lab.stepmodel.step_ratios import RATIOS


def logged_steps(steps: int) -> list[str]:
    """The steps whose loss is reported: the first, each quarter, the last."""
    return [str(s) for s in sorted({1, *(steps * q // 4 for q in (1, 2, 3, 4))} - {0})]


def mean_terms(ranks: list[dict]) -> dict | None:
    """Every rank's terms file (`experiments.train.step_profile`) averaged over the ranks:
    ``terms_s``, ``collectives_s`` (by term), ``outside_ops_s``, ``wall_s``, ``steps``,
    ``ranks``. None when no rank was profiled."""
    if not ranks:
        return None

    def mean(get):
        return sum(get(r) for r in ranks) / len(ranks)

    return {
        "terms_s": {k: mean(lambda r, k=k: r["terms_s"][k]) for k in TERMS},
        "collectives_s": {k: mean(lambda r, k=k: r["collectives_s"][k]) for k in TERMS},
        "outside_ops_s": mean(lambda r: r["outside_ops_s"]),
        "wall_s": mean(lambda r: r["wall_s"]),
        "steps": ranks[0]["steps"],
        "ranks": len(ranks),
    }


def terms_summary(terms: list[dict]) -> dict:
    """Milliseconds per step, medians over rounds of the runs' `mean_terms`: ``terms_ms``
    by term, ``collectives_ms`` (their part in collectives), ``outside_ops_ms`` and the
    profiled steps' ``wall_ms``; ``experts_share`` = experts / wall."""

    def med(get):
        return statistics.median(get(t) * 1e3 for t in terms)

    out = {
        "terms_ms": {k: med(lambda t, k=k: t["terms_s"][k]) for k in TERMS},
        "collectives_ms": {k: med(lambda t, k=k: t["collectives_s"][k]) for k in TERMS},
        "outside_ops_ms": med(lambda t: t["outside_ops_s"]),
        "wall_ms": med(lambda t: t["wall_s"]),
        "profiled_steps": terms[0]["steps"],
    }
    out["experts_share"] = out["terms_ms"]["experts"] / out["wall_ms"]
    return out


def mode_summary(runs: list[dict]) -> dict:
    """One mode's figures over its rounds' runs: median step time with the rounds' min / max
    and spread ((max - min) / median), tokens/s (median), pairs dropped (the largest run's),
    per-layer imbalance (medians over rounds), the first round's losses at `logged_steps`, and
    the step's terms (`terms_summary`; None unless every round was profiled)."""
    times = [r["step_time_s"] for r in runs]
    terms = [r["terms"] for r in runs if r.get("terms")]
    median = statistics.median(times)
    steps = logged_steps(max(int(s) for s in runs[0]["losses"]))
    return {
        "step_time_s": {"median": median, "min": min(times), "max": max(times), "rounds": times},
        "spread": (max(times) - min(times)) / median,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "dropped_pairs": max(r["dropped_pairs"] for r in runs),
        "imbalance_before": np.median([r["imbalance_before"] for r in runs], axis=0).tolist(),
        "imbalance_after": np.median([r["imbalance_after"] for r in runs], axis=0).tolist(),
        "losses": {s: runs[0]["losses"][s] for s in steps},
        "profile": terms_summary(terms) if len(terms) == len(runs) else None,
    }


def round_ratios(rounds: list[dict]) -> dict[str, dict]:
    """`RATIOS` of each round's step times, and their median, for those whose modes ran."""
    out = {}
    for name, (a, b, scale) in RATIOS.items():
        if a in rounds[0] and b in rounds[0]:
            values = [r[a]["step_time_s"] / r[b]["step_time_s"] * scale for r in rounds]
            out[name] = {"rounds": values, "median": statistics.median(values)}
    return out


def loss_difference(rounds: list[dict]) -> float | None:
    """The largest |balanced - plain| loss over every round and step (None without both)."""
    if "balanced" not in rounds[0] or "plain" not in rounds[0]:
        return None
    return max(
        abs(r["balanced"]["losses"][s] - loss)
        for r in rounds
        for s, loss in r["plain"]["losses"].items()
    )


def gaps(modes: dict) -> dict[str, dict[str, float]]:
    """Each profiled mode's time above the ideal's, by term (ms per step, terms and outside_ops:
    their sum is the gap in profiled wall time); {} without a profiled ideal."""
    ideal = modes.get("ideal", {}).get("profile")
    if ideal is None:
        return {}
    out = {}
    for mode, s in modes.items():
        if mode != "ideal" and s["profile"] is not None:
            p = s["profile"]
            gap = {k: p["terms_ms"][k] - ideal["terms_ms"][k] for k in TERMS}
            gap["outside_ops"] = p["outside_ops_ms"] - ideal["outside_ops_ms"]
            out[mode] = gap
    return out


def case_report(rounds: list[dict]) -> dict:
    """A case's JSON: per-mode `mode_summary`, `round_ratios`, `loss_difference`, the gaps to
    the ideal by term (`gaps`), the rounds."""
    modes = {m: mode_summary([r[m] for r in rounds]) for m in rounds[0]}
    return {
        "modes": modes,
        "ratios": round_ratios(rounds),
        "loss_max_abs_diff_balanced_plain": loss_difference(rounds),
        "gap_to_ideal_ms": gaps(modes),
        "rounds": rounds,
    }


def _layers(values) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def _ms(values: dict, signed: bool = False) -> str:
    return ", ".join(f"{k} {v:+.1f}" if signed else f"{k} {v:.1f}" for k, v in values.items())


def print_case(case: str, report: dict, clock: str, rounds: int) -> None:
    """The case's data (when not the trainer's default), its table of modes (with ``clock``,
    whose clock the times are), each mode's terms, the gaps to the ideal by term, its ratios and
    its loss check."""
    data = f", data {report['data']}" if report.get("data") else ""
    print(f"\ncase {case}{data}: {clock} median step over {rounds} rounds [min-max]")
    for mode, s in report["modes"].items():
        t = s["step_time_s"]
        losses = " ".join(f"{loss:.4f}" for loss in s["losses"].values())
        print(
            f"  {mode:10s} {t['median'] * 1e3:7.1f} ms [{t['min'] * 1e3:.1f}-{t['max'] * 1e3:.1f},"
            f" spread {s['spread']:.0%}]  {s['tokens_per_s']:8.0f} tok/s  dropped "
            f"{s['dropped_pairs']}  max/mean per layer {_layers(s['imbalance_before'])} -> "
            f"{_layers(s['imbalance_after'])}  loss at steps {'/'.join(s['losses'])}: {losses}"
        )
    for mode, s in report["modes"].items():
        p = s["profile"]
        if p is not None:
            print(
                f"  {mode:10s} terms (mean rank, ms per profiled step, median of rounds): "
                f"{_ms(p['terms_ms'])}, outside ops {p['outside_ops_ms']:.1f} = "
                f"{p['wall_ms']:.1f}; in collectives {sum(p['collectives_ms'].values()):.1f}"
                f"; experts {p['experts_share']:.0%} of the step"
            )
    for mode, gap in report["gap_to_ideal_ms"].items():
        print(
            f"  {mode} - ideal by term (ms): {_ms(gap, signed=True)}; sum {sum(gap.values()):+.1f}"
        )
    for name, ratio in report["ratios"].items():
        values = " ".join(f"{v:.3f}" for v in ratio["rounds"])
        print(f"  {name}: {ratio['median']:.3f} (median of rounds {values})")
    if report["loss_max_abs_diff_balanced_plain"] is not None:
        diff = report["loss_max_abs_diff_balanced_plain"]
        print(f"  balanced vs plain loss, largest difference over rounds and steps: {diff:.2e}")


def calibration_summary(results: dict) -> dict | None:
    """The runs' calibration ratios and the line of the run at their median (None unpinned)."""
    cals = [r["calibration"] for rs in results.values() for rd in rs for r in rd.values()]
    cals = sorted((c for c in cals if c), key=lambda c: c["ratio"])
    if not cals:
        return None
    return {"ratios": [c["ratio"] for c in cals], "line": concurrency_line(cals[len(cals) // 2])}


def _plot_case(ax, case: str, modes: dict, clock: str) -> None:
    """One case's bars: each mode's profiled step stacked by term (mean rank; outside ops on
    top when positive), and its median unprofiled step as a dot with whiskers at the rounds'
    min and max. Without profiles, the bars are the median steps alone."""
    names = list(modes)
    times = [modes[m]["step_time_s"] for m in names]
    median = np.array([t["median"] for t in times]) * 1e3
    whiskers = np.array([[t["median"] - t["min"], t["max"] - t["median"]] for t in times]).T * 1e3
    profiles = [modes[m]["profile"] for m in names]
    if all(p is not None for p in profiles):
        bottom = np.zeros(len(names))
        parts = [*TERMS, "outside ops"]
        for i, term in enumerate(parts):
            ms = np.array(
                [
                    max(p["outside_ops_ms"], 0.0) if term == "outside ops" else p["terms_ms"][term]
                    for p in profiles
                ]
            )
            if ms.any():
                ax.bar(names, ms, bottom=bottom, color=f"C{i}", label=term.replace("_", " "))
                bottom += ms
    else:
        ax.bar(names, median, color="C0", label="median step")
    ax.errorbar(
        names,
        median,
        yerr=whiskers,
        fmt="o",
        color="k",
        capsize=5,
        label="median step (unprofiled), min-max",
    )
    rounds = len(times[0]["rounds"])
    ax.set_title(f"{case} ({rounds} round{'s' if rounds != 1 else ''})")
    ax.set_ylabel(f"{clock} step (ms)")
    ax.grid(axis="y", alpha=0.3)


def figure(report: dict, clock: str):
    """The report's picture (a matplotlib ``Figure``, Agg canvas): a bar chart per case
    (`_plot_case`), the modes' steps split into their terms, the legend beside the panels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cases = report["cases"]
    fig = Figure(figsize=(6 + 4 * len(cases), 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(cases), squeeze=False)[0]
    for ax, (case, data) in zip(axes, cases.items(), strict=True):
        _plot_case(ax, case, data["modes"], clock)
    handles, labels = axes[0].get_legend_handles_labels()
    # Beside the panels' middle: at their top it ran into the two-line title.
    fig.legend(handles[::-1], labels[::-1], loc="outside right center", fontsize=8)
    fig.suptitle(
        "training step by mode against the force-balanced ideal, split into terms by a profile\n"
        "of the last steps (mean of the ranks: waiting for the busiest counts in the collectives)"
    )
    return fig


def plot(report: dict, path: pathlib.Path, clock: str) -> None:
    """Writes the report's `figure` to ``path`` (PNG)."""
    figure(report, clock).savefig(path, dpi=110)
