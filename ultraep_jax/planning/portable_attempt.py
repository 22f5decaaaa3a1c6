"""The portable planner's probe: ``try(tau)`` of ffi/PLANNER.md in JAX (lax loops, static shapes).

An attempt is one `lax.while_loop` that makes one replica per iteration, its state a few small
int64 arrays (`_SCALARS`), its choices vectorised over the source's masters and over the ranks
(each argmax one max-reduction of a packed key, as in the parallel form; each update a one-hot
select, not a scatter). `try_threshold` runs the fixed
schedule of attempts (plain, then repairs) in a loop that ends where one decides the probe.
Everything is int64 (the
caller traces under `jax.enable_x64`), as the spec's arithmetic is.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ultraep_jax._vma import vary, varying_axes

LOOSE, STRICT, MOST = 0, 1, 2
#: An attempt's state code: still placing replicas, succeeded, failed at a source, or a floor-1
#: attempt found a source whose masters have nothing left (no plan reaches the threshold);
#: SKIPPED: not run (an earlier attempt decided the probe).
RUNNING, SUCCESS, FAILED, INFEASIBLE, SKIPPED = range(5)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The static inputs of one plan: R, E, S, E_m = E / R and the domain size g (Python ints)."""

    R: int
    E: int
    S: int
    g: int

    @property
    def Em(self) -> int:
        """E_m: masters per rank."""
        return self.E // self.R

    @property
    def domains(self) -> int:
        """Fast domains: R / g."""
        return self.R // self.g


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Totals:
    """A plan's runtime inputs (int64): ``load_e`` [E], ``L`` [R] (master loads), ``rank_order``
    [R] (ranks by L descending, ties by index), ``lmax`` [], the floor ``F`` [] and the master's
    keep ``K`` [] (traced, so that one compiled planner serves every F and K)."""

    load_e: jax.Array
    L: jax.Array
    rank_order: jax.Array
    lmax: jax.Array
    F: jax.Array
    K: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Replicas:
    """An attempt's replicas by slot (the n-th created on rank t in slot t * S + n): ``expert``
    [R * S] (-1 where empty) and ``quota`` [R * S] (0 there), and what each rank's masters
    sent, ``sent`` [R]; all int64."""

    expert: jax.Array
    quota: jax.Array
    sent: jax.Array


def while_varying(cond, body, init, like):
    """`lax.while_loop` whose initial carry is typed as varying over whatever ``like`` (an
    array derived from the loads) varies over: inside a `shard_map` over loads that differ
    between EP groups, the body's outputs vary as the loads do, and a constant initial carry would
    not match them."""
    axes = varying_axes(like)
    return jax.lax.while_loop(cond, body, jax.tree.map(lambda a: vary(a, axes), init))


def no_replicas(sz: Sizes) -> Replicas:
    """The replicas of a plan without any."""
    z = jnp.zeros((sz.R * sz.S,), jnp.int64)
    return Replicas(z - 1, z, jnp.zeros((sz.R,), jnp.int64))


def first_max(v):
    """int64 []: the index of the first largest entry of ``v`` [N] (`jnp.argmax`, written with
    plain reductions: argmax's lowering breaks for int64 traced under `jax.enable_x64` inside an
    x32 `jit`)."""
    i = jnp.arange(v.shape[0], dtype=jnp.int64)
    return jnp.min(jnp.where(v == jnp.max(v), i, v.shape[0]))


# pick_target's packed key (PLANNER.md, "The parallel form"): one max-reduction picks the target.
_KEPT, _FITS, _NEAR = 1 << 62, 1 << 61, 1 << 60
_SLACK_SHIFT, _RANK_BITS = 29, (1 << 29) - 1
_INT31 = (1 << 31) - 1


def pick_target(rule, slack, free, need, avail, near):
    """(found [], t [], slack[t] []): pick_target of PLANNER.md under ``rule`` [] over the ranks'
    ``slack``, ``free`` [R], for a replica that should carry ``need`` of an expert that can give
    ``avail``; ``near`` [R] bool. The largest of one packed key per rank: a kept candidate (the
    strict rule's filter; every candidate under the others) before any other, then one that takes
    all of ``need`` (never under `MOST`), a near one first, with the least slack, else the most
    slack; ties to the smallest rank (slack <= tau < 2^31 and R <= 2^29). The key holds the
    target's slack, so no second reduction reads it."""
    cand = (slack > 0) & (free > 0)
    kept = (rule != STRICT) | ~((free == 1) & (slack > avail))
    fits = (rule != MOST) & (slack >= need)
    key = (
        jnp.where(kept, _KEPT, 0)
        | jnp.where(fits, _FITS, 0)
        | jnp.where(fits & near, _NEAR, 0)
        | (jnp.where(fits, _INT31 - slack, slack) << _SLACK_SHIFT)
        | (_RANK_BITS - np.arange(slack.shape[0], dtype=np.int64))
    )
    best = jnp.max(jnp.where(cand, key, -1))
    field = (best >> _SLACK_SHIFT) & _INT31
    slack_t = jnp.where((best & _FITS) != 0, _INT31 - field, field)
    return best >= 0, _RANK_BITS - (best & _RANK_BITS), slack_t


def _richest_master(sz: Sizes, K, load_src, sent):
    """(j, avail): the master of the source (its loads ``load_src``, what each sent ``sent``
    [E_m]; each keeps ``K``) with the most avail, ties to the smallest index; avail clamped at 0
    (below 1 every attempt fails whichever master it names)."""
    avail = jnp.maximum(load_src - K - sent, 0)
    key = jnp.max((avail << 32) | (sz.Em - 1 - np.arange(sz.Em, dtype=np.int64)))
    return sz.Em - 1 - (key & 0xFFFFFFFF), key >> 32


def _near(sz: Sizes, held, j, src):
    """bool [R]: the ranks near for a replica of ``src``'s master ``j``: in src's domain or in one
    that ``held`` [E_m, domains] marks as holding a replica of it."""
    if sz.domains == 1:
        return jnp.ones((sz.R,), bool)
    dom = np.arange(sz.R) // sz.g
    return (dom == src // sz.g) | held[j][dom]


# An attempt's state (the loop's carry): "ranks" [3, R] (slack, free slots, what the rank's
# masters sent), "masters" [2, E_m] (the source's masters' sends and loads), "reps" [2, R * S]
# (the replicas by slot: expert, -1 where empty, and quota), "held" [E_m, domains] (with several
# domains) and "sc", the scalars below: the attempt's code, the source it last visited (where it
# failed), the position in the order, the source, its excess left, what the ranks after it must
# still shed, and the attempt's constants (read from the carry, XLA hoists no thunk of theirs out
# of the loop). On XLA:CPU each array of the carry is written by a fusion of its own every
# iteration (a thunk, a few hundred ns); each fusion's work is its array's entries.
_SCALARS = ("code", "failed", "ri", "src", "x", "later", "n_order", "tau", "f", "rule", "K")
_CODE, _FAILED, _RI, _SRC, _X, _LATER, _N_ORDER, _TAU, _F, _RULE, _K = range(len(_SCALARS))


def _step(sz: Sizes, tot: Totals, order, st):
    """One iteration of an attempt over the ranks in ``order`` [R]: the current source's next
    replica, or the attempt's end. A failed attempt's replicas are never read, so nothing here
    guards them against a failure."""
    v, (slack, free, rank_sent), (sent, load_src) = st["sc"], st["ranks"], st["masters"]
    src, x, later, f, tau = v[_SRC], v[_X], v[_LATER], v[_F], v[_TAU]
    j, avail = _richest_master(sz, v[_K], load_src, sent)
    fl = jnp.minimum(f, x)
    near = _near(sz, st.get("held"), j, src)
    found, t, slack_t = pick_target(v[_RULE], slack, free, jnp.minimum(x, avail), avail, near)
    # fill the target as far as the expert allows and the later ranks can use
    q = jnp.minimum(jnp.minimum(slack_t, avail), x + later)
    no_master = avail < fl
    failed = no_master | ~found | (q < fl)
    code = jnp.where(no_master & (f == 1), INFEASIBLE, FAILED)
    x = x - q
    done_src = x <= 0
    ri = v[_RI] + done_src
    nsrc = order[jnp.minimum(ri, sz.R - 1)]
    nx = tot.L[nsrc] - tau
    r, row = np.arange(sz.R), np.arange(3)[:, None]
    # over-export: src becomes a target
    new_slack = jnp.where(done_src & (r == src), -x, jnp.where(r == t, slack - q, slack))
    ranks = jnp.where(
        row == 0, new_slack, jnp.where(row == 1, free - (r == t), rank_sent + (r == src) * q)
    )
    m = np.arange(sz.Em)
    nload = jax.lax.dynamic_slice(tot.load_e, (nsrc * sz.Em,), (sz.Em,))
    # the replica's slot: the n-th created on t takes slot n of t (free[t] = S - n before it)
    slot = t * sz.S + sz.S - free[t]
    rep = jnp.stack([src * sz.Em + j, q])[:, None]
    out = {
        "ranks": ranks,
        "reps": jnp.where(np.arange(sz.R * sz.S) == slot, rep, st["reps"]),
        "sc": jnp.stack(
            [
                jnp.where(
                    failed, code, jnp.where(done_src & (ri >= v[_N_ORDER]), SUCCESS, RUNNING)
                ),
                src,
                ri,
                jnp.where(done_src, nsrc, src),
                jnp.where(done_src, nx, x),
                jnp.where(done_src, later - nx, later),
                *(v[k] for k in (_N_ORDER, _TAU, _F, _RULE, _K)),
            ]
        ),
        "masters": jnp.stack(
            [jnp.where(done_src, 0, sent + (m == j) * q), jnp.where(done_src, nload, load_src)]
        ),
    }
    if sz.domains > 1:
        d = np.arange(sz.domains)
        out["held"] = (st["held"] | ((m == j)[:, None] & (d == t // sz.g)[None, :])) & ~done_src
    return out


def attempt(sz: Sizes, tot: Totals, tau, f, rule, order, run):
    """attempt(tau, f, rule, order) of PLANNER.md over the ranks of ``order`` [R] above ``tau``
    (its first ones), run only where ``run``: the final state (`attempt_result` reads it)."""
    i64 = jnp.int64
    src = order[0]
    x = tot.L[src] - tau
    n_order = jnp.sum(tot.L > tau)
    later = jnp.sum(jnp.maximum(tot.L - tau, 0)) - x
    code = jnp.where(run, jnp.where(n_order > 0, RUNNING, SUCCESS), SKIPPED)
    scalars = (code, src, 0, src, x, later, n_order, tau, f, rule, tot.K)
    zeros = jnp.zeros((sz.R,), i64)
    st = {
        "ranks": jnp.stack([jnp.maximum(tau - tot.L, 0), zeros + sz.S, zeros]),
        "reps": jnp.stack([jnp.full((sz.R * sz.S,), -1, i64), jnp.zeros((sz.R * sz.S,), i64)]),
        "sc": jnp.stack([jnp.asarray(a, i64) for a in scalars]),
        "masters": jnp.stack(
            [jnp.zeros((sz.Em,), i64), jax.lax.dynamic_slice(tot.load_e, (src * sz.Em,), (sz.Em,))]
        ),
    }
    if sz.domains > 1:
        st["held"] = jnp.zeros((sz.Em, sz.domains), bool)
    return while_varying(
        lambda st: st["sc"][_CODE] == RUNNING,
        lambda st: _step(sz, tot, order, st),
        st,
        tot.L,
    )


def attempt_result(sz: Sizes, st):
    """(code [], failed source [], `Replicas`) of an attempt's final state ``st``."""
    v, reps = st["sc"], st["reps"]
    return v[_CODE], v[_FAILED], Replicas(reps[0], reps[1], st["ranks"][2])


def _move_to_front(order, d):
    """int [R]: ``order`` with rank ``d`` (one of its entries) moved to the front, the others
    keeping their relative order."""
    p = first_max(order == d)
    i = jnp.arange(order.shape[0])
    shifted = jnp.concatenate([d[None], order[:-1]])
    return jnp.where(i <= p, shifted, order)


# The schedule of try(tau) (PLANNER.md): segments of up to 4 attempts each, a plain attempt for
# each floor and rule (loose, strict), then a repair for each floor and rule (loose, strict, most).
# A segment's attempt b >= 1 moves the source that failed to the front of the order.
_SEGMENTS = [(floor1, rule, True) for floor1 in (False, True) for rule in (LOOSE, STRICT)] + [
    (floor1, rule, False) for floor1 in (False, True) for rule in (LOOSE, STRICT, MOST)
]
_SEG_FLOOR1, _SEG_RULE, _SEG_PLAIN = (np.array(col) for col in zip(*_SEGMENTS, strict=True))
_POSITIONS = 4 * len(_SEGMENTS)


def _next(sz: Sizes, tot: Totals, any_floor, s):
    """The attempt at position ``s["pos"]`` of the schedule, or none where that position has
    nothing to run: (run [], f [], rule [], order [R], the source that failed last, the position
    after it)."""
    pos, order, failed = s["pos"], s["order"], s["failed"]
    seg, b = jnp.minimum(pos // 4, len(_SEGMENTS) - 1), pos % 4
    floor1, rule, plain = (jnp.asarray(col)[seg] for col in (_SEG_FLOOR1, _SEG_RULE, _SEG_PLAIN))
    allowed = ~floor1 | (any_floor & (tot.F > 1))
    inherit = ~plain & (b == 0) & (rule != MOST)  # a repair's first attempt failed in pass 1
    failed = jnp.where(inherit, s["failed_plain"][floor1.astype(jnp.int64), rule % 2], failed)
    stuck = (b > 0) & (failed == order[0])  # the source that failed already gives first
    order = jnp.where(b > 0, _move_to_front(order, failed), tot.rank_order)
    run = allowed & ~inherit & ~stuck
    seg_end = plain | ~allowed | stuck | (b == 3)
    nxt = jnp.where(seg_end, (seg + 1) * 4, pos + 1)
    return run, jnp.where(floor1, 1, tot.F), rule, order, failed, nxt


def try_threshold(sz: Sizes, tot: Totals, tau, any_floor, run):
    """try(tau) of PLANNER.md, run only where ``run``: (succeeded [], `Replicas`). ``any_floor``
    [] bool: the probe may give up the floor F (then floors F and 1)."""

    def body(s):
        go, f, rule, order, last_failed, pos = _next(sz, tot, any_floor, s)
        code, failed, reps = attempt_result(sz, attempt(sz, tot, tau, f, rule, order, go))
        won = go & (code == SUCCESS)
        seg = s["pos"] // 4
        record = go & jnp.asarray(_SEG_PLAIN)[seg]
        fp = s["failed_plain"].at[
            jnp.asarray(_SEG_FLOOR1)[seg].astype(jnp.int64), jnp.asarray(_SEG_RULE)[seg] % 2
        ]
        return {
            "pos": pos,
            "order": order,
            "failed": jnp.where(go, failed, last_failed),
            "failed_plain": jnp.where(record, fp.set(failed), s["failed_plain"]),
            "decided": won | (go & (code == INFEASIBLE)),
            "ok": won,
            "reps": jax.tree.map(lambda a, b: jnp.where(won, a, b), reps, s["reps"]),
        }

    s = {
        "pos": jnp.zeros((), jnp.int64),
        "order": tot.rank_order,
        "failed": tot.rank_order[0],
        "failed_plain": jnp.zeros((2, 2), jnp.int64),
        "decided": ~run,
        "ok": jnp.zeros((), bool),
        "reps": no_replicas(sz),
    }
    s = while_varying(lambda s: ~s["decided"] & (s["pos"] < _POSITIONS), body, s, tot.L)
    return s["ok"], s["reps"]
