"""The break-even report of `experiments.bench.breakeven`: its table, the break-even points and
the plot, from the measured points alone (no JAX, so that they can be checked on any numbers).

A point is one dict: ``mode`` ("train" / "prefill"), ``skew`` (the router's bias toward the hot
experts; 0: none), ``tokens`` (tokens per rank) and the busiest rank's median step in ms of the
layers: ``balanced_ms`` (balanced, capacity factor 1.05), ``dropless_ms`` (plain EP,
dropless), ``capped_ms`` (plain EP, capacity factor 1.05, which drops ``capped_dropped``
pairs) and, optionally, ``no_replica_ms`` (the balanced layer's program, dropless, on plans with
no replica: what a run-time plan that replicates nothing costs against plain dropless).
"""

from __future__ import annotations

import os

#: The plain layers balanced@1.05 is compared with: (point key, label).
BASELINES = (("dropless_ms", "plain dropless"), ("capped_ms", "plain@1.05"))


def groups(points: list[dict]) -> dict[tuple[str, float], list[dict]]:
    """``{(mode, skew): points sorted by tokens}``, in the order the (mode, skew) first appear."""
    out: dict[tuple[str, float], list[dict]] = {}
    for p in points:
        out.setdefault((p["mode"], p["skew"]), []).append(p)
    return {key: sorted(ps, key=lambda p: p["tokens"]) for key, ps in out.items()}


def break_even(points: list[dict], baseline: str) -> int | None:
    """The fewest tokens per rank from which balanced@1.05 is no slower than ``baseline`` (a key
    of `BASELINES`) at every measured count up to the largest; None when it is slower at the
    largest. ``points``: one (mode, skew), any order."""
    found = None
    for p in sorted(points, key=lambda p: p["tokens"], reverse=True):
        if p["balanced_ms"] > p[baseline]:
            break
        found = p["tokens"]
    return found


def skew_text(skew: float) -> str:
    """ "none" for 0, else the number."""
    return "none" if skew == 0 else f"{skew:g}"


def table(points: list[dict]) -> str:
    """The table: one line per point (busiest rank's ms of the three layers, the ratios), then
    the break-even per mode and skew."""
    lines = [
        f"{'mode':>8} {'skew':>5} {'tokens/rank':>11} {'balanced@1.05':>14} "
        f"{'plain dropless':>15} {'plain@1.05':>11} {'bal/dropless':>13} {'bal/plain@1.05':>15} "
        f"{'dropped@1.05':>13} {'no-replica/dropless':>20}"
    ]
    for (mode, skew), ps in groups(points).items():
        for p in ps:
            lines.append(
                f"{mode:>8} {skew_text(skew):>5} {p['tokens']:11d} {p['balanced_ms']:11.3f} ms "
                f"{p['dropless_ms']:12.3f} ms {p['capped_ms']:8.3f} ms "
                f"{p['balanced_ms'] / p['dropless_ms']:13.3f} "
                f"{p['balanced_ms'] / p['capped_ms']:15.3f} {p.get('capped_dropped', 0):13d} "
                + (
                    f"{p['no_replica_ms'] / p['dropless_ms']:20.3f}"
                    if "no_replica_ms" in p
                    else f"{'-':>20}"
                )
            )
    lines.append("\nBreak-even: the fewest tokens per rank from which balanced@1.05 is no slower")
    for (mode, skew), ps in groups(points).items():
        parts = []
        for key, label in BASELINES:
            at = break_even(ps, key)
            parts.append(f"than {label} from {'never' if at is None else at}")
        lines.append(f"  {mode:>8}, skew {skew_text(skew):>4}: " + "; ".join(parts))
    return "\n".join(lines)


def plot(points: list[dict], path: str | os.PathLike, title: str = "") -> None:
    """Writes a PNG: one panel per mode (rows) and skew (columns), balanced@1.05's step over each
    plain layer's against tokens per rank (log scale), with the line of equal time."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    by = groups(points)
    modes = list(dict.fromkeys(m for m, _ in by))
    skews = list(dict.fromkeys(s for _, s in by))
    fig = Figure(figsize=(4.2 * len(skews), 3.2 * len(modes)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(modes), len(skews), squeeze=False, sharex=True)
    for i, mode in enumerate(modes):
        for j, skew in enumerate(skews):
            ax = axes[i][j]
            ps = by.get((mode, skew), [])
            tokens = [p["tokens"] for p in ps]
            for key, label in BASELINES:
                ratio = [p["balanced_ms"] / p[key] for p in ps]
                ax.plot(tokens, ratio, marker="o", label=f"balanced@1.05 / {label}")
            ax.axhline(1.0, color="gray", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode}, skew {skew_text(skew)}", fontsize=10)
            ax.grid(True, alpha=0.3)
            if i == len(modes) - 1:
                ax.set_xlabel("tokens per rank")
            if j == 0:
                ax.set_ylabel("busiest rank's step ratio")
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(os.fspath(path), dpi=110, format="png")
