"""Plot and summarize a training run's ``metrics.jsonl`` (host only, no JAX).

``metrics.jsonl`` holds one JSON object per logged step with at least ``step`` and ``loss``, and
optionally ``eval_loss``, per-layer lists ``imbalance_before`` / ``imbalance_after`` (max/mean
rank load before and after balancing), ``balance`` (the mode), ``dropped`` (tokens dropped: a
number or a per-layer list), ``tokens_per_s`` and ``step_time`` (seconds), and ``compiling``
(true on the first step of each start of the run, whose time includes compiling the step), as the
trainer writes them.

* :func:`plot_metrics` -- one PNG: loss (and eval loss) on top, per-layer imbalance below, and
  the imbalance after balancing zoomed in (`metrics_figure`).
* :func:`summarize` -- a short multi-line text summary.

matplotlib is imported inside :func:`metrics_figure` only (Agg canvas, no pyplot state).
"""

from __future__ import annotations

import math
import os
import pathlib

import numpy as np

from experiments.lab.records import read_metrics

__all__ = [
    "left_out_text",
    "marker_indices",
    "metrics_figure",
    "plot_metrics",
    "summarize",
    "timed_records",
]


def _per_layer(records: list[dict], key: str) -> np.ndarray:
    """float64 ``[T, L]`` of the per-layer list ``key`` (NaN where a record lacks it)."""
    rows = [record.get(key) or [] for record in records]
    num_layers = max((len(row) for row in rows), default=0)
    out = np.full((len(records), num_layers), np.nan)
    for t, row in enumerate(rows):
        out[t, : len(row)] = [np.nan if v is None else float(v) for v in row]
    return out


def _balance_modes(records: list[dict]) -> list[str]:
    modes = []
    for record in records:
        mode = record.get("balance")
        if mode is not None and str(mode) not in modes:
            modes.append(str(mode))
    return modes


def _steps_losses(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of the records where ``key`` is present and not null."""
    pairs = [(r["step"], float(r[key])) for r in records if r.get(key) is not None]
    steps = np.array([p[0] for p in pairs], dtype=np.int64)
    return steps, np.array([p[1] for p in pairs], dtype=np.float64)


def timed_records(records: list[dict]) -> list[dict]:
    """The records whose step time and tokens/s count: all but the first step of each start of
    the run (the first run and every resume), whose time includes compiling the step, and the
    steps traced by ``--profile_steps``. Those carry ``"compiling": true`` / ``"profiled":
    true``; in a file without the first mark, the first record is left out."""
    if any("compiling" in r for r in records):
        return [r for r in records if not r.get("compiling") and not r.get("profiled")]
    return [r for r in records[1:] if not r.get("profiled")]


# --------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------


def plot_metrics(metrics_path, png_path) -> pathlib.Path:
    """Writes one PNG of a run (`metrics_figure` of its records).

    Returns:
      ``png_path`` as a Path (parent directories are created).
    """
    fig = metrics_figure(read_metrics(metrics_path))
    png_path = pathlib.Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(os.fspath(png_path), dpi=110, format="png")
    return png_path


#: Marker shapes of the layers' lines in the zoomed panel (cycled past ten layers).
_MARKERS = "osD^v<>pX*"


def marker_indices(num_points: int, num_layers: int, layer: int, per_layer: int = 12):
    """int ``[K]``: the points of layer ``layer``'s line that get a marker. About ``per_layer``
    evenly spaced ones, shifted per layer so that no two layers mark the same point: lines lying
    on each other still show every layer's markers."""
    every = max(1, num_points // (per_layer * num_layers))
    return np.arange(layer * every, num_points, every * num_layers)


def _loss_panel(ax, steps, losses, records: list[dict]) -> None:
    """The train loss vs step, and the eval loss where logged."""
    ax.plot(steps, losses, color="C0", label="train loss")
    eval_steps, eval_losses = _steps_losses(records, "eval_loss")
    if eval_steps.size:
        ax.plot(eval_steps, eval_losses, "o-", color="C3", markersize=4, label="eval loss")
    ax.set_ylabel("cross-entropy loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")


def _layer_lines(ax_imb, ax_after, steps, before, after, num_layers: int) -> list:
    """Each layer's before (dashed) and after (solid) lines, and on ``ax_after`` (when not None)
    the after lines with markers of the layer's own; the legend handles of the layers."""
    from matplotlib.lines import Line2D

    colors = _layer_colors(num_layers)
    handles = []
    for layer in range(num_layers):
        color, marker = colors[layer], _MARKERS[layer % len(_MARKERS)]
        if layer < before.shape[1]:
            ax_imb.plot(steps, before[:, layer], "--", color=color, linewidth=1.2)
        if layer < after.shape[1]:
            ax_imb.plot(steps, after[:, layer], "-", color=color, linewidth=1.5)
            if ax_after is not None:
                ax_after.plot(
                    steps,
                    after[:, layer],
                    "-",
                    color=color,
                    linewidth=1.2,
                    marker=marker,
                    markersize=5,
                    markevery=list(marker_indices(len(steps), num_layers, layer)),
                )
        handles.append(
            Line2D(
                [],
                [],
                color=color,
                marker=marker if ax_after is not None else "",
                label=f"layer {layer}",
            )
        )
    return handles


def _imbalance_panel(ax_imb, ax_after, steps, before, after) -> None:
    """Max/mean rank load before and after balancing per layer, a line at 1.0 and the legend."""
    from matplotlib.lines import Line2D

    num_layers = max(before.shape[1], after.shape[1])
    if num_layers:
        handles = _layer_lines(ax_imb, ax_after, steps, before, after, num_layers)
        handles += [
            Line2D([], [], color="gray", linestyle="--", label="before balancing"),
            Line2D([], [], color="gray", linestyle="-", label="after balancing"),
        ]
        ax_imb.legend(
            handles=handles,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            fontsize="small",
            ncol=max(1, math.ceil(len(handles) / 18)),
        )
    else:
        ax_imb.text(
            0.5, 0.5, "no imbalance data", ha="center", va="center", transform=ax_imb.transAxes
        )
    ax_imb.axhline(1.0, color="black", linewidth=0.8)
    ax_imb.set_ylabel("max / mean rank load")
    ax_imb.grid(alpha=0.3)


def _zoom_panel(ax, after) -> None:
    """The after-balancing panel's y-axis zoomed to the lines' range (and 1.0)."""
    lo = min(1.0, float(np.nanmin(after)))
    hi = max(1.0, float(np.nanmax(after)))
    pad = max(0.002, 0.15 * (hi - lo))
    ax.set_ylim(lo - pad, hi + pad)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("after balancing\n(zoomed)")
    ax.grid(alpha=0.3)


def metrics_figure(records: list[dict]):
    """The figure of a run's metrics records (a matplotlib ``Figure``, Agg canvas).

    Top panel: train loss vs step (and eval loss where logged). Middle panel: for each layer, the
    max/mean rank load before balancing (dashed) and after (solid, same color) vs step, with a
    horizontal line at 1.0 (perfect balance). Bottom panel (when any layer has an after value):
    the after-balancing lines alone on a y-axis zoomed to their range, each layer with markers of
    its own shape at points no other layer marks, so that layers balanced to the same value stay
    visible. The title names the balance mode when the records carry a ``balance`` key.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = np.array([r["step"] for r in records], dtype=np.int64)
    losses = np.array([float(r["loss"]) for r in records])
    before = _per_layer(records, "imbalance_before")
    after = _per_layer(records, "imbalance_after")
    zoom = bool(np.isfinite(after).any())

    fig = Figure(figsize=(10, 9.5 if zoom else 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_after = None
    if zoom:
        ax_loss, ax_imb, ax_after = fig.subplots(
            3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 3, 1.8]}
        )
    else:
        ax_loss, ax_imb = fig.subplots(2, 1, sharex=True)
    _loss_panel(ax_loss, steps, losses, records)
    _imbalance_panel(ax_imb, ax_after, steps, before, after)
    if zoom:
        _zoom_panel(ax_after, after)
    (ax_after if zoom else ax_imb).set_xlabel("step")

    modes = _balance_modes(records)
    title = "MoE LM training" + (f": balance={', '.join(modes)}" if modes else "")
    subtitle = f"{len(records)} logged steps (step {steps[0]} .. {steps[-1]}), "
    subtitle += f"final loss {losses[-1]:.4f}"
    fig.suptitle(f"{title}\n{subtitle}")
    return fig


def _layer_colors(num_layers: int) -> list:
    """One color per layer: tab10 up to 10 layers, else evenly spaced viridis."""
    import matplotlib

    if num_layers <= 10:
        cmap = matplotlib.colormaps["tab10"]
        return [cmap(i) for i in range(num_layers)]
    cmap = matplotlib.colormaps["viridis"]
    return [cmap(i / (num_layers - 1)) for i in range(num_layers)]


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------


def _steps_text(steps: list[int]) -> str:
    """``step 1``, ``steps 1, 4``, ``steps 8-10``: runs of consecutive steps as ranges."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    parts = [str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs]
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(parts)}"


def left_out_text(records: list[dict], timed: list[dict]) -> str:
    """Which of ``records``' steps the medians leave out (those not in ``timed``), and why:
    ``step 1, compiling; steps 8-10, profiled`` (traced by ``--profile_steps``)."""
    timed_steps = {r["step"] for r in timed}
    out = [r for r in records if r["step"] not in timed_steps]
    groups = (
        ([r["step"] for r in out if not r.get("profiled")], "compiling"),
        ([r["step"] for r in out if r.get("profiled")], "profiled"),
    )
    return "; ".join(f"{_steps_text(steps)}, {why}" for steps, why in groups if steps)


def _nan_stat(fn, column: np.ndarray) -> float:
    column = column[~np.isnan(column)]
    return float(fn(column)) if column.size else math.nan


def _total_dropped(records: list[dict]) -> int | None:
    """Sum of ``dropped`` (a number or per-layer list) over the records; None if never logged."""
    values = [r["dropped"] for r in records if r.get("dropped") is not None]
    if not values:
        return None
    return int(sum(float(np.sum(np.asarray(v, dtype=np.float64))) for v in values))


def summarize(metrics_path) -> str:
    """A short multi-line text summary of a run's ``metrics.jsonl``.

    Lines: balance mode and logged steps; first and last train loss; last eval loss; for each
    layer the mean and max over logged steps of the imbalance before and after balancing; the
    total dropped (token, choice) pairs over logged steps (if ``dropped`` is logged); the median
    tokens/s and step time over the logged steps but each start's first, which includes compiling
    the step, and those traced by ``--profile_steps`` (`timed_records`; `left_out_text` names
    them), or ``no timed step`` when no other step is left.
    """
    records = read_metrics(metrics_path)
    first, last = records[0], records[-1]
    modes = _balance_modes(records)
    mode = ", ".join(modes) if modes else "?"
    lines = [
        f"run: balance={mode}, {len(records)} logged (steps {first['step']} .. {last['step']})"
    ]
    lines.append(
        f"loss: first {float(first['loss']):.4f} (step {first['step']}), "
        f"last {float(last['loss']):.4f} (step {last['step']})"
    )
    eval_steps, eval_losses = _steps_losses(records, "eval_loss")
    if eval_steps.size:
        lines.append(f"eval loss: last {eval_losses[-1]:.4f} (step {eval_steps[-1]})")

    before = _per_layer(records, "imbalance_before")
    after = _per_layer(records, "imbalance_after")
    num_layers = max(before.shape[1], after.shape[1])
    if num_layers:
        lines.append("imbalance max/mean per layer over logged steps, mean [max]: before -> after")
        for layer in range(num_layers):
            parts = []
            for table in (before, after):
                if layer < table.shape[1]:
                    col = table[:, layer]
                    parts.append(f"{_nan_stat(np.mean, col):.3f} [{_nan_stat(np.max, col):.3f}]")
                else:
                    parts.append("n/a")
            lines.append(f"  layer {layer}: {parts[0]} -> {parts[1]}")

    dropped = _total_dropped(records)
    if dropped is not None:
        lines.append(f"dropped pairs: {dropped} in total over logged steps")
    timed = timed_records(records)
    throughput = [float(r["tokens_per_s"]) for r in timed if r.get("tokens_per_s") is not None]
    step_times = [float(r["step_time"]) for r in timed if r.get("step_time") is not None]
    left_out = f"left out: {left_out_text(records, timed)}"
    if throughput:
        lines.append(
            f"tokens/s: median {np.median(throughput):.1f} over {len(throughput)} "
            f"step{'s' if len(throughput) != 1 else ''} "
            f"({left_out})"
        )
    if step_times:
        lines.append(f"step time: median {1e3 * np.median(step_times):.2f} ms")
    if not (throughput or step_times) and any("step_time" in r for r in records):
        lines.append(f"tokens/s, step time: no timed step ({left_out})")
    return "\n".join(lines)
