"""The planner against an exact solver on small random cases: how often exact mode misses M.

        python -m experiments.bench.planner_exact             # S = 1 and S = 2, 200k cases each
        python -m experiments.bench.planner_exact --slots=2 --cases=1000000 --seed=1

Exact mode (``balance_eps=0``, ``min_tokens_per_replica=1``) aims at ``M = ceil(T / R)``. A miss is
a case whose plan puts some rank above ``M`` although a plan at ``M`` exists, with the planner's
constraints: ``S`` slots per rank, a master keeps ``master_keep_tokens``, no rank holds an expert
twice (`exact_plan_exists`, a mixed-integer program solved by `scipy.optimize.milp`; scipy comes
with the ``test`` extra). The solver runs only where the plan misses ``M`` (a plan at ``M`` proves
that one exists). The cases (`random_cases`): ``R`` in 2..4, ``E / R`` in 1..3, small loads.
"""

from __future__ import annotations

import collections
import time

import numpy as np
from absl import app, flags

CASES = flags.DEFINE_integer("cases", 200_000, "Random cases per slot count.")
SLOTS = flags.DEFINE_list("slots", ["1", "2"], "Spare slots per rank (S), one table row each.")
SEED = flags.DEFINE_integer("seed", 0, "Seed of the random cases.")


def exact_plan_exists(load_e, ep_size: int, slots: int, keep: int, tau: int) -> bool:
    """Whether some plan puts every rank at or below ``tau``: expert ``e``'s master (rank
    ``e // (E / R)``) keeps at least ``min(keep, load_e[e])`` of its tokens, and every other rank
    holds at most ``slots`` replicas, each of a distinct expert, with any quotas.

    A mixed-integer program: binary ``y[t, e]`` (rank ``t`` holds a replica of ``e``) and quotas
    ``q[t, e] >= 0``. Given ``y`` the quotas are a flow problem with integer data, so real quotas
    are feasible exactly when integer ones are.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    load_e = [int(v) for v in load_e]
    E, R = len(load_e), ep_size
    em = E // R
    L = [sum(load_e[d * em : (d + 1) * em]) for d in range(R)]
    if max(L) <= tau:
        return True
    give = [max(v - keep, 0) for v in load_e]  # what each master may give away
    pairs = [(t, e) for t in range(R) for e in range(E) if e // em != t and give[e] > 0]
    if slots == 0 or not pairs:
        return False
    P = len(pairs)  # variables: y[0, P), q[P, 2P)
    rows, cols, vals, upper = [], [], [], []

    def row(entries, ub):
        for c, v in entries:
            rows.append(len(upper))
            cols.append(c)
            vals.append(v)
        upper.append(ub)

    for t in range(R):  # slots per rank
        row([(k, 1.0) for k, (u, _) in enumerate(pairs) if u == t], slots)
    for k, (_, e) in enumerate(pairs):  # a quota only where the replica is
        row([(P + k, 1.0), (k, -float(give[e]))], 0)
    for e in range(E):  # a master gives at most give[e]
        row([(P + k, 1.0) for k, (_, f) in enumerate(pairs) if f == e], give[e])
    for t in range(R):  # rank load <= tau: L[t] - given away + received
        entries = [(P + k, 1.0) for k, (u, _) in enumerate(pairs) if u == t]
        entries += [(P + k, -1.0) for k, (_, e) in enumerate(pairs) if e // em == t]
        row(entries, tau - L[t])
    A = coo_matrix((vals, (rows, cols)), shape=(len(upper), 2 * P)).tocsr()
    result = milp(
        np.zeros(2 * P),
        constraints=LinearConstraint(A, -np.inf, np.asarray(upper, dtype=np.float64)),
        integrality=np.r_[np.ones(P), np.zeros(P)],
        bounds=Bounds(np.zeros(2 * P), np.r_[np.ones(P), [give[e] for _, e in pairs]]),
    )
    if result.status not in (0, 2):  # 0: a solution, 2: infeasible
        raise RuntimeError(f"milp failed: {result.message}")
    return result.status == 0


def random_cases(
    rng: np.random.Generator, n: int, ranks=(2, 3, 4), experts_per_rank=(1, 2, 3)
) -> list[tuple[int, np.ndarray, int]]:
    """``n`` small cases ``(R, load_e [E] int32, master_keep_tokens)``: ``R`` from ``ranks``,
    ``E / R`` from ``experts_per_rank``, ``master_keep_tokens`` in 0..2; expert totals uniform in
    ``[0, scale]``, or that with each expert kept with probability 0.4, or a Zipf-like multinomial;
    ``scale`` in {5, 10, 30, 100}."""
    cases = []
    for _ in range(n):
        R = int(rng.choice(ranks))
        E = R * int(rng.choice(experts_per_rank))
        K = int(rng.choice([0, 1, 1, 2]))
        scale = int(rng.choice([5, 10, 30, 100]))
        kind = int(rng.integers(3))
        if kind == 0:
            load_e = rng.integers(0, scale + 1, E)
        elif kind == 1:
            load_e = rng.integers(0, scale + 1, E) * (rng.random(E) < 0.4)
        else:
            p = 1.0 / np.arange(1, E + 1) ** rng.uniform(0.5, 2.0)
            load_e = rng.multinomial(scale * E // 2, p[rng.permutation(E)] / p.sum())
        cases.append((R, load_e.astype(np.int32), K))
    return cases


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
    app.run(main)
