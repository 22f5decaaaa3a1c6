"""Fast domains and the planner: would replica targets chosen by domain cut slow-link copies?

        python -m experiments.planner.domains          # every case, about 6 minutes on 2 cores
        python -m experiments.planner.domains --cases=deepseek-r1:64:8 --stride=4

With ``BalancerConfig.ranks_per_domain = d`` the replica transfer sends an expert's weights over
the slow links once per remote domain holding a replica of it (ffi/TRANSFER.md, "Fast
domains"): a layer's slow-link copies are the (expert, domain other than its master's) pairs with
at least one replica. This program measured whether the planner should know the domains: each
layer of the real traces is planned by the planner of ffi/PLANNER.md with one domain (the
default path: ``balance_eps > 0``, no capacity; "planner" below) and by variants of it that
prefer, among the targets it chooses from, a rank in the master's domain or in a domain that
already holds a replica of the expert (a "near" target; every other target is "far"):

  * ``tie``: only among targets the planner finds equal (the same slack): near first.
  * ``fit``: among the targets that take all the tokens the source still needs (any of them ends
    the source's excess with this replica), near ones first, then the least slack as before.
    The library's planner has adopted it: ``uep.plan`` with ``ranks_per_domain = d``.
  * ``fit-home``: as ``fit``, only the master's domain near.
  * ``near``: near targets whenever there is one (then the planner's own rule among them); far
    ones only when no near one has slack and a free slot.
  * ``floor=N``: a far target only where its replica carries at least ``min(N, need)`` tokens
    (a larger ``min_tokens_per_replica`` for copies over the slow links).

The variants live in `experiments.planner.domain_planner` (a copy of the planner's attempts and
threshold search in plain Python, which reproduces `ultraep_jax.plan` bit for bit: with no variant
the plan of one domain, with ``fit`` the plan with ``ranks_per_domain = d``; both checked on every
layer this program plans).

Loads: each layer as `experiments.planner` builds it (`experiments.lab.loads.traces.trace_batch`,
the trace's own top-k, ``--tokens_per_rank`` tokens per rank, seed 0), every ``--stride``-th layer.
Figures per case: slow-link copies per layer (median, p90, total over the layers) and the final
max/mean rank load (mean and worst over the layers).
"""

from __future__ import annotations

import time

import numpy as np
from absl import flags

import ultraep_jax as uep
from experiments.lab import cli
from experiments.lab.batched import batched_planner
from experiments.lab.loads import traces
from experiments.lab.output_files import write_json
from experiments.lab.program import run_main
from experiments.lab.stepmodel import shapes
from experiments.planner.domain_planner import PLAN_FIELDS, assert_is_library, plan_replicas

_CASES = flags.DEFINE_list(
    "cases",
    [
        "deepseek-r1:32:8",
        "deepseek-r1:64:8",
        "deepseek-r1:128:8",
        "switch-base-128:32:8",
        "switch-base-128:64:8",
        "switch-base-128:128:8",
        "qwen1.5-moe:12:4",
        "qwen1.5-moe:60:4",
    ],
    "trace:ep_size:ranks_per_domain triples (Qwen1.5-MoE's 60 experts divide no multiple of 8).",
)
_VARIANTS = flags.DEFINE_list(
    "variants",
    ["tie", "fit", "fit-home", "near", "floor=2048", "floor=4096", "floor=8192"],
    "Variants to compare with the planner (tie, fit, fit-home, near, floor=N).",
)
_STRIDE = flags.DEFINE_integer("stride", 1, "Keep every n-th layer of each trace (1: all).")
_TOKENS = flags.DEFINE_integer(
    "tokens_per_rank", shapes.ANCHOR.tokens_per_rank, "Tokens per source rank."
)
_BALANCER = cli.define_balancer_flags()
_TRACES_DIR = cli.define_traces_dir()
_JSON = cli.define_json_out()

#: The final max/mean a variant may reach on every layer to be worth adopting.
BALANCE_LIMIT = 1.02


def _case_ok(item: str) -> bool:
    name, ep, d = (item.split(":") + ["", ""])[:3]
    return (
        name in traces.TRACE_NAMES
        and ep.isdigit()
        and d.isdigit()
        and int(d) > 0
        and int(ep) % int(d) == 0
        and traces.TRACE_NUM_EXPERTS[name] % int(ep) == 0
    )


def _variant_ok(v: str) -> bool:
    return v in ("tie", "fit", "fit-home", "near") or (v.startswith("floor=") and v[6:].isdigit())


flags.register_validator("stride", lambda v: v >= 1, "must be >= 1")
flags.register_validator(
    "cases",
    lambda v: all(map(_case_ok, v)),
    "each must be trace:ep:d with d dividing ep and ep dividing the trace's experts",
)
flags.register_validator(
    "variants", lambda v: all(map(_variant_ok, v)), "tie, fit, fit-home, near, floor=N"
)


def slow_copies(replicas, E_m: int, dsz: int) -> int:
    """(expert, remote domain) pairs with a replica: the slow-link copies of the layer."""
    return len({(e, t // dsz) for e, t, _ in replicas if t // dsz != (e // E_m) // dsz})


# --- The measurement ---------------------------------------------------------------------------


def _variant(name: str) -> tuple[str | None, int]:
    """``(mode, far_floor)`` of a variant's name ("planner": the planner with one domain)."""
    if name.startswith("floor="):
        return None, int(name[6:])
    return (None if name == "planner" else name), 0


def measure(name: str, ep: int, dsz: int, variants: list[str]) -> dict:
    """Slow-link copies and final max/mean of every layer of one case, per variant."""
    batch = traces.trace_batch(name, ep, _TOKENS.value, _STRIDE.value, _TRACES_DIR.value)
    E = batch.shape[2]
    b = _BALANCER()
    S, F, eps = b["slots_per_rank"], b["min_tokens_per_replica"], b["balance_eps"]
    K = uep.BalancerConfig().master_keep_tokens
    library = {}  # this file's copies of the planner are the library's, with and without domains
    for v, d in (("planner", None), ("fit", dsz)):
        if v not in ["planner"] + variants:
            continue
        plans = batched_planner(uep.BalancerConfig(E, ep, ranks_per_domain=d, **b))(batch)
        library[v] = {k: np.asarray(getattr(plans, k)) for k in PLAN_FIELDS}
    out = {}
    for v in ["planner"] + variants:
        mode, far_floor = _variant(v)
        copies, balance, replicas = [], [], []
        for n, loads in enumerate(batch):
            reps, rank_load = plan_replicas(loads, S, F, K, eps, dsz, mode, far_floor)
            if v in library:
                item = {k: a[n] for k, a in library[v].items()}
                assert_is_library(reps, rank_load, item, (name, ep, dsz, v, n))
            copies.append(slow_copies(reps, E // ep, dsz))
            balance.append(rank_load.max() * ep / rank_load.sum())
            replicas.append(len(reps))
        c = np.asarray(copies, np.float64)
        out[v] = {
            "copies_median": float(np.median(c)),
            "copies_p90": float(np.percentile(c, 90)),
            "copies_total": int(c.sum()),
            "final_mean": float(np.mean(balance)),
            "final_worst": float(np.max(balance)),
            "replicas_mean": float(np.mean(replicas)),
        }
    return {"trace": name, "ep": ep, "d": dsz, "layers": int(len(batch)), "variants": out}


_HEADER = (
    f"{'trace':16s} {'EP':>4s} {'d':>2s} {'layers':>6s} {'variant':>11s} "
    f"{'slow copies med/p90/total':>26s} {'vs planner':>10s} {'final mean':>10s} "
    f"{'final worst':>11s} {'replicas':>8s}"
)


def table(cells: list[dict]) -> list[str]:
    """One line per case and variant."""
    lines = [_HEADER]
    for c in cells:
        base = c["variants"]["planner"]["copies_total"]
        for v, r in c["variants"].items():
            cut = "" if v == "planner" else f"{100 * (r['copies_total'] / base - 1):+.1f}%"
            lines.append(
                f"{c['trace']:16s} {c['ep']:4d} {c['d']:2d} {c['layers']:6d} {v:>11s} "
                f"{r['copies_median']:8g} / {r['copies_p90']:5g} / {r['copies_total']:7d} "
                f"{cut:>10s} {r['final_mean']:10.4f} {r['final_worst']:11.4f} "
                f"{r['replicas_mean']:8.1f}"
            )
    return lines


def main(argv):
    """Plans every case's layers with the planner and each variant; prints the table."""
    del argv
    start = time.perf_counter()
    b = _BALANCER()
    layers = "every layer" if _STRIDE.value == 1 else f"every {_STRIDE.value}-th layer"
    print(
        f"Slow-link copies per layer and final max/mean, {_TOKENS.value} tokens/rank, "
        f"{b['slots_per_rank']} slots/rank, min_tokens_per_replica="
        f"{b['min_tokens_per_replica']}, eps={b['balance_eps']}, {layers} "
        f"(d: ranks per fast domain; planner and fit: checked against uep.plan with one domain "
        f"and with ranks_per_domain=d on every layer):"
    )
    cells = []
    for item in _CASES.value:
        name, ep, dsz = item.split(":")
        cells.append(measure(name, int(ep), int(dsz), list(_VARIANTS.value)))
        print("\n".join(table(cells[-1:])[1 if len(cells) > 1 else 0 :]), flush=True)
    worst = {v: max(c["variants"][v]["final_worst"] for c in cells) for v in cells[0]["variants"]}
    base = max(1, sum(c["variants"]["planner"]["copies_total"] for c in cells))
    change = {v: sum(c["variants"][v]["copies_total"] for c in cells) / base - 1 for v in worst}
    least = {
        v: max(
            c["variants"][v]["copies_total"] / c["variants"]["planner"]["copies_total"] - 1
            for c in cells
        )
        for v in worst
    }
    print(
        "\nOver every case: slow-link copies against the planner (all cases' total; the case "
        "that gained least), worst final max/mean:"
    )
    for v in worst:
        ok = "within" if worst[v] <= BALANCE_LIMIT else "above"
        print(
            f"  {v:>11s}: {100 * change[v]:+6.1f}% ({100 * least[v]:+6.1f}%)  {worst[v]:.4f} "
            f"({ok} {BALANCE_LIMIT})"
        )
    print(f"({time.perf_counter() - start:.0f} s)")
    write_json(_JSON.value, {"cases": cells, "balance_limit": BALANCE_LIMIT})


if __name__ == "__main__":
    run_main(main)
