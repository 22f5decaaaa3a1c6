"""The step model on this machine's two pinned CPU ranks: the break-even's layers (plain EP
dropless, balanced at capacity factor 1.05, the balanced program on plans with no replica)
charged from rates measured on their own (`experiments.bench.rates`), to set beside what the
layers measure whole (``docs/breakeven.json``, ``python -m experiments.bench.moe
--pinned_ranks=2``).

A layer is `layer_terms`'s rule with the rates of this machine:

  other      the layer's bookkeeping (router, dispatch, gathers and scatters, combine):
             fixed + per token x T + per buffer row x C, the residual of the plain layers timed
             whole at skew 0 by the rates program
  plan       `uep.plan` per call (balanced programs only)
  a2a        the token all-to-all at its bytes (the portable exchange sends R x T x k rows,
             whatever the load), fitted as latency + bytes / rate
  experts    the busiest rank's expert stage: fixed + per buffer row x C + per row x rows +
             per group x groups; for plain EP the tiled kernel, for the balanced program its
             stage as the layer runs it (the kernel under the replica ``lax.cond``, with a
             replica its weights' transfer), fitted apart with no replica and with one. The
             transfer is in that stage, in series: XLA:CPU runs one thunk at a time on a rank's
             one core, so nothing overlaps (the rule gets 0 for it)

The busiest rank's rows are max/mean x T x k (before balancing for the dropless programs, after
it for the balanced one); its groups are E/R masters, plus one per replica in the balanced one.

    python -m experiments.stepmodel_programs.pinned     # each measured ratio beside the model's

Shapes: T tokens per rank, k top-k, C buffer rows, R ranks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re

import numpy as np
from absl import flags

from experiments.program import run_main
from experiments.stepmodel.calibration import nonnegative_least_squares
from experiments.stepmodel.layer import EXCHANGES, layer_terms

#: The layer benchmark's runs in experiments/results.
MOE_GLOB = "bench_pinned_*.txt"
#: The issue's target: each predicted ratio within this of the measured one.
TOLERANCE = 0.05


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


def layers(
    rates: Rates, mode: str, tokens: int, before: float, after: float, replicas: int
) -> dict:
    """Seconds of the break-even's and the layer benchmark's programs at one load: max/mean
    ``before`` and ``after`` balancing with ``replicas`` replicas."""
    pairs = rates.top_k * tokens
    capped = max(1, math.ceil(rates.capacity_factor * pairs))
    dropless = rates.ep * pairs

    def run(capacity, imbalance, reps, planned):
        return layer_seconds(rates, mode, tokens, capacity, imbalance * pairs, reps, planned)

    return {
        "dropless": run(dropless, before, 0, False),
        "capped": run(capped, before, 0, False),
        "balanced": run(capped, after, replicas, True),
        "balanced_dropless": run(dropless, after, replicas, True),
        "no_replica": run(dropless, before, 0, True),
    }


#: The ratios the break-even measures: (name, numerator key, denominator key) of its points.
BREAKEVEN_RATIOS = (
    ("balanced/dropless", "balanced_ms", "dropless_ms"),
    ("no_replica/dropless", "no_replica_ms", "dropless_ms"),
)


def breakeven_rows(rates: Rates, points: list[dict], min_tokens: int = 256) -> list[dict]:
    """Each break-even point with ``min_tokens`` tokens per rank or more: its measured ratios
    (`BREAKEVEN_RATIOS`) beside the model's."""
    out = []
    for p in points:
        if p["tokens"] < min_tokens:
            continue
        t = layers(
            rates,
            p["mode"],
            p["tokens"],
            p["imbalance_before"],
            p["imbalance_after"],
            p["replicas"],
        )
        model = {
            "balanced_ms": t["balanced"],
            "dropless_ms": t["dropless"],
            "no_replica_ms": t["no_replica"],
        }
        for name, a, b in BREAKEVEN_RATIOS:
            out.append(
                {
                    "mode": p["mode"],
                    "skew": p["skew"],
                    "tokens": p["tokens"],
                    "ratio": name,
                    "measured": p[a] / p[b],
                    "model": model[a] / model[b],
                }
            )
    return out


#: The layer benchmark's ratios: (its name, numerator, denominator) of `layers`' keys.
MOE_RATIOS = (
    ("overhead_dropless", "balanced_dropless", "dropless"),
    ("capped_vs_plain_dropless", "balanced", "dropless"),
    ("capped_vs_plain_capped", "balanced", "capped"),
)
_MOE_HEADER = re.compile(r"MoE layer, (\w+), EP=2 on 2 pinned .*tokens/device=(\d+)")
_MOE_RATIO = re.compile(r"^\s+.+ / .+?\s+(\d\.\d+)\s{3}")
_MOE_LOAD = re.compile(r"^\s+(before|after)\s.*?(\d+\.\d+)(?:\s+\((\d+) replicas\))?$")


def moe_runs(text: str) -> list[dict]:
    """The runs of ``python -m experiments.bench.moe --pinned_ranks=2`` in a results file: per
    run its mode, tokens per rank, the three ratios (`MOE_RATIOS`, in its order), max/mean before
    and after balancing and the replicas."""
    runs = []
    for line in text.splitlines():
        if m := _MOE_HEADER.search(line):
            runs.append({"mode": m[1], "tokens": int(m[2]), "ratios": []})
        elif runs and (m := _MOE_RATIO.match(line)):
            runs[-1]["ratios"].append(float(m[1]))
        elif runs and (m := _MOE_LOAD.match(line)):
            runs[-1][m[1]] = float(m[2])
            if m[3]:
                runs[-1]["replicas"] = int(m[3])
    return runs


def moe_rows(rates: Rates, runs: list[dict], tokens: int) -> list[dict]:
    """The layer benchmark's runs at ``tokens`` per rank: each measured ratio beside the
    model's."""
    out = []
    for run in runs:
        if run["tokens"] != tokens:
            continue
        t = layers(rates, run["mode"], tokens, run["before"], run["after"], run["replicas"])
        for (name, a, b), measured in zip(MOE_RATIOS, run["ratios"], strict=True):
            out.append(
                {
                    "mode": run["mode"],
                    "tokens": tokens,
                    "ratio": name,
                    "measured": measured,
                    "model": t[a] / t[b],
                }
            )
    return out


def report(rates: Rates, breakeven_points: list[dict], moe_text: str) -> list[str]:
    """The table of every measured ratio beside the model's, flagged where they differ by more
    than `TOLERANCE`."""
    rows = breakeven_rows(rates, breakeven_points) + moe_rows(rates, moe_runs(moe_text), 2048)
    p = rates.provenance
    lines = [
        f"rates: {p['command']} ({p['date']}, commit {p['commit']}, {p['machine']})",
        f"{'mode':>8} {'skew':>5} {'tokens':>6} {'ratio':>25} {'measured':>9} {'model':>7} "
        f"{'diff':>7}",
    ]
    for r in rows:
        diff = r["model"] - r["measured"]
        skew = f"{r['skew']:g}" if "skew" in r else "2"
        lines.append(
            f"{r['mode']:>8} {skew:>5} {r['tokens']:6d} {r['ratio']:>25} {r['measured']:9.3f} "
            f"{r['model']:7.3f} {diff:+7.3f}" + ("  off" if abs(diff) > TOLERANCE else "")
        )
    off = sum(abs(r["model"] - r["measured"]) > TOLERANCE for r in rows)
    lines.append(f"{len(rows) - off} of {len(rows)} ratios within {TOLERANCE} of the measured")
    return lines


def main(argv):
    """Prints `report` for ``--rates``, ``--breakeven`` and the layer benchmark's results."""
    del argv
    f = flags.FLAGS
    points = json.loads(pathlib.Path(f.breakeven).read_text())["points"]
    text = "".join(p.read_text() for p in sorted(pathlib.Path(f.results).glob(MOE_GLOB)))
    print("\n".join(report(Rates.read(f.rates), points, text)))


if __name__ == "__main__":
    # Defined here, not on import: the tests import this module beside programs with flags.
    flags.DEFINE_string("rates", "experiments/results/rates_cpu.json", "The rates file.")
    flags.DEFINE_string("breakeven", "docs/breakeven.json", "The break-even's points.")
    flags.DEFINE_string("results", "experiments/results", f"Where {MOE_GLOB} are.")
    run_main(main)
