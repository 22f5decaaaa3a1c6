"""A self-contained HTML viewer for a training run's expert loads (host only, no JAX).

    python -m experiments.train.viewer --workdir=runs/ultraep [--out=runs/ultraep/viewer.html]

Reads ``<workdir>/metrics.jsonl`` (one record per step: ``step``, ``loss`` and the per-layer lists
``imbalance_before``, ``imbalance_after``, ``replicas``, ``dropped``) and, when the run had
``--profile_loads``, ``<workdir>/loads.jsonl`` (per step and layer: ``expert_load``,
``rank_load_before``, ``rank_load_after``, ``replicas``, ``dropped``). Writes ONE HTML file with the
data embedded as JSON and inline CSS/JS that draws SVG charts: nothing is fetched at view time.

The page has a layer selector and a step slider and shows, for the selection:

* ``#summary``: e.g. ``step 12, layer 1: max/mean 2.31 -> 1.01, replicas 5, dropped 0``, with the
  numbers also in ``#imbalance-before``, ``#imbalance-after``, ``#replicas`` and ``#dropped``;
* per-rank load before balancing (stacked by the rank's master experts; expert ``e`` lives on rank
  ``e // (E / R)``) next to the load after balancing, with the mean as a dashed line, and the same
  numbers in a table (``#rank-table``); and the per-expert load (needs ``--profile_loads``; without
  it ``#no-loads`` says so);
* max/mean rank load over steps before vs after balancing for the selected layer
  (``#imbalance-chart``) and replicas per step (``#replicas-chart``); click a chart to pick a step;
* every layer at the selected step (``#layer-table``).

URL parameters ``?step=S&layer=L`` (a logged step number, a 0-based layer) pick the initial
selection; without them the page opens at the last step, layer 0. Layers are numbered from 0.
Use the arrow keys on the slider (or the prev/next buttons) to move through steps.
"""

from __future__ import annotations

import html
import json
import math
import pathlib
import re
import sys

from absl import app, flags

from experiments.train import plot

__all__ = ["build_html", "main", "read_loads", "write_viewer"]

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding metrics.jsonl.")
_OUT = flags.DEFINE_string("out", None, "Output HTML file (default <workdir>/viewer.html).")


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def read_loads(loads_path) -> list[dict]:
    """The records of a ``loads.jsonl`` file, one per step, sorted by ``step`` (see
    `plot.read_step_records`); each needs ``step`` and ``layers``."""
    return plot.read_step_records(loads_path, ("step", "layers"))


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
            for key in ("imbalance_before", "imbalance_after", "replicas", "dropped")
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
        ``imbalance_after``, ``replicas``, ``dropped`` (missing keys show as "n/a").
      load_records: dicts ``{"step": s, "layers": [{"expert_load", "rank_load_before",
        "rank_load_after", "replicas", "dropped"}, ...]}``; None or empty without a profile.

    Returns:
      One self-contained HTML document (inline CSS and JS, data embedded as JSON).
    """
    if not metrics_records:
        raise ValueError("no metrics records")
    data = _page_data(metrics_records, load_records or [])
    title = "Expert loads" + (f" ({data['balance']})" if data["balance"] else "")
    parts = {"TITLE": html.escape(title), "CSS": _CSS, "JS": _JS, "DATA": _embed_json(data)}
    # One pass, so that no substituted text is itself searched for placeholders.
    return re.sub(r"__(TITLE|CSS|JS|DATA)__", lambda m: parts[m.group(1)], _TEMPLATE)


def write_viewer(workdir, out=None) -> pathlib.Path:
    """Reads ``workdir``'s metrics (and loads, if profiled) and writes the page; returns its path.

    Raises:
      FileNotFoundError: ``workdir`` has no ``metrics.jsonl``.
      ValueError: a file is malformed.
    """
    workdir = pathlib.Path(workdir)
    metrics_path = workdir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(
            f"no metrics.jsonl in {workdir} (write one with: python -m experiments.train "
            f"--workdir={workdir} [--profile_loads])"
        )
    metrics_records = plot.read_metrics(metrics_path)
    loads_path = workdir / "loads.jsonl"
    load_records = read_loads(loads_path) if loads_path.is_file() else []
    out = pathlib.Path(out) if out else workdir / "viewer.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build_html(metrics_records, load_records), encoding="utf-8")
    return out


def main(argv):
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


# --------------------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------------------

_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>__CSS__</style>
</head>
<body>
<script>
window.viewerErrors = [];
window.addEventListener("error", function (e) {
  window.viewerErrors.push(String(e.message));
  document.documentElement.setAttribute("data-error", String(e.message));
});
</script>
<header>
  <h1>__TITLE__</h1>
  <div id="run-info"></div>
</header>
<section id="controls">
  <label>Layer <select id="layer"></select></label>
  <button id="prev" type="button" title="previous step">&#9664;</button>
  <label class="slider">Step <input id="step" type="range" min="0" max="0" value="0"></label>
  <button id="next" type="button" title="next step">&#9654;</button>
  <span id="step-label"></span>
</section>
<section id="numbers">
  <p id="summary"></p>
  <dl>
    <div><dt>max/mean before</dt><dd id="imbalance-before"></dd></div>
    <div><dt>max/mean after</dt><dd id="imbalance-after"></dd></div>
    <div><dt>replicas</dt><dd id="replicas"></dd></div>
    <div><dt>dropped</dt><dd id="dropped"></dd></div>
    <div><dt>loss</dt><dd id="loss"></dd></div>
  </dl>
</section>
<main>
  <section class="panel" id="rank-panel">
    <h2>Rank load before vs after balancing</h2>
    <p id="no-loads" class="note" hidden>Per-rank load stacks need a run with
      <code>--profile_loads</code> (this workdir has no <code>loads.jsonl</code>).</p>
    <p id="no-step-loads" class="note" hidden>No load profile was recorded for this step.</p>
    <div id="rank-chart" class="chart"></div>
    <div class="legend" id="rank-legend"></div>
    <table id="rank-table"></table>
  </section>
  <section class="panel" id="expert-panel">
    <h2>Expert load (tokens routed to each expert)</h2>
    <div id="expert-chart" class="chart"></div>
  </section>
  <section class="panel">
    <h2>Imbalance (max/mean rank load) over steps, selected layer</h2>
    <div id="imbalance-chart" class="chart"></div>
    <div class="legend"><span class="key before"></span>before <span class="key after"></span>after
      <span class="key ideal"></span>1.0 (perfect balance)</div>
  </section>
  <section class="panel">
    <h2>Replicas per step, selected layer</h2>
    <div id="replicas-chart" class="chart"></div>
  </section>
  <section class="panel wide">
    <h2>All layers at the selected step</h2>
    <table id="layer-table"></table>
  </section>
</main>
<script id="viewer-data" type="application/json">__DATA__</script>
<script>__JS__</script>
</body>
</html>
"""

_CSS = """
:root { --before: #d9622b; --after: #2b7bb9; --ink: #222; --muted: #777; --grid: #e4e4e4; }
* { box-sizing: border-box; }
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--ink);
  margin: 0; padding: 12px 20px; background: #fafafa; }
h1 { font-size: 20px; margin: 0 0 2px; }
h2 { font-size: 14px; margin: 0 0 6px; font-weight: 600; }
#run-info { color: var(--muted); }
#controls { display: flex; align-items: center; gap: 10px; margin: 10px 0; flex-wrap: wrap; }
#controls .slider { display: flex; align-items: center; gap: 6px; }
#step { width: 360px; }
#numbers { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 8px 12px; }
#summary { font-size: 16px; font-weight: 600; margin: 0 0 6px; font-variant-numeric: tabular-nums; }
dl { display: flex; gap: 24px; margin: 0; flex-wrap: wrap; }
dl div { display: flex; gap: 6px; }
dt { color: var(--muted); }
dd { margin: 0; font-variant-numeric: tabular-nums; font-weight: 600; }
main { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 12px;
  margin-top: 12px; }
.panel { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 8px 12px; }
.panel.wide { grid-column: 1 / -1; }
.chart svg { display: block; width: 100%; height: auto; }
.note { color: #8a5a00; background: #fff6e0; border: 1px solid #f0d9a0; padding: 6px 8px;
  border-radius: 4px; }
.legend { color: var(--muted); font-size: 12px; margin: 4px 0; }
.key { display: inline-block; width: 12px; height: 10px; margin: 0 4px 0 10px;
  vertical-align: middle; }
.key.before { background: var(--before); }
.key.after { background: var(--after); }
.key.ideal { border-top: 2px dashed #999; height: 0; }
.key.mean { border-top: 2px dashed #444; height: 0; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; margin-top: 6px;
  font-size: 12px; }
th, td { border: 1px solid #e2e2e2; padding: 2px 8px; text-align: right; }
th { background: #f3f3f3; font-weight: 600; }
tr.selected td { background: #eef5fc; }
svg text { font: 11px system-ui, sans-serif; fill: #555; }
svg .axis { stroke: #999; stroke-width: 1; }
svg .grid { stroke: var(--grid); stroke-width: 1; }
svg .clickable { cursor: pointer; }
svg text.label { paint-order: stroke; stroke: #fff; stroke-width: 3px; fill: #333; }
"""

_JS = r"""
"use strict";
(function () {
  var DATA = JSON.parse(document.getElementById("viewer-data").textContent);
  var SVGNS = "http://www.w3.org/2000/svg";
  var steps = DATA.steps;
  var numLayers = DATA.numLayers;
  var state = { index: steps.length - 1, layer: 0 };

  function $(id) { return document.getElementById(id); }
  function fmt(v, digits) {
    return (v === null || v === undefined) ? "n/a" : Number(v).toFixed(digits);
  }
  function fmtInt(v) { return (v === null || v === undefined) ? "n/a" : String(Math.round(v)); }
  function fmtLoad(v) {
    if (v === null || v === undefined) return "n/a";
    return Number.isInteger(v) ? String(v) : Number(v).toFixed(1);
  }
  function entry(index, layer) {
    var row = DATA.layers[index] || [];
    return row[layer] || {};
  }
  function sum(xs) { var s = 0; xs.forEach(function (x) { s += x || 0; }); return s; }
  function maxOf(xs) {
    var m = -Infinity;
    xs.forEach(function (x) { if (x !== null && x > m) m = x; });
    return m;
  }
  function maxOverMean(xs) {
    if (!xs || !xs.length) return null;
    var mean = sum(xs) / xs.length;
    return mean > 0 ? maxOf(xs) / mean : null;
  }
  // Imbalance as the run reported it; computed from the profile when the metrics lack it.
  function imbalance(e, which) {
    var reported = which === "before" ? e.ib : e.ia;
    if (reported !== null && reported !== undefined) return reported;
    return maxOverMean(which === "before" ? e.rb : e.ra);
  }

  function el(tag, attrs, parent) {
    var node = document.createElementNS(SVGNS, tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (parent) parent.appendChild(node);
    return node;
  }
  function svgText(parent, x, y, text, anchor) {
    var t = el("text", { x: x, y: y, "text-anchor": anchor || "middle" }, parent);
    t.textContent = text;
    return t;
  }
  function tooltip(node, text) { el("title", {}, node).textContent = text; }
  // A round tick step (1, 2, 2.5 or 5 times a power of ten; whole numbers when `integer`).
  function niceStep(range, integer) {
    var rough = range > 0 ? range / 4 : 1;
    var p = Math.pow(10, Math.floor(Math.log10(rough)));
    var m = rough / p;
    var step = (m <= 1 ? 1 : m <= 2 ? 2 : m <= 2.5 ? 2.5 : m <= 5 ? 5 : 10) * p;
    return integer ? Math.max(1, Math.ceil(step)) : step;
  }
  // Draws the grid and y axis from yMin up to at least dataMax; returns the axis top.
  function yAxis(svg, box, yMin, dataMax, integer) {
    var step = niceStep(dataMax - yMin, integer);
    var ticks = Math.max(1, Math.ceil((dataMax - yMin) / step - 1e-9));
    var top = yMin + ticks * step;
    var digits = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
    if (Math.abs(step * Math.pow(10, digits) - Math.round(step * Math.pow(10, digits))) > 1e-9) {
      digits += 1;  // 2.5 x 10^k
    }
    for (var i = 0; i <= ticks; i++) {
      var v = yMin + step * i;
      var y = box.y + box.h - box.h * i / ticks;
      el("line", { x1: box.x, x2: box.x + box.w, y1: y, y2: y, "class": "grid" }, svg);
      svgText(svg, box.x - 4, y + 4, v.toFixed(digits), "end");
    }
    el("line", { x1: box.x, x2: box.x, y1: box.y, y2: box.y + box.h, "class": "axis" }, svg);
    el("line", { x1: box.x, x2: box.x + box.w, y1: box.y + box.h, y2: box.y + box.h,
                 "class": "axis" }, svg);
    return top;
  }
  function newSvg(container, width, height) {
    container.textContent = "";
    return el("svg", { viewBox: "0 0 " + width + " " + height, width: width, height: height,
                       role: "img" }, container);
  }
  function expertColor(e, numExperts) {
    var hue = Math.round((360 * e) / Math.max(numExperts, 1));
    return "hsl(" + hue + ", 55%, " + (e % 2 ? 62 : 50) + "%)";
  }

  // ---- Rank loads: before stacked by master expert, after as one bar, mean dashed. ----
  function drawRanks(e) {
    var chart = $("rank-chart");
    var rb = e.rb || [], ra = e.ra || [], experts = e.el || [];
    var numRanks = Math.max(rb.length, ra.length);
    var table = $("rank-table");
    table.textContent = "";
    $("rank-legend").textContent = "";
    if (!numRanks) { chart.textContent = ""; return; }
    var perRank = experts.length % numRanks === 0 ? experts.length / numRanks : 0;
    // Stack only when the profile's expert loads add up to each rank's "before" load.
    var stack = perRank > 0 && rb.length === numRanks && rb.every(function (load, r) {
      var s = sum(experts.slice(r * perRank, (r + 1) * perRank));
      return Math.abs(s - load) <= 1e-6 * Math.max(1, Math.abs(load));
    });
    var W = 560, H = 260, box = { x: 48, y: 12, w: W - 60, h: H - 44 };
    var svg = newSvg(chart, W, H);
    var yMax = yAxis(svg, box, 0, Math.max(maxOf(rb.concat(ra)), 1), false);
    var group = box.w / numRanks, barW = Math.min(28, group * 0.36);
    function y(v) { return box.y + box.h - (box.h * v) / yMax; }
    for (var r = 0; r < numRanks; r++) {
      var cx = box.x + group * (r + 0.5);
      if (r < rb.length && rb[r] !== null) {
        if (stack) {
          var base = 0;
          for (var k = 0; k < perRank; k++) {
            var ex = r * perRank + k, v = experts[ex] || 0;
            var seg = el("rect", { x: cx - barW - 1, y: y(base + v), width: barW,
                                   height: Math.max(0, y(base) - y(base + v)),
                                   fill: expertColor(ex, experts.length), stroke: "#fff",
                                   "stroke-width": 0.5, "class": "before-seg" }, svg);
            tooltip(seg, "rank " + r + ", expert " + ex + ": " + fmtLoad(v));
            base += v;
          }
          el("rect", { x: cx - barW - 1, y: y(rb[r]), width: barW, height: y(0) - y(rb[r]),
                       fill: "none", stroke: "var(--before)", "stroke-width": 1.5 }, svg);
        } else {
          var b = el("rect", { x: cx - barW - 1, y: y(rb[r]), width: barW,
                               height: y(0) - y(rb[r]), fill: "var(--before)" }, svg);
          tooltip(b, "rank " + r + " before: " + fmtLoad(rb[r]));
        }
      }
      if (r < ra.length && ra[r] !== null) {
        var a = el("rect", { x: cx + 1, y: y(ra[r]), width: barW, height: y(0) - y(ra[r]),
                             fill: "var(--after)" }, svg);
        tooltip(a, "rank " + r + " after: " + fmtLoad(ra[r]));
      }
      svgText(svg, cx, box.y + box.h + 14, "rank " + r);
    }
    var loads = rb.length ? rb : ra;
    var mean = sum(loads) / loads.length;
    el("line", { x1: box.x, x2: box.x + box.w, y1: y(mean), y2: y(mean), stroke: "#444",
                 "stroke-dasharray": "5 4", "stroke-width": 1.2 }, svg);
    svgText(svg, box.x + 4, y(mean) - 4, "mean " + fmtLoad(Math.round(mean * 10) / 10),
            "start").setAttribute("class", "label");
    svgText(svg, box.x + box.w / 2, H - 4, "left bar: before" + (stack ?
            " (stacked by master expert)" : "") + ", right bar: after balancing");

    var legend = $("rank-legend");
    legend.innerHTML = '<span class="key before"></span>before<span class="key after"></span>' +
      'after<span class="key mean"></span>mean' +
      (stack ? " &mdash; colours in the before bar are the rank's master experts" : "");

    var head = "<tr><th>rank</th>";
    var before = "<tr><th>before</th>", after = "<tr><th>after</th>";
    for (var i = 0; i < numRanks; i++) {
      head += "<th>" + i + "</th>";
      before += '<td id="rank-before-' + i + '">' + fmtLoad(rb[i]) + "</td>";
      after += '<td id="rank-after-' + i + '">' + fmtLoad(ra[i]) + "</td>";
    }
    table.innerHTML = head + "<th>max/mean</th></tr>" +
      before + "<td>" + fmt(maxOverMean(rb), 2) + "</td></tr>" +
      after + "<td>" + fmt(maxOverMean(ra), 2) + "</td></tr>";
  }

  function drawExperts(e) {
    var chart = $("expert-chart");
    var experts = e.el || [];
    if (!experts.length) { chart.textContent = ""; return; }
    var W = 560, H = 200, box = { x: 48, y: 10, w: W - 60, h: H - 36 };
    var svg = newSvg(chart, W, H);
    var yMax = yAxis(svg, box, 0, Math.max(maxOf(experts), 1), false);
    var slot = box.w / experts.length, barW = Math.max(1, slot * 0.7);
    var labelEvery = Math.ceil(experts.length / 32);
    experts.forEach(function (v, i) {
      var h = (box.h * (v || 0)) / yMax;
      var bar = el("rect", { x: box.x + slot * i + (slot - barW) / 2, y: box.y + box.h - h,
                             width: barW, height: h, fill: expertColor(i, experts.length) }, svg);
      tooltip(bar, "expert " + i + ": " + fmtLoad(v));
      if (i % labelEvery === 0) svgText(svg, box.x + slot * (i + 0.5), box.y + box.h + 13, i);
    });
    svgText(svg, box.x + box.w / 2, H - 2, "expert");
  }

  // ---- Over-steps charts for the selected layer (click to pick a step). ----
  var STEP_PAD = 10;  // room for the first and last replicas bar
  function stepX(box, i) {
    var w = box.w - 2 * STEP_PAD;
    return steps.length > 1 ? box.x + STEP_PAD + (w * i) / (steps.length - 1) : box.x + box.w / 2;
  }
  function xTicks(svg, box) {
    var n = Math.min(6, steps.length);
    var seen = {};
    for (var k = 0; k < n; k++) {
      var i = n > 1 ? Math.round(((steps.length - 1) * k) / (n - 1)) : 0;
      if (seen[i]) continue;
      seen[i] = true;
      svgText(svg, stepX(box, i), box.y + box.h + 14, steps[i]);
    }
  }
  function clickToStep(svg, box, W) {
    svg.setAttribute("class", "clickable");
    svg.addEventListener("click", function (ev) {
      var rect = svg.getBoundingClientRect();
      var x = ((ev.clientX - rect.left) * W) / rect.width;
      var frac = steps.length > 1 ? (x - box.x - STEP_PAD) / (box.w - 2 * STEP_PAD) : 0;
      select(Math.max(0, Math.min(steps.length - 1, Math.round(frac * (steps.length - 1)))),
             state.layer);
    });
  }
  function cursor(svg, box) {
    var x = stepX(box, state.index);
    el("line", { x1: x, x2: x, y1: box.y, y2: box.y + box.h, stroke: "#888",
                 "stroke-width": 1, "stroke-dasharray": "2 2" }, svg);
  }
  function drawImbalance() {
    var W = 560, H = 230, box = { x: 48, y: 10, w: W - 62, h: H - 40 };
    var svg = newSvg($("imbalance-chart"), W, H);
    var before = [], after = [];
    for (var i = 0; i < steps.length; i++) {
      var e = entry(i, state.layer);
      before.push(imbalance(e, "before"));
      after.push(imbalance(e, "after"));
    }
    var yMin = 1.0;
    var yMax = yAxis(svg, box, yMin, Math.max(maxOf(before.concat(after)), 1.1), false);
    xTicks(svg, box);
    svgText(svg, box.x + box.w / 2, H - 2, "step");
    function y(v) { return box.y + box.h - (box.h * (Math.max(v, yMin) - yMin)) / (yMax - yMin); }
    [[before, "var(--before)", "before"], [after, "var(--after)", "after"]].forEach(function (s) {
      var d = "", pen = false;
      s[0].forEach(function (v, i) {
        if (v === null || v === undefined) { pen = false; return; }
        d += (pen ? "L" : "M") + stepX(box, i).toFixed(1) + "," + y(v).toFixed(1);
        pen = true;
      });
      if (d) el("path", { d: d, fill: "none", stroke: s[1], "stroke-width": 1.8,
                          "class": "series-" + s[2] }, svg);
      var v = s[0][state.index];
      if (v !== null && v !== undefined) {
        el("circle", { cx: stepX(box, state.index), cy: y(v), r: 3.5, fill: s[1] }, svg);
      }
    });
    el("line", { x1: box.x, x2: box.x + box.w, y1: y(1), y2: y(1), stroke: "#999",
                 "stroke-dasharray": "4 3" }, svg);
    cursor(svg, box);
    clickToStep(svg, box, W);
  }
  function drawReplicas() {
    var W = 560, H = 200, box = { x: 48, y: 10, w: W - 62, h: H - 40 };
    var svg = newSvg($("replicas-chart"), W, H);
    var reps = steps.map(function (_, i) { return entry(i, state.layer).rep; });
    var yMax = yAxis(svg, box, 0, Math.max(maxOf(reps), 1), true);
    xTicks(svg, box);
    svgText(svg, box.x + box.w / 2, H - 2, "step");
    var slot = steps.length > 1 ? (box.w - 2 * STEP_PAD) / (steps.length - 1) : box.w;
    var barW = Math.max(1, Math.min(14, slot * 0.7, 2 * STEP_PAD));
    reps.forEach(function (v, i) {
      if (v === null || v === undefined) return;
      var h = (box.h * v) / yMax;
      var bar = el("rect", { x: stepX(box, i) - barW / 2, y: box.y + box.h - h, width: barW,
                             height: h, fill: i === state.index ? "var(--before)" : "#7aa6c9" },
                   svg);
      tooltip(bar, "step " + steps[i] + ": " + v + " replicas");
    });
    cursor(svg, box);
    clickToStep(svg, box, W);
  }

  function drawLayerTable() {
    var rows = "<tr><th>layer</th><th>max/mean before</th><th>max/mean after</th>" +
      "<th>replicas</th><th>dropped</th></tr>";
    for (var l = 0; l < numLayers; l++) {
      var e = entry(state.index, l);
      rows += '<tr class="' + (l === state.layer ? "selected" : "") + '"><td>' + l +
        "</td><td>" + fmt(imbalance(e, "before"), 2) + "</td><td>" +
        fmt(imbalance(e, "after"), 2) + "</td><td>" + fmtInt(e.rep) + "</td><td>" +
        fmtInt(e.drop) + "</td></tr>";
    }
    $("layer-table").innerHTML = rows;
  }

  function render() {
    var step = steps[state.index], e = entry(state.index, state.layer);
    var ib = imbalance(e, "before"), ia = imbalance(e, "after");
    $("summary").textContent = "step " + step + ", layer " + state.layer + ": max/mean " +
      fmt(ib, 2) + " -> " + fmt(ia, 2) + ", replicas " + fmtInt(e.rep) +
      ", dropped " + fmtInt(e.drop);
    $("imbalance-before").textContent = fmt(ib, 2);
    $("imbalance-after").textContent = fmt(ia, 2);
    $("replicas").textContent = fmtInt(e.rep);
    $("dropped").textContent = fmtInt(e.drop);
    var loss = DATA.loss[state.index], evalLoss = DATA.evalLoss[state.index];
    $("loss").textContent = fmt(loss, 4) +
      (evalLoss !== null && evalLoss !== undefined ? " (eval " + fmt(evalLoss, 4) + ")" : "");
    $("step-label").textContent = "step " + step + " (" + (state.index + 1) + " of " +
      steps.length + ")";
    $("step").value = String(state.index);
    $("layer").value = String(state.layer);
    var haveStep = !!(e.rb || e.ra);
    $("no-loads").hidden = DATA.hasLoads;
    $("no-step-loads").hidden = !DATA.hasLoads || haveStep;
    $("expert-panel").hidden = !DATA.hasLoads;
    drawRanks(e);
    drawExperts(e);
    drawImbalance();
    drawReplicas();
    drawLayerTable();
  }

  function select(index, layer) {
    state.index = Math.max(0, Math.min(steps.length - 1, index));
    state.layer = Math.max(0, Math.min(Math.max(numLayers - 1, 0), layer));
    var url = new URL(window.location.href);
    if (url.protocol === "file:" || url.protocol === "http:" || url.protocol === "https:") {
      url.searchParams.set("step", String(steps[state.index]));
      url.searchParams.set("layer", String(state.layer));
      try { window.history.replaceState(null, "", url.toString()); } catch (err) { /* ignore */ }
    }
    render();
  }

  // ---- Controls and the initial selection (?step=S&layer=L). ----
  var layerSelect = $("layer");
  for (var l = 0; l < Math.max(numLayers, 1); l++) {
    var option = document.createElement("option");
    option.value = String(l);
    option.textContent = "layer " + l;
    layerSelect.appendChild(option);
  }
  var slider = $("step");
  slider.max = String(Math.max(steps.length - 1, 0));
  slider.addEventListener("input", function () { select(Number(slider.value), state.layer); });
  layerSelect.addEventListener("change", function () {
    select(state.index, Number(layerSelect.value));
  });
  $("prev").addEventListener("click", function () { select(state.index - 1, state.layer); });
  $("next").addEventListener("click", function () { select(state.index + 1, state.layer); });

  var info = steps.length + " logged steps (" + steps[0] + " to " + steps[steps.length - 1] +
    "), " + numLayers + " MoE layer" + (numLayers === 1 ? "" : "s");
  if (DATA.balance) info += ", balance=" + DATA.balance;
  info += DATA.hasLoads ? ", load profile present" : ", no load profile";
  $("run-info").textContent = info;

  var params = new URLSearchParams(window.location.search);
  var index = state.index, layer = 0;
  if (params.has("step")) {
    var wanted = steps.indexOf(Number(params.get("step")));
    if (wanted >= 0) index = wanted;
  }
  if (params.has("layer")) {
    var wantedLayer = Number(params.get("layer"));
    if (Number.isInteger(wantedLayer) && wantedLayer >= 0 && wantedLayer < numLayers) {
      layer = wantedLayer;
    }
  }
  state.index = index;
  state.layer = layer;
  render();
  window.viewer = { select: select, state: state, data: DATA };
  document.body.setAttribute("data-ready", "1");
})();
"""


if __name__ == "__main__":
    app.run(main)
