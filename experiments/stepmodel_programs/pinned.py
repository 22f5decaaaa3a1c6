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

import json
import math
import pathlib
import re

from absl import flags

from experiments.lab.program import run_main
from experiments.lab.stepmodel.calibration import Calibration
from experiments.lab.stepmodel.cpu_rates import layer_seconds, read_calibration

#: The layer benchmark's runs in experiments/results.
MOE_GLOB = "bench_pinned_*.txt"
#: The issue's target: each predicted ratio within this of the measured one.
TOLERANCE = 0.05


def layers(
    rates: Calibration, mode: str, tokens: int, before: float, after: float, replicas: int
) -> dict:
    """Seconds of the break-even's and the layer benchmark's programs at one load: max/mean
    ``before`` and ``after`` balancing with ``replicas`` replicas."""
    fit = rates.pinned
    pairs = fit.top_k * tokens
    capped = max(1, math.ceil(fit.capacity_factor * pairs))
    dropless = fit.ep * pairs

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


def breakeven_rows(rates: Calibration, points: list[dict], min_tokens: int = 256) -> list[dict]:
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
    run its mode, tokens per rank, the three ratios (`MOE_RATIOS`, in its order; the bench's
    later ratios, against its force-balanced ideal layer, are not modelled), max/mean before and
    after balancing and the replicas."""
    runs = []
    for line in text.splitlines():
        if m := _MOE_HEADER.search(line):
            runs.append({"mode": m[1], "tokens": int(m[2]), "ratios": []})
        elif runs and (m := _MOE_RATIO.match(line)):
            if len(runs[-1]["ratios"]) < len(MOE_RATIOS):
                runs[-1]["ratios"].append(float(m[1]))
        elif runs and (m := _MOE_LOAD.match(line)):
            runs[-1][m[1]] = float(m[2])
            if m[3]:
                runs[-1]["replicas"] = int(m[3])
    return runs


def moe_rows(rates: Calibration, runs: list[dict], tokens: int) -> list[dict]:
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


def report(rates: Calibration, breakeven_points: list[dict], moe_text: str) -> list[str]:
    """The table of every measured ratio beside the model's, flagged where they differ by more
    than `TOLERANCE`."""
    rows = breakeven_rows(rates, breakeven_points) + moe_rows(rates, moe_runs(moe_text), 2048)
    p = rates.pinned.provenance
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
    print("\n".join(report(read_calibration(f.rates), points, text)))


if __name__ == "__main__":
    # Defined here, not on import: the tests import this module beside programs with flags.
    flags.DEFINE_string("rates", "experiments/results/rates_cpu.json", "The rates file.")
    flags.DEFINE_string("breakeven", "docs/breakeven.json", "The break-even's points.")
    flags.DEFINE_string("results", "experiments/results", f"Where {MOE_GLOB} are.")
    run_main(main)
