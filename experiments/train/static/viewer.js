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
  function fmtMB(bytes) {
    return (bytes === null || bytes === undefined) ? "n/a" : (bytes / 1e6).toFixed(2) + " MB";
  }
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
      "<th>replicas</th><th>dropped</th><th>largest send</th></tr>";
    for (var l = 0; l < numLayers; l++) {
      var e = entry(state.index, l);
      rows += '<tr class="' + (l === state.layer ? "selected" : "") + '"><td>' + l +
        "</td><td>" + fmt(imbalance(e, "before"), 2) + "</td><td>" +
        fmt(imbalance(e, "after"), 2) + "</td><td>" + fmtInt(e.rep) + "</td><td>" +
        fmtInt(e.drop) + "</td><td>" + fmtMB(e.send) + "</td></tr>";
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
    $("transfer-send-max").textContent = fmtMB(e.send);
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
