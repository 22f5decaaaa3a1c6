"""The planner against an exact solver on small random cases: how often exact mode misses M.

        python -m experiments.planner.exact             # S = 1 and S = 2, 200k cases each
        python -m experiments.planner.exact --slots=2 --cases=1000000 --seed=1

Exact mode (``balance_eps=0``, ``min_tokens_per_replica=1``) aims at ``M = ceil(T / R)``. A miss is
a case whose plan puts some rank above ``M`` although a plan at ``M`` exists, with the planner's
constraints: ``S`` slots per rank, a master keeps ``master_keep_tokens``, no rank holds an expert
twice (`tools.exact_plan_exists`, a mixed-integer program; scipy comes with
the ``test`` extra). The solver runs only where the plan misses ``M`` (a plan at ``M`` proves that
one exists). The cases (`tools.random_cases`): ``R`` in 2..4, ``E / R`` in
1..3, small loads.
"""

from __future__ import annotations

import collections
import time

import numpy as np
from absl import flags

# A test reference: tests/references imports nothing from experiments/ or models/ (no cycle).
from ultraep_jax.tools import exact_plan_exists, random_cases

CASES = flags.DEFINE_integer("cases", 200_000, "Random cases per slot count.")
SLOTS = flags.DEFINE_list("slots", ["1", "2"], "Spare slots per rank (S), one table row each.")
SEED = flags.DEFINE_integer("seed", 0, "Seed of the random cases.")


def exact_mode_misses(cases, slots: int) -> dict:
    """Plans every case in exact mode and counts the misses of ``M`` against
    `exact_plan_exists`; also the misses in the cases PLANNER.md calls complete (``R = 2`` or
    ``S >= E - E / R``)."""
    import jax

    import ultraep_jax as uep

    groups = collections.defaultdict(list)
    for R, load_e, K in cases:
        groups[(R, len(load_e), K)].append(load_e)
    stats = dict(cases=len(cases), at_M=0, missed=0, missed_complete=0)
    examples = []
    for (R, E, K), rows in sorted(groups.items()):
        cfg = uep.BalancerConfig(E, R, slots, 1, 0.0, K)  # exact mode, floor 1
        loads = np.zeros((len(rows), R, E), np.int32)
        loads[:, 0, :] = np.stack(rows)  # only the expert totals matter
        plans = jax.jit(jax.vmap(lambda x, cfg=cfg: uep.plan(x, cfg)))(loads)
        worst = np.asarray(plans.rank_load).max(axis=1)
        for load_e, got in zip(rows, worst, strict=True):
            M = -(-int(load_e.sum()) // R)
            if got <= M:
                stats["at_M"] += 1
            elif exact_plan_exists(load_e, R, slots, K, M):
                stats["missed"] += 1
                stats["missed_complete"] += int(R == 2 or slots >= E - E // R)
                examples.append((R, K, load_e.tolist(), int(got), M))
    stats["M_exists"] = stats["at_M"] + stats["missed"]
    return {"stats": stats, "examples": examples}


def main(argv):
    """Prints one line per slot count, and a few missed cases."""
    del argv
    for slots in (int(s) for s in SLOTS.value):
        start = time.perf_counter()
        cases = random_cases(np.random.default_rng(SEED.value), CASES.value)
        result = exact_mode_misses(cases, slots)
        s = result["stats"]
        rate = f", 1 in {s['cases'] / s['missed']:,.0f} cases" if s["missed"] else ""
        print(
            f"S={slots}: {s['cases']} cases, a plan at M exists in {s['M_exists']}, the planner "
            f"misses M in {s['missed']}{rate}; {s['missed_complete']} of the misses in the "
            f"complete cases (R = 2 or S >= E - E/R) ({time.perf_counter() - start:.0f} s)"
        )
        for R, K, load_e, got, M in result["examples"][:3]:
            print(f"    R={R} K={K} load_e={load_e}: planned max {got}, M = {M}")


if __name__ == "__main__":
    from experiments.lab.program import run_main

    run_main(main)
