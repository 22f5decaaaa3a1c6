"""The portable planner: the plan of the C++ core (ffi/PLANNER.md), bit for bit, in JAX itself.

Runs on any JAX platform (TPU, ROCm, CUDA without the native handler) under `jit`, `vmap` and
`shard_map`, nothing going back to the host. The threshold search's probes are one fixed list
(the capacity windows' fast and coarse probes, then the ladder's), known from the derived
quantities before any probe runs. Its first probe that runs is probed alone (most searches end
there: one lane's work, not `LANES`'), then the rest `LANES` probes at a time (`vmap` over the
thresholds, as the parallel form puts them on warps), the first success in list order winning;
the refine probes below a winning coarse probe likewise. `try(tau)` is
`portable_attempt.try_threshold`. Arithmetic is int64 and the two tolerance formulas IEEE double
(traced under `jax.enable_x64`). Only the sizes, exact mode and whether a capacity bounds the
plan are static; F, K, eps and the capacity are traced (`scalar_args`), so one compiled planner
serves every floor and tolerance of a size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ultraep_jax.planning.portable_attempt import (
    Replicas,
    Sizes,
    Totals,
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


def _totals(sz: Sizes, loads, F, K):
    """(`Totals`, T [], bad []): the derived quantities of ``loads`` [R, E] int32 (with the
    floor ``F`` and keep ``K``), and whether the core rejects them (a negative load, or an
    expert's or a rank's total above int32)."""
    loads = loads.astype(jnp.int64)
    load_e = jnp.sum(loads, axis=0)
    L = jnp.sum(load_e.reshape(sz.R, sz.Em), axis=1)
    bad = jnp.any(loads < 0) | jnp.any(load_e > _INT32_MAX) | jnp.any(L > _INT32_MAX)
    # Descending L, ties by rank: a stable sort of -L.
    rank_order = jnp.argsort(-L, stable=True).astype(jnp.int64)
    tot = Totals(load_e, L, rank_order, jnp.max(L), F.astype(jnp.int64), K.astype(jnp.int64))
    return tot, jnp.sum(L), bad


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
    idx = jnp.where(valid, jnp.arange(n), -1)
    prev = jnp.concatenate([jnp.full((1,), -1), jax.lax.cummax(idx)[:-1]])
    repeat = (prev >= 0) & (taus == taus[jnp.maximum(prev, 0)]) & (taus < lmax)
    return valid & ~repeat


def _first_success(sz: Sizes, tot: Totals, taus, run, any_floor):
    """(found [], index [], `Replicas`): the first probe in list order of ``taus`` [N] (those
    ``run`` [N] marks) whose try succeeds: the first that runs alone (most searches end there),
    then those after it `LANES` at a time until one succeeds."""
    n = taus.shape[0]
    first = first_max(run)
    ok, reps = try_threshold(sz, tot, taus[first], any_floor[first], run[first])
    taus, any_floor = jnp.pad(taus, (0, LANES)), jnp.pad(any_floor, (0, LANES))
    run = jnp.pad(run, (0, LANES))
    pending = jnp.flip(jnp.cumsum(jnp.flip(run))) > 0  # some probe at or after i runs
    probe = jax.vmap(lambda t, a, r: try_threshold(sz, tot, t, a, r))

    def body(s):
        i, _, _, _ = s
        sl = lambda v: jax.lax.dynamic_slice(v, (i,), (LANES,))  # noqa: E731
        ok, reps = probe(sl(taus), sl(any_floor), sl(run))
        k = first_max(ok)
        return i + LANES, jnp.any(ok), i + k, jax.tree.map(lambda v: v[k], reps)

    def cond(s):
        i, found, _, _ = s
        return ~found & (i < n) & pending[jnp.minimum(i, n)]

    _, found, k, reps = while_varying(cond, body, (first + 1, ok, first, reps), tot.L)
    return found, k, reps


def search(sz: Sizes, sc: Scalars, tot: Totals, T) -> Replicas:
    """The threshold search of PLANNER.md: the winning probe's replicas (none when no probe
    succeeds: the threshold is Lmax)."""
    taus, valid, any_floor, base = probe_list(sz, sc, T, tot.lmax)
    found, k, reps = _first_success(sz, tot, taus, _skip_repeats(taus, valid, tot.lmax), any_floor)
    lo, hi = base[k], taus[k]
    r = lo + (hi - lo) * jnp.arange(1, _REFINE + 1) // (_REFINE + 1)
    r_valid = found & (lo >= 0) & (r > lo) & (r < hi)
    r_found, _, r_reps = _first_success(
        sz, tot, r, _skip_repeats(r, r_valid, tot.lmax), jnp.full((_REFINE,), any_floor[k])
    )
    pick = lambda a, b, c: jnp.where(r_found, a, jnp.where(found, b, c))  # noqa: E731
    return jax.tree.map(pick, r_reps, reps, no_replicas(sz))


def _write_plan(sz: Sizes, tot: Totals, reps: Replicas, bad):
    """The `Plan`'s arrays (int32): the n-th replica created on rank t in slot n of t; every
    output -1 where the core rejects the loads (``bad``)."""
    R, S, RS = sz.R, sz.S, sz.R * sz.S
    i = jnp.arange(RS)
    live = i < reps.count
    same = (
        (reps.target[:, None] == reps.target[None, :]) & live[None, :] & (i[None, :] < i[:, None])
    )
    slot = jnp.where(live, reps.target * S + jnp.sum(same, axis=1), RS)
    slot_expert = jnp.full((RS,), -1, jnp.int64).at[slot].set(reps.expert, mode="drop")
    slot_quota = jnp.zeros((RS,), jnp.int64).at[slot].set(reps.quota, mode="drop")
    quota = jnp.where(live, reps.quota, 0)
    master_quota = tot.load_e - jnp.zeros((sz.E,), jnp.int64).at[reps.expert].add(quota)
    received = jnp.zeros((R,), jnp.int64).at[reps.target].add(quota)
    rank_load = jnp.sum(master_quota.reshape(R, sz.Em), axis=1) + received
    out = (slot_expert.reshape(R, S), slot_quota.reshape(R, S), master_quota, rank_load)
    return tuple(jnp.where(bad, -1, v).astype(jnp.int32) for v in out)


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
    tolerance eps, capacity: 0 none), as `planning.planner.plan` passes the core."""
    sz = Sizes(R=R, E=E, S=S, g=g)
    with jax.enable_x64(True):
        sc = Scalars(exact, capped, jnp.asarray(values))
        tot, T, bad = _totals(sz, loads, sc.F, sc.K)
        if S == 0 or R == 1:
            reps = no_replicas(sz)
        else:
            reps = search(sz, sc, tot, T)
        return _write_plan(sz, tot, reps, bad)
