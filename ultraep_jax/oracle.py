"""The exact side of the planner's comparisons: whether any plan reaches a threshold (a
mixed-integer program, `scipy.optimize.milp`; scipy comes with the ``test`` extra and is imported
only when it is asked), and the small random cases it is asked about (the planner's tests, where
the repairs run, and the experiment `experiments.planner.exact`, which reaches it through
`ultraep_jax.tools`). It is written from ffi/PLANNER.md's definition of a plan, not from the
planner: the independent reference that both the tests and the experiments import."""

from __future__ import annotations

import numpy as np


def exact_plan_exists(load_e, ep_size: int, slots: int, keep: int, tau: int) -> bool:
    """Whether some plan puts every rank at or below ``tau``: expert ``e``'s master (on rank
    ``e // (E / R)``, ffi/PLANNER.md) keeps at least ``min(keep, load_e[e])`` of its tokens, and
    every other rank holds at most ``slots`` replicas, each of a distinct expert, with any
    quotas.

    A mixed-integer program: binary ``y[t, e]`` (rank ``t`` holds a replica of ``e``) and quotas
    ``q[t, e] >= 0``. Given ``y`` the quotas are a flow problem with integer data, so real quotas
    are feasible exactly when integer ones are.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    load_e = [int(v) for v in load_e]
    E, R = len(load_e), ep_size
    home = [e // (E // R) for e in range(E)]
    L = np.asarray(load_e, np.int64).reshape(R, E // R).sum(axis=1).tolist()  # masters' loads
    if max(L) <= tau:
        return True
    give = [max(v - keep, 0) for v in load_e]  # what each master may give away
    pairs = [(t, e) for t in range(R) for e in range(E) if home[e] != t and give[e] > 0]
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
        entries += [(P + k, -1.0) for k, (_, e) in enumerate(pairs) if home[e] == t]
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
