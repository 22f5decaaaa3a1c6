"""Plain NumPy/Python reference of the quota planner described in ``ffi/PLANNER.md``.

This module is an independent, deliberately simple rendering of the normative spec
(``ffi/PLANNER.md``): linear scans, no heaps, Python integers (which are exact and therefore
agree with the spec's 64-bit integer arithmetic whenever that arithmetic does not overflow), and
Python floats for the two IEEE-double formulas (``tau0`` and ``delta``), evaluated in exactly the
order the spec gives and clamped to ``Lmax`` as the spec says. The tests compare it bit for bit
with the C++ planner, so every tie break follows the spec literally.

Public API:

- ``reference_plan(loads, slots_per_rank, min_tokens_per_replica, balance_eps,
  master_keep_tokens=1, capacity=0, ranks_per_domain=None) -> dict`` with int32 arrays
  ``slot_expert [R,S]`` (-1 empty), ``slot_quota [R,S]``, ``master_quota [E]``, ``rank_load [R]``
  (``ranks_per_domain``: the fast domains of the fit rule in pick_target; None: one domain).
- ``reference_plan_info(...)``: same arguments; returns ``(plan, info)`` where ``info`` also
  holds the chosen threshold ``tau``, ``tau0``, ``delta``, the replicas in creation order, the
  probes that were evaluated and which attempt made the replicas (useful for debugging a mismatch
  with the C++ planner).
- ``attempt``, ``repair``, ``oracle`` (``try``) and ``search_tau``: the spec's pieces, for
  hand-worked tests.
- ``rank_loads_before(loads) -> [R]``: master-only rank loads ``L``.
- ``check_plan_invariants(loads, plan, slots_per_rank)``: asserts the plan invariants (every
  expert's quotas sum to its load, no rank holds an expert twice, quotas >= 0, ``rank_load``
  consistent with the quotas).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

INT32_MAX = 2**31 - 1

__all__ = [
    "LOOSE",
    "MOST",
    "STRICT",
    "attempt",
    "attempt_in_order",
    "check_plan_invariants",
    "compute_delta",
    "compute_tau0",
    "oracle",
    "oracle_info",
    "plain_order",
    "rank_loads_before",
    "repair",
    "reference_plan",
    "reference_plan_info",
    "search_tau",
]


# --------------------------------------------------------------------------------------------
# Derived quantities
# --------------------------------------------------------------------------------------------


def _as_loads(loads) -> np.ndarray:
    arr = np.asarray(loads)
    if arr.ndim != 2:
        raise ValueError(f"loads must be 2-D [R, E], got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"loads must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        raise ValueError("loads must be non-negative")
    return arr


def _expert_loads(loads64: np.ndarray) -> list[int]:
    """load_e[e] = sum_r loads[r, e], as Python ints."""
    R, E = loads64.shape
    return [int(sum(int(loads64[r, e]) for r in range(R))) for e in range(E)]


def _master_loads(load_e: list[int], R: int) -> list[int]:
    E = len(load_e)
    E_m = E // R
    return [sum(load_e[d * E_m + j] for j in range(E_m)) for d in range(R)]


def rank_loads_before(loads) -> np.ndarray:
    """Master-only rank loads ``L[d] = sum_{j < E_m} load_e[d * E_m + j]`` (int64 array [R])."""
    arr = _as_loads(loads)
    R, E = arr.shape
    if R < 1 or E % R != 0:
        raise ValueError(f"need R >= 1 and E % R == 0, got R={R}, E={E}")
    return np.asarray(_master_loads(_expert_loads(arr), R), dtype=np.int64)


def compute_tau0(T: int, R: int, eps: float, lmax: int | None = None) -> int:
    """tau0 = max(ceil(T / R), clampfloor(double(T) * (1.0 + eps) / double(R))).

    The first term in exact integers, the second as add, multiply, then divide, then floor. With
    ``lmax`` the floor is clamped as in the spec: ``lmax`` whenever the double is not below
    ``lmax`` (huge ``eps``, inf, NaN). Without it a non-finite double raises ValueError.
    """
    v = float(T) * (1.0 + float(eps))
    v = v / float(R)
    if lmax is not None and not v < float(lmax):
        return max(-(-T // R), int(lmax))
    if not math.isfinite(v):
        raise ValueError("tau0 is not a finite double (balance_eps too large)")
    return max(-(-T // R), math.floor(v))


def compute_delta(T: int, R: int, eps: float, lmax: int | None = None) -> int:
    """delta = max(1, clampceil(double(T) * eps / double(R) / 2.0)), evaluated left to right;
    with ``lmax`` clamped to ``lmax`` as in the spec (else a non-finite double raises)."""
    v = float(T) * float(eps)
    v = v / float(R)
    v = v / 2.0
    if lmax is not None and not v < float(lmax):
        return max(1, int(lmax))
    if not math.isfinite(v):
        raise ValueError("delta is not a finite double (balance_eps too large)")
    return max(1, math.ceil(v))


# --------------------------------------------------------------------------------------------
# The oracle: attempt(tau, f, rule, order), repair(tau, f, rule) and try(tau)
# --------------------------------------------------------------------------------------------


LOOSE, STRICT, MOST = "loose", "strict", "most"  # the target rules of pick_target
REPAIR_MOVES = 3  # repair(tau, f, rule): at most this many reordered attempts after the plain one


def _rank_order(L: list[int]) -> list[int]:
    # L descending, ties by rank index ascending.
    return sorted(range(len(L)), key=lambda d: (-L[d], d))


def plain_order(L: list[int], tau: int) -> list[int]:
    """The plain order D: the overloaded ranks (L > tau) in rank order."""
    return [d for d in _rank_order(L) if L[d] > tau]


def _rule(rule) -> str:
    """A target rule by name; a bool is the old ``strict`` flag (False: loose, True: strict)."""
    if isinstance(rule, bool):
        return STRICT if rule else LOOSE
    if rule not in (LOOSE, STRICT, MOST):
        raise ValueError(f"unknown target rule {rule!r}")
    return rule


def _near_ranks(R: int, ranks_per_domain: int, source: int, e: int, replicas) -> set[int]:
    """The near ranks for a replica of expert ``e`` given by ``source``: every rank of a fast
    domain (``ranks_per_domain`` consecutive ranks) that is the source's or already holds a replica
    of ``e`` among ``replicas`` (the attempt's so far)."""
    domains = {source // ranks_per_domain}
    domains |= {t // ranks_per_domain for x, t, _ in replicas if x == e}
    return {t for t in range(R) if t // ranks_per_domain in domains}


def _pick_target(slack: list[int], free: list[int], need: int, a: int, rule: str, near=None) -> int:
    """Among ranks with a free slot and slack: with ``most`` the most slack; else (with ``strict``
    leaving out those with one free slot and more slack than ``a``, unless that leaves none) the
    least slack >= need (best fit; among those a rank in ``near`` first, when there is one), else
    the most slack; ties -> smallest rank. -1 if there is no candidate. ``near`` None: every rank
    is near (one domain)."""
    candidates = [t for t in range(len(slack)) if free[t] > 0 and slack[t] > 0]
    if not candidates:
        return -1
    most = min(candidates, key=lambda t: (-slack[t], t))
    if rule == MOST:
        return most
    if rule == STRICT:
        kept = [t for t in candidates if not (free[t] == 1 and slack[t] > a)]
        if kept:
            candidates = kept
            most = min(candidates, key=lambda t: (-slack[t], t))
    fits = [t for t in candidates if slack[t] >= need]
    near_fits = [t for t in fits if near is None or t in near]
    if near_fits:  # the fit rule: a near target that takes everything, before a far one
        return min(near_fits, key=lambda t: (slack[t], t))
    if fits:
        return min(fits, key=lambda t: (slack[t], t))
    return most


def _domain_size(R: int, ranks_per_domain) -> int:
    """d: ranks per fast domain (R, one domain, for None); it must divide R."""
    d = R if ranks_per_domain is None else int(ranks_per_domain)
    if d < 1 or R % d:
        raise ValueError(f"ranks_per_domain must be >= 1 and divide R={R}, got {ranks_per_domain}")
    return d


def attempt_in_order(tau, load_e, L, S, f, K, rule, order, ranks_per_domain=None):
    """``attempt(tau, f, rule, order)`` of PLANNER.md with fast domains of ``ranks_per_domain``
    ranks (None: one domain).

    ``order`` lists the overloaded ranks (L > tau), each once. Returns ``(success, replicas,
    failed)``: ``replicas`` a list of ``(expert, target, quota)`` in creation order (empty on
    failure), ``failed`` the source rank the attempt failed at (None on success).
    """
    rule = _rule(rule)
    R = len(L)
    dsz = _domain_size(R, ranks_per_domain)
    E_m = len(load_e) // R
    Lmax = max(L) if L else 0
    if tau >= Lmax:
        return True, [], None
    assert sorted(order) == sorted(plain_order(L, tau)), order  # each overloaded rank once
    slack = [max(tau - L[t], 0) for t in range(R)]
    free = [S] * R
    exported = [0] * len(load_e)
    replicas: list[tuple[int, int, int]] = []
    X = sum(max(L[d] - tau, 0) for d in range(R))
    for d in order:
        x = L[d] - tau
        X -= x  # what the ranks after d must still shed
        masters = range(d * E_m, (d + 1) * E_m)
        while x > 0:
            fl = min(f, x)  # adaptive floor
            # the master with the most tokens left to give; ties -> smallest index
            e = min(masters, key=lambda m: (-(load_e[m] - K - exported[m]), m))
            avail = load_e[e] - K - exported[e]
            if avail < fl:
                return False, [], d
            near = _near_ranks(R, dsz, d, e, replicas)
            t = _pick_target(slack, free, min(x, avail), avail, rule, near)
            if t == -1:
                return False, [], d
            # fill the target as far as the expert allows and the later ranks can use
            q = min(slack[t], avail, x + X)
            if q < fl:
                return False, [], d
            replicas.append((e, t, q))
            slack[t] -= q
            free[t] -= 1
            x -= q
            exported[e] += q
        slack[d] = -x  # over-export makes d a target for the ranks after it
    return True, replicas, None


def attempt(
    tau: int,
    load_e: list[int],
    L: list[int],
    S: int,
    f: int,
    K: int,
    rule,
    order=None,
    ranks_per_domain=None,
):
    """``attempt(tau, f, rule, order)`` of PLANNER.md with ``rule`` a target rule's name or a bool
    (the ``strict`` flag: False loose, True strict), ``order`` the plain order D unless given and
    fast domains of ``ranks_per_domain`` ranks (None: one domain).

    Returns ``(success, replicas)`` with ``replicas`` a list of ``(expert, target, quota)`` in
    creation order (empty on failure).
    """
    order = plain_order(L, tau) if order is None else order
    ok, replicas, _ = attempt_in_order(tau, load_e, L, S, f, K, rule, order, ranks_per_domain)
    return ok, replicas


def repair(tau, load_e, L, S, f, K, rule, ranks_per_domain=None):
    """``repair(tau, f, rule)`` of PLANNER.md: the plain attempt, then up to ``REPAIR_MOVES`` more,
    each with the source that failed the previous one moved to the front of the order.

    Returns ``(success, replicas, order)`` (the order of the successful attempt, or the last one).
    """
    dsz = ranks_per_domain
    order = plain_order(L, tau)
    ok, replicas, d = attempt_in_order(tau, load_e, L, S, f, K, rule, order, dsz)
    for _ in range(REPAIR_MOVES):
        if ok or d == order[0]:
            break
        order = [d] + [u for u in order if u != d]
        ok, replicas, d = attempt_in_order(tau, load_e, L, S, f, K, rule, order, dsz)
    return ok, replicas, order


def oracle_info(tau, load_e, L, S, F, K, exact=False, ranks_per_domain=None):
    """``try(tau)`` of PLANNER.md (fast domains of ``ranks_per_domain`` ranks; None: one), with
    how it succeeded.

    Returns ``(success, replicas, how)``: ``how`` is ``(pass, f, rule, order)`` of the successful
    attempt (``pass`` "plain" or "repair"; None when ``tau >= Lmax`` or on failure).
    """
    if tau >= (max(L) if L else 0):
        return True, [], None
    floors = [F, 1] if exact and F > 1 else [F]
    D = plain_order(L, tau)
    dsz = ranks_per_domain
    for f in floors:
        for rule in (LOOSE, STRICT):
            ok, replicas, _ = attempt_in_order(tau, load_e, L, S, f, K, rule, D, dsz)
            if ok:
                return True, replicas, ("plain", f, rule, D)
    for f in floors:
        for rule in (LOOSE, STRICT, MOST):
            ok, replicas, order = repair(tau, load_e, L, S, f, K, rule, dsz)
            if ok:
                return True, replicas, ("repair", f, rule, order)
    return False, [], None


def oracle(
    tau: int,
    load_e: list[int],
    L: list[int],
    S: int,
    F: int,
    K: int,
    exact: bool = False,
    ranks_per_domain=None,
):
    """``try(tau)`` of PLANNER.md: the plain attempts (F, loose), (F, strict), and, if the probe may
    give up the floor (``exact``: exact mode or a capacity-window probe) and F > 1, also
    (1, loose), (1, strict); then the repairs for the same floors with the rules loose, strict and
    most; until one succeeds.

    Returns ``(success, replicas)`` of the first successful attempt (``(False, [])`` if none).
    """
    ok, replicas, _ = oracle_info(tau, load_e, L, S, F, K, exact, ranks_per_domain)
    return ok, replicas


# --------------------------------------------------------------------------------------------
# The threshold search
# --------------------------------------------------------------------------------------------


def _refine(a: int, b: int, probe) -> int:
    """The refine probes between a failed ``a`` and a successful ``b``: the first success wins,
    else ``b``."""
    for i in range(1, 16):
        r_i = a + ((b - a) * i) // 16
        if r_i <= a or r_i >= b:
            continue
        if probe(r_i):
            return r_i
    return b


def _window(a: int, b: int, delta: int, probe) -> int | None:
    """``window(a, b)`` of PLANNER.md: the winning threshold, or None if the window fails."""
    if probe(a):
        return a
    p = a
    for k in range(1, 4):
        if a + k * delta > b:
            break
        p = a + k * delta
        if probe(p):
            return p
    if p >= b:
        return None
    c = [p] + [p + ((b - p) * j) // 32 for j in range(1, 33)]  # c[0] = p, c[32] = b
    for j in range(1, 33):
        if probe(c[j]):
            return _refine(c[j - 1], c[j], probe)
    return None


def search_tau(
    T: int,
    Lmax: int,
    R: int,
    S: int,
    eps: float,
    try_fn: Callable[[int], bool],
    probes: list[int] | None = None,
    capacity: int = 0,
    try_window: Callable[[int], bool] | None = None,
):
    """The fixed probe sequence of PLANNER.md.

    ``try_fn(tau)`` reports whether the oracle succeeds at ``tau``; it is only called for
    ``tau < Lmax`` (probes with ``tau >= Lmax`` succeed with no replicas without calling it).
    Every evaluated probe is appended to ``probes`` when given. ``capacity`` 0 means unbounded.
    The capacity window's probes call ``try_window`` (default ``try_fn``): there the oracle may
    give up the floor.
    Returns ``(tau, tau0, delta)``; ``delta`` is None when the search short-circuits.
    ``tau == Lmax`` (or any ``tau >= Lmax``) means "no replicas".
    """

    def prober(fn):
        def probe(tau: int) -> bool:
            if probes is not None:
                probes.append(tau)
            if tau >= Lmax:
                return True
            return bool(fn(tau))

        return probe

    probe = prober(try_fn)

    tau0 = compute_tau0(T, R, eps, Lmax) if R >= 1 else 0
    if T == 0 or S == 0 or R == 1:
        return Lmax, tau0, None
    mean_ceil = -(-T // R)
    C = int(capacity)
    if 0 < C < Lmax and C >= mean_ceil:
        delta = compute_delta(T, R, eps, Lmax)
        window_probe = prober(try_window or try_fn)
        a = min(tau0, C)
        tau = _window(a, C, delta, window_probe)
        if tau is None and a > mean_ceil:  # then the thresholds below a, down to M
            tau = _window(mean_ceil, a - 1, delta, window_probe)
        if tau is not None:
            return tau, tau0, delta
    if tau0 >= Lmax:
        return Lmax, tau0, None
    delta = compute_delta(T, R, eps, Lmax)

    # fast path
    for k in range(4):
        tau = tau0 + k * delta
        if probe(tau):
            return tau, tau0, delta

    # fallback
    lo = tau0 + 3 * delta
    span = Lmax - lo  # > 0: the fast path failed, so lo < Lmax
    c = [lo] + [lo + (span * j) // 32 for j in range(1, 32)]  # c[0] = lo
    for j in range(1, 32):
        if probe(c[j]):
            return _refine(c[j - 1], c[j], probe), tau0, delta
    return Lmax, tau0, delta


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


def reference_plan_info(
    loads,
    slots_per_rank: int,
    min_tokens_per_replica: int,
    balance_eps: float,
    master_keep_tokens: int = 1,
    capacity: int = 0,
    ranks_per_domain: int | None = None,
):
    """The plan of PLANNER.md for ``loads[R, E]`` (``capacity`` 0: unbounded; fast domains of
    ``ranks_per_domain`` consecutive ranks, None: one domain) and how the search reached it:
    ``(plan, info)``.

    ``plan``: a dict of int32 NumPy arrays: ``slot_expert [R,S]`` (-1 empty), ``slot_quota
    [R,S]`` (0 empty), ``master_quota [E]``, ``rank_load [R]``.

    ``info``: ``tau`` (the winning threshold; ``Lmax`` when the search found nothing better or
    short-circuited), ``tau0``, ``delta`` (None when the search short-circuited or ended before
    it needed one), ``replicas`` (``(expert, target, quota)`` in creation order), ``probes``
    (the evaluated thresholds, in order), ``how`` (which attempt of the winning ``try`` made the
    replicas: ``(pass, f, rule, order)`` as in ``oracle_info``; None without replicas),
    ``load_e`` and ``L`` (lists of Python ints), ``T``, ``Lmax``.

    Raises ValueError on invalid input (negative loads, ``load_e`` or ``L`` above 2^31 - 1,
    ``E % R != 0``, bad parameters).
    """
    arr = _as_loads(loads)
    R, E = arr.shape
    S = int(slots_per_rank)
    F = int(min_tokens_per_replica)
    K = int(master_keep_tokens)
    eps = float(balance_eps)
    C = int(capacity)
    if R < 1:
        raise ValueError("need R >= 1")
    if E % R != 0:
        raise ValueError(f"E % R must be 0, got E={E}, R={R}")
    if S < 0:
        raise ValueError("slots_per_rank must be >= 0")
    if F < 1:
        raise ValueError("min_tokens_per_replica must be >= 1")
    if K < 0:
        raise ValueError("master_keep_tokens must be >= 0")
    if not (eps >= 0.0):
        raise ValueError("balance_eps must be a double >= 0 (not NaN)")
    if C < 0:
        raise ValueError("capacity must be >= 0 (0: unbounded)")
    dsz = _domain_size(R, ranks_per_domain)
    exact = eps == 0.0
    E_m = E // R

    load_e = _expert_loads(arr)
    L = _master_loads(load_e, R)
    if any(v > INT32_MAX for v in load_e) or any(v > INT32_MAX for v in L):
        raise ValueError("a load_e or L exceeds 2^31 - 1")
    T = sum(L)
    Lmax = max(L) if L else 0

    won = {"tau": None, "replicas": [], "how": None}  # the last successful probe: the winner

    def probe_with(any_floor: bool):
        def try_tau(tau: int) -> bool:
            ok, replicas, how = oracle_info(tau, load_e, L, S, F, K, any_floor, dsz)
            if ok:
                won.update(tau=tau, replicas=replicas, how=how)
            return ok

        return try_tau

    probes: list[int] = []
    # The capacity window's probes may give up the floor.
    tau, tau0, delta = search_tau(
        T, Lmax, R, S, eps, probe_with(exact), probes, C, probe_with(True)
    )
    # A success ends the search (a refine probe's, or else c_{j*}'s, which was the last success):
    # the winner's replicas are those of the last successful probe's try; none at tau >= Lmax.
    if tau < Lmax:
        assert won["tau"] == tau, "the winning threshold must succeed"
        replicas, how = won["replicas"], won["how"]
    else:
        replicas, how = [], None

    # Output: replicas placed in creation order; the n-th replica created on t takes slot n of t.
    slot_expert = np.full((R, S), -1, dtype=np.int64)
    slot_quota = np.zeros((R, S), dtype=np.int64)
    used = [0] * R
    exported = [0] * E
    received = [0] * R
    for e, t, q in replicas:
        n = used[t]
        slot_expert[t, n] = e
        slot_quota[t, n] = q
        used[t] = n + 1
        exported[e] += q
        received[t] += q
    master_quota = np.asarray([load_e[e] - exported[e] for e in range(E)], dtype=np.int64)
    rank_load = np.asarray(
        [L[d] - sum(exported[d * E_m + j] for j in range(E_m)) + received[d] for d in range(R)],
        dtype=np.int64,
    )
    plan = {
        "slot_expert": slot_expert.astype(np.int32),
        "slot_quota": slot_quota.astype(np.int32),
        "master_quota": master_quota.reshape(E).astype(np.int32),
        "rank_load": rank_load.reshape(R).astype(np.int32),
    }
    info = {
        "tau": tau,
        "tau0": tau0,
        "delta": delta,
        "replicas": replicas,
        "probes": probes,
        "how": how,
        "load_e": load_e,
        "L": L,
        "T": T,
        "Lmax": Lmax,
    }
    return plan, info


def reference_plan(*args, **kwargs) -> dict:
    """The plan of `reference_plan_info` (the same arguments) alone."""
    plan, _ = reference_plan_info(*args, **kwargs)
    return plan


# --------------------------------------------------------------------------------------------
# Invariants
# --------------------------------------------------------------------------------------------


def check_plan_invariants(loads, plan, slots_per_rank: int) -> None:
    """Assert the plan invariants of ``plan`` (any array-likes, e.g. jax arrays) for ``loads``."""
    arr = np.asarray(loads).astype(np.int64)
    assert arr.ndim == 2, arr.shape
    R, E = arr.shape
    S = int(slots_per_rank)
    assert R >= 1 and E % R == 0, (R, E)
    E_m = E // R
    load_e = arr.sum(axis=0)
    L = np.asarray([load_e[d * E_m : (d + 1) * E_m].sum() for d in range(R)], dtype=np.int64)

    slot_expert = np.asarray(plan["slot_expert"]).astype(np.int64)
    slot_quota = np.asarray(plan["slot_quota"]).astype(np.int64)
    master_quota = np.asarray(plan["master_quota"]).astype(np.int64)
    rank_load = np.asarray(plan["rank_load"]).astype(np.int64)
    assert slot_expert.shape == (R, S), (slot_expert.shape, (R, S))
    assert slot_quota.shape == (R, S), (slot_quota.shape, (R, S))
    assert master_quota.shape == (E,), (master_quota.shape, E)
    assert rank_load.shape == (R,), (rank_load.shape, R)

    # every quota >= 0
    assert (master_quota >= 0).all(), f"negative master quota: {master_quota}"
    assert (slot_quota >= 0).all(), f"negative slot quota: {slot_quota}"

    # empty slots: expert -1 and quota 0; filled slots: a valid expert and quota >= 1
    empty = slot_expert == -1
    assert ((slot_expert == -1) | ((slot_expert >= 0) & (slot_expert < E))).all(), (
        f"slot expert out of range: {slot_expert}"
    )
    assert (slot_quota[empty] == 0).all(), f"empty slot with a quota: {slot_expert} {slot_quota}"
    assert (slot_quota[~empty] >= 1).all(), (
        f"filled slot with quota < 1: {slot_expert} {slot_quota}"
    )

    # no rank holds an expert twice (the master counts as holding it)
    for d in range(R):
        held = list(range(d * E_m, (d + 1) * E_m)) + [int(e) for e in slot_expert[d] if e >= 0]
        assert len(held) == len(set(held)), f"rank {d} holds an expert twice: {held}"

    # for every expert, master quota + its replicas' quotas == load_e
    total = master_quota.copy()
    for d in range(R):
        for s in range(S):
            e = int(slot_expert[d, s])
            if e >= 0:
                total[e] += slot_quota[d, s]
    assert (total == load_e).all(), f"quotas do not sum to load_e: {total} vs {load_e}"

    # rank_load consistent with the quotas
    expect = np.asarray(
        [master_quota[d * E_m : (d + 1) * E_m].sum() + slot_quota[d].sum() for d in range(R)],
        dtype=np.int64,
    )
    assert (rank_load == expect).all(), f"rank_load {rank_load} != quotas {expect}"
    assert int(rank_load.sum()) == int(L.sum()) == int(load_e.sum()), (
        f"sum(rank_load)={rank_load.sum()} != sum(loads)={arr.sum()}"
    )
