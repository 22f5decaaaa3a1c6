"""The step model's rates on this machine's two pinned CPU ranks: the rates file of
`experiments.bench.rates` fitted into a `Calibration` (`read_calibration`: its `PinnedFit`, each
term a non-negative `Linear` fit, and its planner time) and one layer's seconds on the busiest rank
from them (`layer_seconds`, `layer.layer_terms`'s rule). The program that sets them beside the
measured layers is `experiments.stepmodel_programs.pinned`.

Shapes: T tokens per rank, C buffer rows.
"""

from __future__ import annotations

import json

import numpy as np

from experiments.lab.stepmodel.calibration import Calibration, Linear, PinnedFit
from experiments.lab.stepmodel.layer import EXCHANGES, layer_terms


def read_calibration(path) -> Calibration:
    """The rates file's fits as the step model's rates: the kernel and the stage per mode over
    their timed points, the all-to-all over its sizes, the bookkeeping per mode as the plain
    layers' time less their kernel and all-to-alls (`Calibration.pinned`), and its timed plan
    (`Calibration.planner_s`)."""
    with open(path) as f:
        data = json.load(f)
    shape = data["shape"]
    a2a = Linear.fit(
        ("latency", "per byte"), [[1, b] for b, _ in data["a2a"]], [s for _, s in data["a2a"]]
    )
    ep, em = shape["ep_size"], shape["num_experts"] // shape["ep_size"]
    experts, stage, other = {}, {}, {}
    for mode, m in data["modes"].items():
        experts[mode] = _kernel_fit(m["experts"])
        stage[mode] = {int(n): _kernel_fit(pts) for n, pts in m["stage"].items()}
        rows, residual = [], []
        for p in m["layers"]:
            exchange = a2a(1, ep * shape["top_k"] * p["tokens"] * shape["d_model"] * 4)
            kernel = experts[mode](1, p["capacity"], p["rows"], em)
            rows.append([1, p["tokens"], p["capacity"]])
            residual.append(p["seconds"] - kernel - EXCHANGES[mode][0] * exchange)
        other[mode] = Linear.fit(("fixed", "per token", "per buffer row"), rows, residual)
    fit = PinnedFit(
        d_model=shape["d_model"],
        top_k=shape["top_k"],
        ep=ep,
        experts_per_rank=em,
        capacity_factor=shape["capacity_factor"],
        experts=experts,
        stage=stage,
        other=other,
        a2a=a2a,
        provenance=data["provenance"],
    )
    return Calibration(planner_s=data["planner_s"], pinned=fit)


#: A timed point this far off its fit (relative) is an outlier: refitted without it. Two of the
#: rates file's 240 points are (the prefill replica stage at 17204 and 29491 rows, 3.6x and 3.9x
#: their neighbours at 16384 rows, where no layer run shows such a step).
OUTLIER = 0.5


def _kernel_fit(points) -> Linear:
    """The fit of timed ``[[C, rows, groups, seconds], ...]`` on (1, C, rows, groups), refitted
    without the point of the largest residual while some point is more than `OUTLIER` off
    (relative), one at a time: an outlier pulls the fit toward itself, so that the good points
    small in seconds are the ones most off relative to it."""
    pts = np.asarray(points, np.float64)
    x = np.column_stack([np.ones(len(pts)), pts[:, :3]])
    names = ("fixed", "per buffer row", "per row", "per group")
    keep = np.ones(len(pts), bool)
    while True:
        fit = Linear.fit(names, x[keep], pts[keep, 3])
        residual = np.where(keep, np.abs(x @ np.asarray(fit.coef) - pts[:, 3]), 0.0)
        if np.max(residual / pts[:, 3]) <= OUTLIER:
            return fit
        keep[np.argmax(residual)] = False


def layer_seconds(
    rates: Calibration,
    mode: str,
    tokens: int,
    capacity: int,
    rows: float,
    replicas: int,
    balanced: bool,
) -> float:
    """One layer's seconds on the busiest rank: ``rows`` of its ``capacity``-row buffer in E/R +
    ``replicas`` (0 or 1: what the rates time) groups; ``balanced``: the balanced program (the
    planner, the expert stage under its replica cond), else plain EP (the kernel alone);
    ``rates``: a `read_calibration` (ValueError without its `PinnedFit`)."""
    fit = rates.pinned
    if fit is None:
        raise ValueError("layer_seconds: the rates have no pinned-rank fit (read_calibration)")
    if replicas not in (0, 1) or (replicas and not balanced):
        raise ValueError(f"layer_seconds: {replicas} replicas in a balanced={balanced} program")
    pairs = fit.top_k * tokens
    one_a2a = fit.a2a(1, fit.ep * pairs * fit.d_model * 4)
    experts = fit.stage[mode][replicas] if balanced else fit.experts[mode]
    groups = fit.experts_per_rank + replicas
    return layer_terms(
        experts(1, capacity, min(rows, capacity), groups),
        one_a2a,
        0.0,  # in series on a CPU rank: inside the expert stage
        mode,
        other_s=fit.other[mode](1, tokens, capacity),
        plan_s=rates.planner_s if balanced else 0.0,
    ).total
