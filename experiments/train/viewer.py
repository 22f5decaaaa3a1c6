"""A self-contained HTML viewer for a training run's expert loads (host only, no JAX).

    python -m experiments.train.viewer --workdir=runs/ultraep [--out=runs/ultraep/viewer.html]

Reads ``<workdir>/metrics.jsonl`` (one record per step: ``step``, ``loss`` and the per-layer lists
``imbalance_before``, ``imbalance_after``, ``replicas``, ``dropped`` and, from runs that record
it, ``transfer_send_max``) and, when the run had
``--profile_loads``, ``<workdir>/loads.jsonl`` (per step and layer: ``expert_load``,
``rank_load_before``, ``rank_load_after``, ``replicas``, ``dropped``). Writes ONE HTML file with the
data embedded as JSON and inline CSS/JS that draws SVG charts: nothing is fetched at view time. The
page, its CSS and its script are the files in ``experiments/train/static/`` (``page.html``,
``viewer.css``, ``viewer.js``), inlined into that file.

The page has a layer selector and a step slider and shows, for the selection:

* ``#summary``: e.g. ``step 12, layer 1: max/mean 2.31 -> 1.01, replicas 5, dropped 0``, with the
  numbers also in ``#imbalance-before``, ``#imbalance-after``, ``#replicas`` and ``#dropped``, and
  the replica transfer's largest per-rank send (MB) in ``#transfer-send-max``;
* per-rank load before balancing (stacked by the rank's master experts; expert ``e`` lives on rank
  ``e // (E / R)``) next to the load after balancing, with the mean as a dashed line, and the same
  numbers in a table (``#rank-table``); and the per-expert load (needs ``--profile_loads``; without
  it ``#no-loads`` says so);
* max/mean rank load over steps before vs after balancing for the selected layer
  (``#imbalance-chart``) and replicas per step (``#replicas-chart``); click a chart to pick a step;
* every layer at the selected step (``#layer-table``, with each layer's largest per-rank send).

URL parameters ``?step=S&layer=L`` (a logged step number, a 0-based layer) pick the initial
selection; without them the page opens at the last step, layer 0. Layers are numbered from 0.
Use the arrow keys on the slider (or the prev/next buttons) to move through steps.
"""

from __future__ import annotations

import functools
import html
import importlib.resources
import json
import math
import pathlib
import re
import sys

from absl import app, flags

from experiments.lab import records
from experiments.lab.program import run_main
from experiments.lab.training.workdir import METRICS_FILE, PROFILE_FILE

__all__ = ["build_html", "main", "write_viewer"]

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding metrics.jsonl.")
_OUT = flags.DEFINE_string("out", None, "Output HTML file (default <workdir>/viewer.html).")


# --------------------------------------------------------------------------------------------
# Building the page
# --------------------------------------------------------------------------------------------


def _number(value):
    """A JSON-safe number: None for missing or non-finite values (JSON has no NaN/inf)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(value):
        return None
    return int(value) if value.is_integer() and abs(value) < 2**53 else value


def _numbers(values) -> list:
    """A per-layer list (or a scalar, read as one layer) as a list of JSON-safe numbers."""
    if values is None:
        return []
    if not isinstance(values, (list, tuple)):
        values = [values]
    return [_number(v) for v in values]


def _page_data(metrics_records: list[dict], load_records: list[dict]) -> dict:
    """The compact data the page's script reads: per step, per layer."""
    loads_by_step = {int(r["step"]): r.get("layers") or [] for r in load_records or []}
    steps, loss, eval_loss, layers_data = [], [], [], []
    balance = None
    num_layers = 0
    for record in sorted(metrics_records, key=lambda r: int(r["step"])):
        step = int(record["step"])
        steps.append(step)
        loss.append(_number(record.get("loss")))
        eval_loss.append(_number(record.get("eval_loss")))
        balance = record.get("balance", balance)
        metric = {
            key: _numbers(record.get(key))
            for key in (
                "imbalance_before",
                "imbalance_after",
                "replicas",
                "dropped",
                "transfer_send_max",
            )
        }
        profile = loads_by_step.get(step, [])
        count = max([len(v) for v in metric.values()] + [len(profile)])
        num_layers = max(num_layers, count)
        row = []
        for layer in range(count):
            entry = {
                "ib": _at(metric["imbalance_before"], layer),
                "ia": _at(metric["imbalance_after"], layer),
                "rep": _at(metric["replicas"], layer),
                "drop": _at(metric["dropped"], layer),
                "send": _at(metric["transfer_send_max"], layer),
            }
            if layer < len(profile) and isinstance(profile[layer], dict):
                p = profile[layer]
                entry["el"] = _numbers(p.get("expert_load"))
                entry["rb"] = _numbers(p.get("rank_load_before"))
                entry["ra"] = _numbers(p.get("rank_load_after"))
                # Metrics first (what the run reported); the profile fills gaps.
                if entry["rep"] is None:
                    entry["rep"] = _number(p.get("replicas"))
                if entry["drop"] is None:
                    entry["drop"] = _number(p.get("dropped"))
            row.append(entry)
        layers_data.append(row)
    return {
        "steps": steps,
        "loss": loss,
        "evalLoss": eval_loss,
        "balance": balance,
        "numLayers": num_layers,
        "hasLoads": bool(loads_by_step),
        "layers": layers_data,
    }


def _at(values: list, index: int):
    return values[index] if index < len(values) else None


def _embed_json(data) -> str:
    """JSON that is safe inside a ``<script>`` element (no ``</script>``, no HTML specials)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def build_html(metrics_records: list[dict], load_records: list[dict] | None = None) -> str:
    """The viewer page for ``metrics.jsonl`` records (and ``loads.jsonl`` records, if any).

    Args:
      metrics_records: dicts with ``step`` and the per-layer lists ``imbalance_before``,
        ``imbalance_after``, ``replicas``, ``dropped``, ``transfer_send_max`` (bytes; missing
        keys show as "n/a").
      load_records: dicts ``{"step": s, "layers": [{"expert_load", "rank_load_before",
        "rank_load_after", "replicas", "dropped"}, ...]}``; None or empty without a profile.

    Returns:
      One self-contained HTML document (inline CSS and JS, data embedded as JSON).
    """
    if not metrics_records:
        raise ValueError("no metrics records")
    data = _page_data(metrics_records, load_records or [])
    title = "Expert loads" + (f" ({data['balance']})" if data["balance"] else "")
    parts = {
        "TITLE": html.escape(title),
        "CSS": _static("viewer.css"),
        "JS": _static("viewer.js"),
        "DATA": _embed_json(data),
    }
    # One pass, so that no substituted text is itself searched for placeholders.
    return re.sub(r"__(TITLE|CSS|JS|DATA)__", lambda m: parts[m.group(1)], _static("page.html"))


@functools.cache
def _static(name: str) -> str:
    """The text of ``static/<name>``, a file shipped next to this module."""
    return importlib.resources.files(__package__).joinpath("static", name).read_text("utf-8")


def write_viewer(workdir, out=None) -> pathlib.Path:
    """Reads ``workdir``'s metrics (and loads, if profiled) and writes the page; returns its path.

    Raises:
      FileNotFoundError: ``workdir`` has no ``metrics.jsonl``.
      ValueError: a file is malformed.
    """
    workdir = pathlib.Path(workdir)
    metrics_path = workdir / METRICS_FILE
    if not metrics_path.is_file():
        raise FileNotFoundError(
            f"no {METRICS_FILE} in {workdir} (write one with: python -m experiments.train "
            f"--workdir={workdir} [--profile_loads])"
        )
    metrics_records = records.read_metrics(metrics_path)
    loads_path = workdir / PROFILE_FILE
    load_records = records.read_loads(loads_path) if loads_path.is_file() else []
    out = pathlib.Path(out) if out else workdir / "viewer.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build_html(metrics_records, load_records), encoding="utf-8")
    return out


def main(argv):
    """``python -m experiments.train.viewer``: writes the page of ``--workdir`` (to ``--out``);
    a missing or malformed input ends with one line ``viewer: ...`` (exit code 2)."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not _WORKDIR.value:
        print("viewer: --workdir is required", file=sys.stderr)
        sys.exit(2)
    try:
        out = write_viewer(_WORKDIR.value, _OUT.value)
    except (OSError, ValueError) as e:
        print(f"viewer: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out}")


if __name__ == "__main__":
    run_main(main)
