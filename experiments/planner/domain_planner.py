"""The planner of ffi/PLANNER.md in plain Python, with domain-aware target choices: the variants
`experiments.planner.domains` measures (`plan_replicas`), and the check that a plan is the
library's (`assert_is_library`).

The default path only (``balance_eps > 0``, no capacity: every probe keeps the floor F). ``mode``:
None (the planner with one domain), "tie", "fit" (the planner with domains of ``dsz`` ranks),
"fit-home" or "near"; ``far_floor``: 0 or the far targets' floor. With no variant it reproduces
`ultraep_jax.plan` of one domain bit for bit, with "fit" the plan with ``ranks_per_domain = dsz``
(tests/experiments/test_planner_domains.py checks both against the reference planner).
"""

from __future__ import annotations

import numpy as np


def _pick(slack, free, need, a, rule, near, mode, far_ok):
    """pick_target of PLANNER.md over the candidates ``far_ok`` allows, with ``mode``'s
    preference for the ranks in ``near``; -1 when there is none."""
    cands = [t for t in range(len(slack)) if free[t] > 0 and slack[t] > 0 and far_ok(t)]
    if not cands:
        return -1
    if mode == "near":
        close = [t for t in cands if t in near]
        cands = close or cands
    tie = (lambda t: t not in near) if mode == "tie" else (lambda t: False)

    def most(ts):
        return min(ts, key=lambda t: (-slack[t], tie(t), t))

    if rule == "most":
        return most(cands)
    if rule == "strict":
        cands = [t for t in cands if not (free[t] == 1 and slack[t] > a)] or cands
    fits = [t for t in cands if slack[t] >= need]
    if mode in ("fit", "fit-home"):
        fits = [t for t in fits if t in near] or fits
    if fits:
        return min(fits, key=lambda t: (slack[t], tie(t), t))
    return most(cands)


def _attempt(tau, load_e, L, S, F, K, rule, order, dsz, mode, far_floor):
    """attempt(tau, F, rule, order): ``(replicas or None, the source that failed)``."""
    R = len(L)
    E_m = len(load_e) // R
    slack = [max(tau - v, 0) for v in L]
    free = [S] * R
    exported = [0] * len(load_e)
    held = {}  # expert -> the domains holding a replica of it
    replicas = []
    X = sum(max(v - tau, 0) for v in L)
    for d in order:
        x = L[d] - tau
        X -= x
        masters = range(d * E_m, (d + 1) * E_m)
        while x > 0:
            fl = min(F, x)
            e = min(masters, key=lambda m: (-(load_e[m] - K - exported[m]), m))
            avail = load_e[e] - K - exported[e]
            if avail < fl:
                return None, d
            doms = {d // dsz} | (set() if mode == "fit-home" else held.get(e, set()))
            near = {t for t in range(R) if t // dsz in doms}
            if far_floor:
                floor, cap = min(far_floor, x), min(avail, x + X)

                def far_ok(t, floor=floor, cap=cap, near=near):
                    return t in near or min(slack[t], cap) >= floor
            else:

                def far_ok(t):
                    return True

            t = _pick(slack, free, min(x, avail), avail, rule, near, mode, far_ok)
            if t == -1:
                return None, d
            q = min(slack[t], avail, x + X)
            if q < fl:
                return None, d
            replicas.append((e, t, q))
            held.setdefault(e, set()).add(t // dsz)
            slack[t] -= q
            free[t] -= 1
            x -= q
            exported[e] += q
        slack[d] = -x
    return replicas, None


def _try(tau, load_e, L, S, F, K, dsz, mode, far_floor):
    """try(tau) with the floor F: the plain attempts, then the repairs; replicas or None."""
    if tau >= max(L):
        return []
    plain = [d for d in sorted(range(len(L)), key=lambda d: (-L[d], d)) if L[d] > tau]
    args = (dsz, mode, far_floor)
    for rule in ("loose", "strict"):
        replicas, _ = _attempt(tau, load_e, L, S, F, K, rule, plain, *args)
        if replicas is not None:
            return replicas
    for rule in ("loose", "strict", "most"):
        order = plain
        replicas, d = _attempt(tau, load_e, L, S, F, K, rule, order, *args)
        for _ in range(3):
            if replicas is not None or d == order[0]:
                break
            order = [d] + [u for u in order if u != d]
            replicas, d = _attempt(tau, load_e, L, S, F, K, rule, order, *args)
        if replicas is not None:
            return replicas
    return None


def plan_replicas(loads, S, F, K, eps, dsz, mode=None, far_floor=0):
    """The replicas ``[(expert, target, quota)]`` in creation order and the final rank loads
    [R] of the threshold search of PLANNER.md (fast path, then the fallback's coarse and refine
    probes) over ``_try``."""
    assert eps > 0, "the default path only"
    R, E = loads.shape
    E_m = E // R
    load_e = [int(v) for v in loads.sum(axis=0, dtype=np.int64)]
    L = [sum(load_e[d * E_m : (d + 1) * E_m]) for d in range(R)]
    T, Lmax = sum(L), max(L)
    won = []

    def probe(tau):
        replicas = [] if tau >= Lmax else _try(tau, load_e, L, S, F, K, dsz, mode, far_floor)
        if replicas is not None:
            won.append(replicas)
        return replicas is not None

    def search():
        if T == 0 or S == 0 or R == 1:
            return
        tau0 = max(-(-T // R), int(np.floor(float(T) * (1.0 + eps) / float(R))))
        if tau0 >= Lmax:
            return
        delta = max(1, int(np.ceil(float(T) * eps / float(R) / 2.0)))
        if any(probe(tau0 + k * delta) for k in range(4)):
            return
        lo = tau0 + 3 * delta
        c = [lo] + [lo + ((Lmax - lo) * j) // 32 for j in range(1, 32)]
        for j in range(1, 32):
            if probe(c[j]):
                for i in range(1, 16):
                    r = c[j - 1] + ((c[j] - c[j - 1]) * i) // 16
                    if c[j - 1] < r < c[j] and probe(r):
                        return
                return  # else c_j's replicas win

    search()
    replicas = won[-1] if won else []
    rank_load = list(L)
    for e, t, q in replicas:
        rank_load[e // E_m] -= q
        rank_load[t] += q
    return replicas, np.asarray(rank_load, np.int64)


#: The fields of a `uep.Plan` that `assert_is_library` compares.
PLAN_FIELDS = ("slot_expert", "slot_quota", "rank_load")


def assert_is_library(replicas, rank_load, plan: dict, context) -> None:
    """Asserts that ``(replicas, rank_load)`` of `plan_replicas` are the library's ``plan``
    (NumPy arrays of `PLAN_FIELDS` of one `uep.Plan`): the same rank loads and the same replicas
    in the same slots (slot s of rank t holds the s-th replica created on t)."""
    assert (np.asarray(rank_load) == plan["rank_load"]).all(), context
    slots, quotas = np.full_like(plan["slot_expert"], -1), np.zeros_like(plan["slot_quota"])
    taken = [0] * slots.shape[0]
    for e, t, q in replicas:
        slots[t, taken[t]], quotas[t, taken[t]] = e, q
        taken[t] += 1
    assert (slots == plan["slot_expert"]).all() and (quotas == plan["slot_quota"]).all(), context
