"""The collectives of a traced step, read from its jaxpr: which ones, over which mesh axes, inside
which conditionals, and what feeds the token and weight exchanges (DESIGN.md section 13; used
by tests/library/test_collectives.py).

`collectives(closed_jaxpr)` walks a `jax.make_jaxpr` result into every sub-jaxpr (jit, shard_map,
cond and switch branches, while and scan bodies, custom_jvp and custom_vjp calls, remat, the
branches of `jax.lax.platform_dependent`, whose index is the lowering platform; a custom_vjp's
fwd and bwd where the jaxpr holds them, as a gradient's does) and lists each
collective equation as a `Collective`: its kind (`KINDS`; the names differ between jax
versions: psum or psum_invariant, pvary or pcast), the mesh axes it names, the conditionals it
sits in and, for each, the axes its index varies over (shard_map's varying type of the index
operand). The casts (pvary / pcast, kind "cast") are listed apart from the collectives: they move
no data, but their transposes are psums. Its `Flow` answers which collectives feed an equation's
operands, within one shard_map body (a body's arguments are fresh values).

The checks the tests call: `psums_on_exchanges` (an all-reduce feeding an exchange's buffer, or
reducing one over the exchange's axis), `nonuniform_branch_collectives` (a collective in a
branch over an axis its index may differ on: a hang where groups take different branches), and
`table` (counts by kind, axes and place, compared to a table kept in the test).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

import jax.extend.core as jcore

#: Collective kinds by primitive name, over the names of jax 0.10-0.12.
KINDS = {
    **dict.fromkeys(("psum", "psum2", "psum_invariant", "all_reduce", "unreduced_psum"), "psum"),
    **dict.fromkeys(("pmax", "unreduced_pmax"), "pmax"),
    **dict.fromkeys(("pmin", "unreduced_pmin"), "pmin"),
    "pxor": "pxor",
    **dict.fromkeys(("reduce_scatter", "psum_scatter", "unreduced_reduce_scatter"), "psum_scatter"),
    "pmax_scatter": "pmax_scatter",
    "pmin_scatter": "pmin_scatter",
    **dict.fromkeys(("all_gather", "all_gather_invariant", "all_gather_reduced"), "all_gather"),
    "all_to_all": "all_to_all",
    "ragged_all_to_all": "ragged_all_to_all",
    **dict.fromkeys(("ppermute", "psend", "precv"), "ppermute"),
    **dict.fromkeys(("pbroadcast", "pbroadcast_dynamic"), "pbroadcast"),
    **dict.fromkeys(("pvary", "pcast"), "cast"),
}
#: The all-reduces: their result is the same on every rank of the axes they name.
ALL_REDUCES = frozenset({"psum", "pmax", "pmin", "pxor"})
#: The exchanges of rows between EP ranks: the ragged exchange, and every all_to_all (the padded
#: exchange's, and the sizes' exchange that the ragged one's transpose adds).
EXCHANGES = frozenset({"ragged_all_to_all", "all_to_all"})
#: The operands of an exchange that are row buffers (the rest: sizes and offsets): the operand and
#: ragged_all_to_all's output buffer.
BUFFER_OPERANDS = {"ragged_all_to_all": (0, 1), "all_to_all": (0,)}


@dataclasses.dataclass(frozen=True)
class Conditional:
    """A cond or switch around a collective: ``index_axes`` are the mesh axes its index varies
    over (empty: every rank takes the same branch); ``platform``: a `platform_dependent` switch,
    whose index is the lowering platform (uniform everywhere)."""

    index_axes: frozenset
    platform: bool


@dataclasses.dataclass(frozen=True, eq=False)
class Collective:
    """One collective (or cast) equation of a jaxpr, where the walk found it.

    Attributes:
      kind: its `KINDS` entry ("psum", "all_to_all", ..., "cast").
      primitive: the primitive's name in this jax version.
      axes: the mesh axes it names, sorted.
      conditionals: the conds and switches it sits in, outermost first.
      where: the primitives it sits in, outermost first (e.g. "jit/shard_map/cond[1]").
      source: the user frame that traced it ("file:line:column (function)").
      eqn: the equation.
      context: the sub-jaxpr instance it is in (`Flow`'s names of variables: `node`).
    """

    kind: str
    primitive: str
    axes: tuple[str, ...]
    conditionals: tuple[Conditional, ...]
    where: str
    source: str
    eqn: jcore.JaxprEqn = dataclasses.field(repr=False)
    context: tuple = dataclasses.field(repr=False)

    @property
    def cast(self) -> bool:
        """Whether it is a cast (pvary / pcast), no collective."""
        return self.kind == "cast"

    @property
    def place(self) -> str:
        """ "cond": inside a cond or switch chosen by a value (whatever platform switch is around
        it); "platform": inside `platform_dependent` branches only; "-": in no branch."""
        if any(not c.platform for c in self.conditionals):
            return "cond"
        return "platform" if self.conditionals else "-"

    def node(self, var) -> tuple:
        """`Flow`'s name of ``var`` (an input or output of this equation)."""
        return (self.context, var)

    def describe(self) -> str:
        """One line: kind, axes, place, source and path."""
        index = [sorted(c.index_axes) for c in self.conditionals if not c.platform]
        return (
            f"{self.primitive} over {self.axes} ({self.place}, index varying over {index}) at "
            f"{self.source} [{self.where}]"
        )


@dataclasses.dataclass
class Flow:
    """Data flow of a traced step, one shard_map body at a time.

    ``sources`` maps a variable (in its context: a sub-jaxpr inlined at two call sites is two
    contexts) to the variables it is computed from, through every sub-jaxpr boundary but
    shard_map's (a body's arguments have no source: they are the caller's values, typed by the
    in_specs); ``users`` is its inverse. ``made_by`` maps the outputs of each collective to it.
    A cond's outputs come from its branches' (their inputs from its operands), not from its
    index (a control dependence); an equation without sub-jaxprs has each output from every
    input; one whose sub-jaxpr's structure is unknown, every output from every input and
    sub-jaxpr output (coarse, never missing a path)."""

    sources: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    made_by: dict = dataclasses.field(default_factory=dict)
    users: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(list))

    def link(self, out, ins) -> None:
        """``out`` is computed from the variables ``ins`` (among others)."""
        self.sources[out].extend(ins)
        for node in ins:
            self.users[node].append(out)

    def collectives_upstream(self, nodes: Iterable) -> list[Collective]:
        """Every collective whose result reaches ``nodes`` by any path within their shard_map
        body (through other collectives too: a value all-reduced and then exchanged or gathered
        still carries the sum)."""
        return self._reach(nodes, self.sources, stop=False)

    def collectives_downstream(self, coll: Collective) -> list[Collective]:
        """The collectives that ``coll``'s results reach first: each path stops at the first one
        it meets (past it the values are that collective's, not ``coll``'s)."""
        outs = [coll.node(v) for v in coll.eqn.outvars]
        return self._reach([u for n in outs for u in self.users.get(n, ())], self.users, stop=True)

    def _reach(self, starts, edges, stop: bool) -> list[Collective]:
        """The collectives (casts passed through) met walking ``edges`` from ``starts``; with
        ``stop``, a path ends at the first one."""
        found, seen, stack = {}, set(), list(starts)
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            coll = self.made_by.get(node)
            met = coll is not None and not coll.cast
            if met:
                found[id(coll)] = coll
            if not (met and stop):
                stack.extend(edges.get(node, ()))
        return list(found.values())


@dataclasses.dataclass
class Trace:
    """What `collectives` read from one closed jaxpr: every collective and cast, and the flow."""

    found: list[Collective]
    flow: Flow

    @property
    def collectives(self) -> list[Collective]:
        """The collectives, casts left out."""
        return [c for c in self.found if not c.cast]

    @property
    def casts(self) -> list[Collective]:
        """The casts (pvary / pcast)."""
        return [c for c in self.found if c.cast]


def aval_varying_axes(aval) -> frozenset:
    """Mesh axes over which shard_map's type says a value of ``aval`` varies (`_vma.varying_axes`
    read from the aval: jax 0.10's ``manual_axis_type.varying``, later ``vma``)."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", None) or ())


def _axes(params: dict) -> tuple[str, ...]:
    """The mesh axes a collective's params name (``axes`` or ``axis_name``), sorted."""
    named = params.get("axes", params.get("axis_name", ()))
    named = (named,) if isinstance(named, str) else tuple(named or ())
    return tuple(sorted(a for a in named if isinstance(a, str)))


def _source(eqn) -> str:
    """Where ``eqn`` was traced: its innermost user frame ("?" where none is known)."""
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info) or "?"
    except Exception:  # private API: the location is a convenience
        return "?"


def _sub_jaxprs(eqn) -> list[tuple[str, jcore.Jaxpr]]:
    """(label, jaxpr) of each sub-jaxpr in ``eqn``'s params (a remat's inside jax 0.12's hijax
    primitive too), in order."""
    out = []

    def add(label, value):
        if isinstance(value, jcore.ClosedJaxpr):
            out.append((label, value.jaxpr))
        elif isinstance(value, jcore.Jaxpr):
            out.append((label, value))

    for key, value in eqn.params.items():
        if isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                add(f"{key}[{i}]", v)
        elif key == "_prim":  # jax 0.12's hijax primitives (remat, searchsorted, ...)
            for attr, v in vars(value).items():
                add(f"{type(value).__name__}.{attr}", v)
        else:
            add(key, value)
    return out


def collectives(closed: jcore.ClosedJaxpr) -> Trace:
    """Every collective and cast of ``closed`` (a `jax.make_jaxpr` result), in walk order, and
    the step's `Flow`."""
    flow = Flow()
    found: list[Collective] = []
    _walk(closed.jaxpr, (), (), (), flow, found)
    return Trace(found, flow)


def _walk(jaxpr, context, conds, where, flow: Flow, found: list) -> None:
    for i, eqn in enumerate(jaxpr.eqns):
        here = context + (i,)
        name = eqn.primitive.name
        ins = [(context, v) for v in eqn.invars if isinstance(v, jcore.Var)]
        outs = [(context, v) for v in eqn.outvars]
        kind = KINDS.get(name)
        if kind is not None:
            coll = Collective(
                kind,
                name,
                _axes(eqn.params),
                conds,
                "/".join(where) or "-",
                _source(eqn),
                eqn,
                context,
            )
            found.append(coll)
            for out in outs:
                flow.made_by[out] = coll
        subs = _sub_jaxprs(eqn)
        if not subs:
            for out in outs:
                flow.link(out, ins)
            continue
        if name == "cond":  # `platform_dependent` is a cond whose index is the platform
            platform = eqn.params.get("branches_platforms") is not None
            index = frozenset() if platform else aval_varying_axes(eqn.invars[0].aval)
            cond = Conditional(index, platform)
            for label, sub in subs:
                inner = here + (label,)
                _link_call(flow, context, eqn.invars[1:], eqn.outvars, inner, sub)
                _walk(sub, inner, conds + (cond,), where + (f"cond:{label}",), flow, found)
            continue
        labelled = [(here + (label,), label, sub) for label, sub in subs]
        if name == "while":
            _link_while(flow, context, eqn, {label: (inner, sub) for inner, label, sub in labelled})
        elif name == "scan":
            ((inner, _, sub),) = labelled
            _link_scan(flow, context, eqn, inner, sub)
        for inner, _, sub in labelled:
            if name in ("while", "scan", "shard_map"):
                pass  # linked above; a shard_map body's arguments are fresh values (`Flow`)
            elif len(sub.invars) == len(eqn.invars) and len(sub.outvars) == len(eqn.outvars):
                _link_call(flow, context, eqn.invars, eqn.outvars, inner, sub)
            else:  # unknown structure: every output from every input and sub-jaxpr value
                _link_opaque(flow, context, eqn, inner, sub)
            _walk(sub, inner, conds, where + (name,), flow, found)


def _var_nodes(context, vars_) -> list:
    return [(context, v) if isinstance(v, jcore.Var) else None for v in vars_]


def _link_call(flow, context, outer_in, outer_out, inner, sub) -> None:
    """A call: the sub-jaxpr's inputs are ``outer_in``, ``outer_out`` its outputs."""
    for node, v in zip(_var_nodes(context, outer_in), sub.invars, strict=True):
        if node is not None:
            flow.link((inner, v), [node])
    for v, out in zip(sub.outvars, outer_out, strict=True):
        if isinstance(v, jcore.Var):
            flow.link((context, out), [(inner, v)])


def _link_while(flow, context, eqn, subs: dict) -> None:
    """while: (cond consts, body consts, initial carry) in, the carry out. The body's and the
    cond's carry, and the result, come from the initial carry and the body's outputs."""
    nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    (cond_ctx, cond), (body_ctx, body) = subs["cond_jaxpr"], subs["body_jaxpr"]
    carry = _var_nodes(context, eqn.invars[nc + nb :])
    carry_out = [(body_ctx, v) if isinstance(v, jcore.Var) else None for v in body.outvars]
    pairs = ((cond_ctx, cond, eqn.invars[:nc]), (body_ctx, body, eqn.invars[nc : nc + nb]))
    for ctx, sub, consts in pairs:
        for node, v in zip(_var_nodes(context, consts), sub.invars[: len(consts)], strict=True):
            if node is not None:
                flow.link((ctx, v), [node])
        for k, v in enumerate(sub.invars[len(consts) :]):
            flow.link((ctx, v), [n for n in (carry[k], carry_out[k]) if n is not None])
    for k, out in enumerate(eqn.outvars):
        flow.link((context, out), [n for n in (carry[k], carry_out[k]) if n is not None])


def _link_scan(flow, context, eqn, inner, sub) -> None:
    """scan: consts, carry, xs in; carry, ys out. The body's carry comes from the initial carry
    and from its own outputs."""
    nconsts, ncarry = _scan_counts(eqn)
    for node, v in zip(_var_nodes(context, eqn.invars), sub.invars, strict=True):
        if node is not None:
            flow.link((inner, v), [node])
    for k, (v, out) in enumerate(zip(sub.outvars, eqn.outvars, strict=True)):
        if isinstance(v, jcore.Var):
            flow.link((context, out), [(inner, v)])
            if k < ncarry:
                flow.link((inner, sub.invars[nconsts + k]), [(inner, v)])
    for k in range(ncarry):
        node = _var_nodes(context, [eqn.invars[nconsts + k]])[0]
        if node is not None:
            flow.link((context, eqn.outvars[k]), [node])


def _scan_counts(eqn) -> tuple[int, int]:
    """(consts, carry) of a scan: params ``num_consts``, ``num_carry`` (jax 0.10), or the groups
    of its flat tree ``ft_in`` (consts, carry, xs: jax 0.12)."""
    if "num_consts" in eqn.params:
        return eqn.params["num_consts"], eqn.params["num_carry"]
    consts, carry, _ = eqn.params["ft_in"].update(eqn.invars).unpack()
    return len(list(consts)), len(list(carry))


def _link_opaque(flow, context, eqn, inner, sub) -> None:
    """An equation of unknown structure: each output from every input and every sub-jaxpr
    output, each sub-jaxpr input from every input (sound, coarse)."""
    ins = [n for n in _var_nodes(context, eqn.invars) if n is not None]
    sub_outs = [(inner, v) for v in sub.outvars if isinstance(v, jcore.Var)]
    for out in eqn.outvars:
        flow.link((context, out), ins + sub_outs)
    for v in sub.invars:
        flow.link((inner, v), ins)


# -- the checks ----------------------------------------------------------------------------------


def psums_on_exchanges(trace: Trace) -> list[str]:
    """Where an all-reduce touches an exchange's rows, one line each: an all-reduce whose result
    reaches an exchange's row buffer (its operand, ragged_all_to_all's output buffer) by any
    path within the shard_map body, or one over the exchange's axis that is the first
    collective to take what the exchange received. The first is what a cast after the exchange
    transposes to: the receive buffer's cotangent summed over the EP group before the backward
    exchange."""
    problems = []
    for ex in trace.collectives:
        if ex.kind not in EXCHANGES:
            continue
        buffers = [ex.eqn.invars[i] for i in BUFFER_OPERANDS[ex.kind]]
        nodes = [ex.node(v) for v in buffers if isinstance(v, jcore.Var)]
        for up in trace.flow.collectives_upstream(nodes):
            if up.kind in ALL_REDUCES:
                problems.append(f"{up.describe()} feeds {ex.describe()}")
        for down in trace.flow.collectives_downstream(ex):
            if down.kind in ALL_REDUCES and set(down.axes) & set(ex.axes):
                problems.append(f"{down.describe()} reduces the rows of {ex.describe()}")
    return problems


def nonuniform_branch_collectives(trace: Trace) -> list[str]:
    """Collectives inside a cond or switch branch over an axis its index varies over, one line
    each: ranks of that axis may take different branches, and a collective only some of them
    reach hangs. (A collective over the EP axis under an index that varies over "data" only is
    fine: within one EP group every rank takes the same branch.)"""
    return [
        c.describe()
        for c in trace.collectives
        if any(set(c.axes) & cond.index_axes for cond in c.conditionals)
    ]


def table(trace: Trace) -> dict[tuple[str, str, str], int]:
    """Collectives (no casts) counted by (kind, axes joined by ",", `Collective.place`)."""
    counts = collections.Counter((c.kind, ",".join(c.axes), c.place) for c in trace.collectives)
    return dict(sorted(counts.items()))


def assert_sound(trace: Trace, what: str) -> None:
    """Asserts `psums_on_exchanges` and `nonuniform_branch_collectives` find nothing."""
    problems = psums_on_exchanges(trace) + nonuniform_branch_collectives(trace)
    assert not problems, f"{what}: " + "; ".join(problems)
