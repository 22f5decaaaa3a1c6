"""The portable planner's probe: ``try(tau)`` of ffi/PLANNER.md in JAX (lax loops, static shapes).

An attempt is one `lax.while_loop` that makes one replica per iteration, its state one int64
vector (`_layout`) that one fusion rewrites: its choices vectorised over the source's masters and
over the ranks (master and target one lexicographic max-reduction of packed keys, as in the
parallel form; each update a one-hot select, not a scatter). `try_threshold` runs the fixed
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


def target_keys(rule, slack, free, need, avail, near):
    """int64 [..., R]: pick_target's key of PLANNER.md under ``rule`` [] for each rank (``slack``,
    ``free`` [R]), -1 for a rank that is no candidate, for a replica that should carry ``need``
    of an expert that can give ``avail`` (both [..., 1]: one row per master); ``near`` [..., R]
    bool. The row's largest key is its target: a kept candidate (the strict rule's filter; every
    candidate under the others) before any other, then one that takes all of ``need`` (never
    under `MOST`), a near one first, with the least slack, else the most slack; ties to the
    smallest rank (slack <= tau < 2^31 and R <= 2^29). The key holds the slack (`decode_target`)."""
    cand = (slack > 0) & (free > 0)
    kept = (rule != STRICT) | ~((free == 1) & (slack > avail))
    fits = (rule != MOST) & (slack >= need)
    key = (
        jnp.where(kept, _KEPT, 0)
        | jnp.where(fits, _FITS, 0)
        | jnp.where(fits & near, _NEAR, 0)
        | (jnp.where(fits, _INT31 - slack, slack) << _SLACK_SHIFT)
        | (_RANK_BITS - np.arange(slack.shape[-1], dtype=np.int64))
    )
    return jnp.where(cand, key, -1)


def decode_target(best):
    """(found [], t [], slack[t] []) of the largest key ``best`` [] of `target_keys`."""
    field = (best >> _SLACK_SHIFT) & _INT31
    slack_t = jnp.where((best & _FITS) != 0, _INT31 - field, field)
    return best >= 0, _RANK_BITS - (best & _RANK_BITS), slack_t


def _lex_max(a, b):
    """The larger of two (master key, target key) pairs, the master key first."""
    (am, at), (bm, bt) = a, b
    take_a = (am > bm) | ((am == bm) & (at >= bt))
    return jnp.where(take_a, am, bm), jnp.where(take_a, at, bt)


def _choose(sz: Sizes, rule, K, st, src, x):
    """(j, avail, found, t, slack[t]): the source's master with the most avail (ties to the
    smallest index; avail clamped at 0: below 1 every attempt fails whichever master it names)
    and pick_target's rank for a replica of it, as one reduction over [E_m, R] (the target keys
    of every master, ordered after the masters' keys), not two in a row."""
    avail = jnp.maximum(st["load_src"] - K - st["sent"], 0)
    mkey = (avail << 32) | (sz.Em - 1 - np.arange(sz.Em, dtype=np.int64))
    near = _near(sz, st.get("held"), src)
    need = jnp.minimum(x, avail)[:, None]
    tkey = target_keys(rule, st["slack"], st["free"], need, avail[:, None], near)
    mkey = jnp.broadcast_to(mkey[:, None], tkey.shape)
    best_m, best_t = jax.lax.reduce((mkey, tkey), (np.int64(-1), np.int64(-1)), _lex_max, (0, 1))
    found, t, slack_t = decode_target(best_t)
    return sz.Em - 1 - (best_m & 0xFFFFFFFF), best_m >> 32, found, t, slack_t


def _near(sz: Sizes, held, src):
    """bool [E_m, R]: the ranks near for a replica of each of ``src``'s masters: in src's domain
    or in one that ``held`` [E_m, domains] marks as holding a replica of it."""
    if sz.domains == 1:
        return jnp.ones((sz.Em, sz.R), bool)
    dom = np.arange(sz.R) // sz.g
    return (dom == src // sz.g)[None, :] | held[:, dom]


def _layout(sz: Sizes) -> dict[str, tuple[int, ...]]:
    """The attempt's state, one int64 vector: name -> shape, in order. The replicas by slot
    (`Replicas`); scalars: the attempt's code, the source it last visited (where it failed), the
    position in the order, the source, its excess left, what the ranks after it must still
    shed, and the attempt's constants (the sources' count, tau, f, rule, K: read from the carry,
    nothing of theirs is hoisted out of the loop as a thunk of its own). On XLA:CPU each array
    of a loop's carry is written by a fusion of its own every iteration, a thunk of a few
    hundred ns each; `_step` writes this one vector with one."""
    R, Em = sz.R, sz.Em
    shapes = dict(slack=(R,), free=(R,), sent=(Em,), load_src=(Em,))
    shapes.update(rep_e=(R * sz.S,), rep_q=(R * sz.S,), rank_sent=(R,))
    if sz.domains > 1:
        shapes.update(held=(Em, sz.domains))
    scalars = ("code", "failed", "ri", "src", "x", "later", "n_order", "tau", "f", "rule", "K")
    shapes.update({k: () for k in scalars})
    return shapes


def _regions(sz: Sizes):
    """(names, region [n], local [n]): for each entry of the state vector (`_layout`), the index
    of its part in ``names`` and its flat index within that part (NumPy constants)."""
    names, sizes = zip(*((k, int(np.prod(v))) for k, v in _layout(sz).items()), strict=True)
    region = np.repeat(np.arange(len(names)), sizes)
    local = np.arange(region.size) - np.repeat(np.cumsum((0, *sizes[:-1])), sizes)
    return names, region, local


def _unpack(sz: Sizes, v) -> dict:
    """The named parts of the state vector ``v`` (`_layout`)."""
    out, at = {}, 0
    for name, shape in _layout(sz).items():
        n = int(np.prod(shape))
        out[name] = v[at : at + n].reshape(shape)
        at += n
    if sz.domains > 1:
        out["held"] = out["held"] != 0
    return out


def _step(sz: Sizes, tot: Totals, order, v):
    """One iteration of an attempt on the state vector ``v`` (`_layout`) over the ranks in
    ``order`` [R]: the current source's next replica, or the attempt's end. The new state is one
    elementwise expression of the old (each entry by its part, `_regions`), which XLA makes one
    fusion. A failed attempt's replicas are never read, so nothing here guards them."""
    s = _unpack(sz, v)
    src, x, later, ri, f, tau = s["src"], s["x"], s["later"], s["ri"], s["f"], s["tau"]
    j, avail, found, t, slack_t = _choose(sz, s["rule"], s["K"], s, src, x)
    fl = jnp.minimum(f, x)
    # fill the target as far as the expert allows and the later ranks can use
    q = jnp.minimum(jnp.minimum(slack_t, avail), x + later)
    no_master = avail < fl
    failed = no_master | ~found | (q < fl)
    code = jnp.where(no_master & (f == 1), INFEASIBLE, FAILED)
    x = x - q
    done_src = x <= 0
    ri = ri + done_src
    nsrc = order[jnp.minimum(ri, sz.R - 1)]
    nx = tot.L[nsrc] - tau
    finished = done_src & (ri >= s["n_order"])
    _, _, i = _regions(sz)
    Em = sz.Em
    # the replica's slot: the n-th created on t takes slot n of t (free[t] = S - n before it)
    slot = t * sz.S + sz.S - s["free"][t]
    nload = tot.load_e[jnp.clip(nsrc * Em + i, 0, sz.E - 1)]
    new = {
        # over-export: src becomes a target
        "slack": jnp.where(done_src & (i == src), -x, jnp.where(i == t, v - q, v)),
        "free": v - (i == t),
        "sent": jnp.where(done_src, 0, v + jnp.where(i == j, q, 0)),
        "load_src": jnp.where(done_src, nload, v),
        "rep_e": jnp.where(i == slot, src * Em + j, v),
        "rep_q": jnp.where(i == slot, q, v),
        "rank_sent": jnp.where(i == src, v + q, v),
        "held": ((v != 0) | ((i // sz.domains == j) & (i % sz.domains == t // sz.g))) & ~done_src,
        "code": jnp.where(failed, code, jnp.where(finished, SUCCESS, RUNNING)),
        "failed": src,
        "ri": ri,
        "src": jnp.where(done_src, nsrc, src),
        "x": jnp.where(done_src, nx, x),
        "later": jnp.where(done_src, later - nx, later),
    }
    for name in ("n_order", "tau", "f", "rule", "K"):
        new[name] = v
    return _assemble(sz, new)


def _assemble(sz: Sizes, parts: dict):
    """The state vector (`_layout`) whose entries are those of ``parts`` (name -> [n] or [],
    each read at the entries of its part): one elementwise expression, one fusion."""
    names, region, _ = _regions(sz)
    out = jnp.zeros(region.shape, jnp.int64)
    for k, name in enumerate(names):
        out = jnp.where(region == k, parts[name], out)
    return out


def attempt(sz: Sizes, tot: Totals, tau, f, rule, order, run):
    """attempt(tau, f, rule, order) of PLANNER.md over the ranks of ``order`` [R] above ``tau``
    (its first ones), run only where ``run``: the final state vector (`_layout`;
    `attempt_result` reads it)."""
    R, Em = sz.R, sz.Em
    x = tot.L[order[0]] - tau
    n_order = jnp.sum(tot.L > tau)
    later = jnp.sum(jnp.maximum(tot.L - tau, 0))
    _, _, i = _regions(sz)
    parts = {
        "slack": jnp.maximum(tau - tot.L[np.minimum(i, R - 1)], 0),
        "free": sz.S,
        "sent": 0,
        "load_src": tot.load_e[jnp.clip(order[0] * Em + i, 0, sz.E - 1)],
        "rep_e": -1,
        "rep_q": 0,
        "rank_sent": 0,
        "held": 0,
        "code": jnp.where(run, jnp.where(n_order > 0, RUNNING, SUCCESS), SKIPPED),
        "failed": order[0],
        "ri": 0,
        "src": order[0],
        "x": x,
        "later": later - x,
        "n_order": n_order,
        "tau": tau,
        "f": f,
        "rule": rule,
        "K": tot.K,
    }
    return while_varying(
        lambda v: v[_code_at(sz)] == RUNNING,
        lambda v: _step(sz, tot, order, v),
        _assemble(sz, parts),
        tot.L,
    )


def _code_at(sz: Sizes) -> int:
    """The state vector's index of the attempt's code (`_layout`)."""
    names, region, _ = _regions(sz)
    return int(np.argmax(region == names.index("code")))


def attempt_result(sz: Sizes, v):
    """(code [], failed source [], `Replicas`) of an attempt's final state ``v`` (`attempt`)."""
    s = _unpack(sz, v)
    return s["code"], s["failed"], Replicas(s["rep_e"], s["rep_q"], s["rank_sent"])


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
