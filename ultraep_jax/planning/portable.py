"""The portable planner: the plan of the C++ core (ffi/PLANNER.md), bit for bit, in JAX itself.

Runs on any JAX platform (TPU, ROCm, CUDA without the native handler) under `jit`, `vmap` and
`shard_map`, nothing going back to the host. The threshold search's probes are one fixed list
(the capacity windows' fast and coarse probes, then the ladder's), known from the derived
quantities before any probe runs. The first attempt of the first probe runs alone: most
searches end there, with one loop of one iteration per replica (`search`). Only where it fails
does the whole search run (a `cond`): the first probe alone, then the rest `LANES` probes at a
time (`vmap` over the thresholds, as the parallel form puts them on warps), the first success in
list order winning, then the refine probes below a winning coarse probe in the same loop.
`try(tau)` is `portable_attempt.try_threshold`. Arithmetic is int64 and the two tolerance
formulas IEEE double (traced under `jax.enable_x64`). Only the sizes, exact mode and whether a
capacity bounds the plan are static; F, K, eps and the capacity are traced (`scalar_args`), so
one compiled planner serves every floor and tolerance of a size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ultraep_jax._vma import vary, varying_axes
from ultraep_jax.planning.portable_attempt import (
    LOOSE,
    SKIPPED,
    SUCCESS,
    Replicas,
    Sizes,
    Totals,
    attempt,
    attempt_result,
    first_max,
    no_replicas,
    try_threshold,
    while_varying,
)

#: Probes run at once: one `vmap` lane each.
LANES = 8
_INT32_MAX = 2**31 - 1
_COARSE = 32  # a window's coarse probes (the ladder's: 31)
_REFINE = 15


def _sums(sz: Sizes, loads):
    """(load_e [E], L [R], bad []): the experts' and the ranks' (master) loads of ``loads``
    [R, E] int32, int64, and whether the core rejects them (a negative load, or an expert's or
    a rank's total above int32)."""
    load_e = jnp.sum(loads.astype(jnp.int64), axis=0)
    L = jnp.sum(load_e.reshape(sz.R, sz.Em), axis=1)
    bad = (jnp.min(loads) < 0) | (jnp.max(load_e) > _INT32_MAX) | (jnp.max(L) > _INT32_MAX)
    return load_e, L, bad


def _totals(load_e, L, F, K):
    """(`Totals`, T []): the derived quantities of the loads ``load_e`` [E], ``L`` [R] (`_sums`)
    with the floor ``F`` and keep ``K``."""
    # Descending L, ties by rank: a stable sort of -L.
    rank_order = jnp.argsort(-L, stable=True).astype(jnp.int64)
    tot = Totals(load_e, L, rank_order, jnp.max(L), F.astype(jnp.int64), K.astype(jnp.int64))
    return tot, jnp.sum(L)


def _clamped(v, lmax, rounding):
    """clampfloor / clampceil of PLANNER.md: ``rounding(v)`` as int64 below ``lmax``, else
    ``lmax`` (also for inf and NaN)."""
    below = v < lmax.astype(jnp.float64)
    return jnp.where(below, rounding(jnp.where(below, v, 0.0)).astype(jnp.int64), lmax)


def _start(sz: Sizes, exact: bool, eps, T, lmax):
    """(M, tau0, delta) of PLANNER.md, "Derived quantities", for the tolerance ``eps`` [] float64;
    ``exact`` (eps == 0, decided on the host: the CPU flushes a subnormal eps to zero) is M and 1
    with no floating point."""
    M = (T + sz.R - 1) // sz.R
    if exact:
        return M, M, jnp.ones((), jnp.int64)
    Td, Rd = T.astype(jnp.float64), np.float64(sz.R)
    tau0 = jnp.maximum(M, _clamped(Td * (1.0 + eps) / Rd, lmax, jnp.floor))
    delta = jnp.maximum(1, _clamped(Td * eps / Rd / np.float64(2.0), lmax, jnp.ceil))
    return M, tau0, delta


def _fast(a, b, delta, run):
    """(taus [4], valid [4], p): a window's fast probes a + k * delta (k < 4, while <= b) and
    the last of them."""
    k = jnp.arange(4)
    taus = a + k * delta
    valid = run & ((k == 0) | (taus <= b))
    return taus, valid, jnp.max(jnp.where(valid, taus, a))


def _coarse(p, b, count, run):
    """(taus [count], valid [count]): c_j = p + (b - p) * j / 32 for j = 1 .. count."""
    taus = p + (b - p) * jnp.arange(1, count + 1) // _COARSE
    return taus, jnp.broadcast_to(run, (count,))


def _window(a, b, delta, run):
    """window(a, b) of PLANNER.md as a list: (taus, valid, the coarse probes' base p)."""
    ft, fv, p = _fast(a, b, delta, run)
    ct, cv = _coarse(p, b, _COARSE, run & (p < b))
    return jnp.concatenate([ft, ct]), jnp.concatenate([fv, cv]), p


def probe_list(sz: Sizes, sc: Scalars, T, lmax):
    """The search's probes in order, before any runs (PLANNER.md, "The threshold search"):
    (taus [N], valid [N] bool, any_floor [N] bool, base [N]: the refine probes' lower end for a
    coarse probe, -1 for a fast one). N = 2 * 36 + 35 with a capacity, else 35."""
    M, tau0, delta = _start(sz, sc.exact, sc.eps, T, lmax)
    run = T > 0
    lists = []
    if sc.capped:
        cap = sc.capacity
        applies = run & (cap < lmax) & (cap >= M)
        a = jnp.minimum(tau0, cap)
        for lo, hi, ok in ((a, cap, applies), (M, a - 1, applies & (a > M))):
            taus, valid, p = _window(lo, hi, delta, ok)
            lists.append((taus, valid, True, p))
    ladder = run & (tau0 < lmax)
    ft = tau0 + jnp.arange(4) * delta
    lo = tau0 + 3 * delta
    ct, cv = _coarse(lo, lmax, _COARSE - 1, ladder & (lo < lmax))
    lists.append(
        (
            jnp.concatenate([ft, ct]),
            jnp.concatenate([jnp.broadcast_to(ladder, (4,)), cv]),
            sc.exact,
            lo,
        )
    )
    taus = jnp.concatenate([t for t, _, _, _ in lists])
    valid = jnp.concatenate([v for _, v, _, _ in lists])
    any_floor = jnp.concatenate([jnp.full(t.shape, af) for t, _, af, _ in lists])
    # A coarse probe's refine probes lie above the probe before it (c_0 = p); a fast one has none.
    base = jnp.concatenate(
        [jnp.concatenate([jnp.full(4, -1), p[None], t[4:-1]]) for t, _, _, p in lists]
    )
    return taus, valid, any_floor, base


def _skip_repeats(taus, valid, lmax):
    """bool [N]: the probes that run: the valid ones, less each that repeats the previous valid
    probe's threshold below ``lmax`` (it failed there: the core skips it)."""
    n = taus.shape[0]
    i = jnp.arange(n)
    # The previous valid probe's index (-1: none), one [N, N] reduction (a cumulative max is a
    # scan of log N steps on XLA:CPU).
    prev = jnp.max(jnp.where(valid[None, :] & (i[None, :] < i[:, None]), i[None, :], -1), axis=1)
    repeat = (prev >= 0) & (taus == taus[jnp.maximum(prev, 0)]) & (taus < lmax)
    return valid & ~repeat


def _refine_list(tot: Totals, lo, hi, any_floor, n):
    """(taus [n], run [n], any_floor [n]): the refine probes between a winning coarse probe
    ``hi`` and the probe before it ``lo`` (-1: the winner is a fast probe, which has none),
    padded to ``n`` >= 15 entries that do not run."""
    r = lo + (hi - lo) * jnp.arange(1, n + 1) // (_REFINE + 1)
    r_valid = (lo >= 0) & (r > lo) & (r < hi) & (jnp.arange(n) < _REFINE)
    return r, _skip_repeats(r, r_valid, tot.lmax), jnp.full((n,), any_floor)


# The whole search's state (`_search_all`): the probes still to run, `LANES` at a time, in the
# list ``taus`` [N] (``run``, ``any_floor``), then the refine probes of a winning coarse probe.
_COARSE_PHASE, _REFINE_PHASE, _DONE = range(3)


def _after(tot: Totals, lists, st, hit, k, reps):
    """The search's state after a round of ``st["phase"]`` that ended at the probe ``k`` of the
    current list (``hit``: it succeeded, with ``reps``; else the round's last probe): a coarse
    probe's success records its replicas and turns to its refine probes (a fast probe's ends the
    search); a refine probe's success ends it; a round without one moves on, and the last ends
    the phase (the search's end)."""
    taus, base, any_floor = lists
    phase, n = st["phase"], st["taus"].shape[0]
    coarse_hit = hit & (phase == _COARSE_PHASE)
    lo, hi = base[jnp.minimum(k, base.shape[0] - 1)], st["taus"][jnp.minimum(k, n - 1)]
    refine = _refine_list(tot, lo, hi, any_floor[jnp.minimum(k, n - 1)], n)
    i = jnp.where(coarse_hit, 0, k + 1)
    cur = (
        jnp.where(coarse_hit, refine[0], st["taus"]),
        jnp.where(coarse_hit, refine[1], st["run"]),
        jnp.where(coarse_hit, refine[2], st["any_floor"]),
    )
    pending = jnp.any(cur[1] & (jnp.arange(n) >= i))
    phase = jnp.where(coarse_hit, _REFINE_PHASE, phase)
    return {
        "i": i,
        "phase": jnp.where((hit & ~coarse_hit) | ~pending, _DONE, phase),
        "found": st["found"] | hit,
        "reps": jax.tree.map(lambda a, b: jnp.where(hit, a, b), reps, st["reps"]),
        "taus": cur[0],
        "run": cur[1],
        "any_floor": cur[2],
    }


def _rounds(sz: Sizes, tot: Totals, lists, st):
    """The search's rounds until its end: each probes the current list's next `LANES` probes
    (one `vmap` of `try_threshold`, shared by the coarse and the refine probes)."""
    probe = jax.vmap(lambda t, a, r: try_threshold(sz, tot, t, a, r))

    def body(st):
        pad = lambda v: jnp.pad(v, (0, LANES))  # noqa: E731
        sl = lambda v: jax.lax.dynamic_slice(pad(v), (st["i"],), (LANES,))  # noqa: E731
        ok, reps = probe(sl(st["taus"]), sl(st["any_floor"]), sl(st["run"]))
        j = first_max(ok)
        hit = jnp.any(ok)
        last = jnp.minimum(st["i"] + LANES, st["taus"].shape[0]) - 1
        k = jnp.where(hit, st["i"] + j, last)
        return _after(tot, lists, st, hit, k, jax.tree.map(lambda v: v[j], reps))

    return while_varying(lambda st: st["phase"] != _DONE, body, st, tot.L)


def _search_all(sz: Sizes, sc: Scalars, tot: Totals, T, go) -> Replicas:
    """The threshold search of PLANNER.md where ``go`` [] (else no probe runs): the winning
    probe's replicas (none when no probe succeeds: the threshold is Lmax), in rounds of `LANES`
    probes from the first that runs (`search` has run the first attempt alone: only a search
    where it failed comes here; one `vmap` of `try_threshold` serves every round)."""
    taus, valid, any_floor, base = probe_list(sz, sc, T, tot.lmax)
    run = _skip_repeats(taus, valid & go, tot.lmax)
    st = {
        "i": first_max(run),
        "phase": jnp.where(jnp.any(run), _COARSE_PHASE, _DONE).astype(jnp.int64),
        "found": jnp.zeros((), bool),
        "reps": no_replicas(sz),
        "taus": taus,
        "run": run,
        "any_floor": any_floor,
    }
    st = _rounds(sz, tot, (taus, base, any_floor), st)
    return jax.tree.map(lambda v, z: jnp.where(st["found"], v, z), st["reps"], no_replicas(sz))


def _first_probe(sz: Sizes, sc: Scalars, T, lmax):
    """(tau [], any_floor [], run []): the first probe of `probe_list` that runs (a fast one:
    the first capacity window's first, else the ladder's), without the list; none runs where
    ``run`` is False."""
    M, tau0, _ = _start(sz, sc.exact, sc.eps, T, lmax)
    ladder = (T > 0) & (tau0 < lmax)
    if not sc.capped:
        return tau0, jnp.asarray(sc.exact), ladder
    cap = sc.capacity
    window = (T > 0) & (cap < lmax) & (cap >= M)
    tau = jnp.where(window, jnp.minimum(tau0, cap), tau0)
    return tau, window | sc.exact, window | ladder


def search(sz: Sizes, sc: Scalars, tot: Totals, T):
    """The `Plan`'s arrays (`_write_plan`) of the threshold search of PLANNER.md: the winning
    probe's replicas (none when no probe succeeds: the threshold is Lmax). Most searches end at
    the first attempt of their first probe (the plain attempt with the floor F and the loose
    rule, try(tau)'s first): it runs alone, and the whole search (`_search_all`, which probes it
    again) only where it failed (a `cond`; under `vmap` both branches run, the whole search
    probing nothing where the first attempt succeeded). Each branch writes the plan: a short
    branch is a sequence of thunks that XLA:CPU runs in its caller's thread, where a long one
    is spread over its thread pool (a hop per thunk)."""
    tau, _, run = _first_probe(sz, sc, T, tot.lmax)
    v = attempt(sz, tot, tau, tot.F, LOOSE, tot.rank_order, run)

    def first(v):
        code, _, reps = attempt_result(sz, v)
        won = jax.tree.map(lambda a, z: jnp.where(code == SUCCESS, a, z), reps, no_replicas(sz))
        return _write_plan(sz, tot, won)

    def whole(v):
        code, _, _ = attempt_result(sz, v)
        reps = _search_all(sz, sc, tot, T, (code != SUCCESS) & (code != SKIPPED))
        return _write_plan(sz, tot, reps)

    code = attempt_result(sz, v)[0]
    return jax.lax.cond((code == SUCCESS) | (code == SKIPPED), first, whole, v)


def _write_plan(sz: Sizes, tot: Totals, reps: Replicas):
    """The `Plan`'s arrays (int32) of ``reps``, which are by slot already."""
    R, S = sz.R, sz.S
    # one scatter of R * S updates (a one-hot [E, R * S] reduction is E times the work)
    expert = jnp.where(reps.expert >= 0, reps.expert, sz.E)
    sent = jnp.zeros((sz.E,), jnp.int64).at[expert].add(reps.quota, mode="drop")
    master_quota = tot.load_e - sent
    # each rank: its masters' load, less what they sent, plus what its replicas take
    rank_load = tot.L - reps.sent + jnp.sum(reps.quota.reshape(R, S), axis=1)
    out = (reps.expert.reshape(R, S), reps.quota.reshape(R, S), master_quota, rank_load)
    return tuple(v.astype(jnp.int32) for v in out)


@dataclasses.dataclass(frozen=True)
class Scalars:
    """The plan's scalar settings: ``exact`` and ``capped`` (static: they shape the search) and
    the int32 vector ``values`` [5] (traced, so that one compiled planner serves them all; built
    by `scalar_args`): F, K, the capacity, each clamped at 2^31 - 1 (no load reaches it, so the
    plans are the same), and the 64 bits of eps as two words."""

    exact: bool
    capped: bool
    values: jax.Array

    @property
    def F(self):
        """The floor F [] int64."""
        return self.values[0].astype(jnp.int64)

    @property
    def K(self):
        """The master's keep K [] int64."""
        return self.values[1].astype(jnp.int64)

    @property
    def capacity(self):
        """The capacity C [] int64."""
        return self.values[2].astype(jnp.int64)

    @property
    def eps(self):
        """The tolerance eps [] float64, bit for bit."""
        lo, hi = (self.values[i].astype(jnp.uint32).astype(jnp.uint64) for i in (3, 4))
        return jax.lax.bitcast_convert_type((hi << 32) | lo, jnp.float64)


def scalar_args(F: int, K: int, eps: float, capacity: int) -> tuple[bool, bool, np.ndarray]:
    """(exact, capped, values [5] int32) of `Scalars` for floor ``F``, keep ``K``, tolerance
    ``eps`` and ``capacity`` (0: none), on the host."""
    bits = int(np.array(eps, np.float64).view(np.uint64))
    words = np.array([bits & 0xFFFFFFFF, bits >> 32], np.uint32).view(np.int32)
    clamped = [min(int(v), _INT32_MAX) for v in (F, K, capacity)]
    return eps == 0, capacity > 0, np.concatenate([np.asarray(clamped, np.int32), words])


def portable_plan(loads, values, R: int, E: int, S: int, g: int, exact: bool, capped: bool):
    """(slot_expert [R, S], slot_quota [R, S], master_quota [E], rank_load [R]) int32: the plan
    of checked int32 ``loads`` [R, E] for S slots and domains of g ranks, with the scalar
    settings ``exact``, ``capped`` and ``values`` of `scalar_args` (floor F, master keep K,
    tolerance eps, capacity: 0 none), as `planning.planner.plan` passes the core; every output
    -1 where the core rejects the loads."""
    sz = Sizes(R=R, E=E, S=S, g=g)
    with jax.enable_x64(True):
        sc = Scalars(exact, capped, jnp.asarray(values))
        load_e, L, bad = _sums(sz, loads)

        def planned(load_e, L):
            tot, T = _totals(load_e, L, sc.F, sc.K)
            if S == 0 or R == 1:
                return _write_plan(sz, tot, no_replicas(sz))
            return search(sz, sc, tot, T)

        def rejected(load_e, L):
            shapes = ((R, S), (R, S), (E,), (R,))
            return tuple(vary(jnp.full(s, -1, jnp.int32), varying_axes(L)) for s in shapes)

        # The plan in a branch of its own: XLA:CPU runs a sequence of thunks on its thread pool
        # (a hop per thunk) unless it is short or all its buffers are small.
        return jax.lax.cond(bad, rejected, planned, load_e, L)
