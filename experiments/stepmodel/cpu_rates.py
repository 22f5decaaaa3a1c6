"""The step model's rates on this machine's two pinned CPU ranks: the rates file of
`experiments.bench.rates` fitted (`Rates`, each term a non-negative `Linear` fit) and one layer's
seconds on the busiest rank from them (`layer_seconds`, `layer.layer_terms`'s rule). The program
that sets them beside the measured layers is `experiments.stepmodel_programs.pinned`.

Shapes: T tokens per rank, C buffer rows.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from experiments.stepmodel.calibration import nonnegative_least_squares
from experiments.stepmodel.layer import EXCHANGES, layer_terms


@dataclasses.dataclass(frozen=True)
class Linear:
    """``seconds = sum(coef[i] * x[i])`` over named terms, fitted >= 0 (a cost model: no term
    pays back time)."""

    names: tuple[str, ...]
    coef: tuple[float, ...]

    def __post_init__(self):
        if len(self.names) != len(self.coef) or min(self.coef, default=0) < 0:
            raise ValueError(f"Linear: {self.names} with coefficients {self.coef}")

    @classmethod
    def fit(cls, names: tuple[str, ...], x, seconds) -> Linear:
        """The non-negative least-squares fit of ``seconds`` [m] on ``x`` [m, len(names)]."""
        coef = nonnegative_least_squares(np.asarray(x, np.float64), np.asarray(seconds))
        return cls(names, tuple(float(c) for c in coef))

    def __call__(self, *x: float) -> float:
        return float(np.dot(self.coef, x))


@dataclasses.dataclass(frozen=True)
class Rates:
    """The rates of `experiments.bench.rates`'s file, fitted.

    Attributes:
      d_model, top_k, ep, experts_per_rank, capacity_factor: the layer's shape.
      experts: per mode, the plain kernel's seconds of (1, C, rows, groups).
      stage: per mode and replicas (0, 1), the balanced program's expert stage's seconds of
        (1, C, rows, groups).
      other: per mode, the bookkeeping's seconds of (1, T, C).
      a2a: one token all-to-all's seconds of (1, bytes per rank).
      planner_s: one `uep.plan` call, seconds.
      provenance: machine, commit, command and date of the rates.
    """

    d_model: int
    top_k: int
    ep: int
    experts_per_rank: int
    capacity_factor: float
    experts: dict
    stage: dict
    other: dict
    a2a: Linear
    planner_s: float
    provenance: dict

    def __post_init__(self):
        if self.planner_s < 0:
            raise ValueError(f"Rates.planner_s={self.planner_s} must be >= 0")
        if not set(self.experts) == set(self.stage) == set(self.other):
            raise ValueError(f"Rates: modes {sorted(self.experts)} vs {sorted(self.other)}")

    @classmethod
    def read(cls, path) -> Rates:
        """The rates file's fits: the kernel and the stage per mode over their timed points, the
        all-to-all over its sizes, the bookkeeping per mode as the plain layers' time less their
        kernel and all-to-alls."""
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
        return cls(
            d_model=shape["d_model"],
            top_k=shape["top_k"],
            ep=ep,
            experts_per_rank=em,
            capacity_factor=shape["capacity_factor"],
            experts=experts,
            stage=stage,
            other=other,
            a2a=a2a,
            planner_s=data["planner_s"],
            provenance=data["provenance"],
        )


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
    rates: Rates, mode: str, tokens: int, capacity: int, rows: float, replicas: int, balanced: bool
) -> float:
    """One layer's seconds on the busiest rank: ``rows`` of its ``capacity``-row buffer in E/R +
    ``replicas`` (0 or 1: what the rates time) groups; ``balanced``: the balanced program (the
    planner, the expert stage under its replica cond), else plain EP (the kernel alone)."""
    if replicas not in (0, 1) or (replicas and not balanced):
        raise ValueError(f"layer_seconds: {replicas} replicas in a balanced={balanced} program")
    pairs = rates.top_k * tokens
    one_a2a = rates.a2a(1, rates.ep * pairs * rates.d_model * 4)
    experts = rates.stage[mode][replicas] if balanced else rates.experts[mode]
    groups = rates.experts_per_rank + replicas
    return layer_terms(
        experts(1, capacity, min(rows, capacity), groups),
        one_a2a,
        0.0,  # in series on a CPU rank: inside the expert stage
        mode,
        other_s=rates.other[mode](1, tokens, capacity),
        plan_s=rates.planner_s if balanced else 0.0,
    ).total
