"""A training step's time split into its terms, from a profile of some steps on one process.

XLA:CPU records one trace event per executed HLO instruction (its ``hlo_op`` and ``hlo_module``);
the compiled module's text gives each instruction's ``op_name``, the path of `jax.named_scope`
names it was traced under. The MoE layer names its stages (``plan``, ``dispatch``, ``exchange``,
``relay_schedule``, ``experts``, ``replica_transfer``, ``combine``, ``stats``; in
`ultraep_jax.core` and `ultraep_jax.replicas.streaming`), the ideal mode its assignment
(``force_balanced``), and the backward pass keeps the forward's names, so each instruction's
time falls in one term:

  planner           ``plan``: the load all-gather and the planner
  bookkeeping       ``dispatch``, ``combine``, ``relay_schedule``, ``stats`` and the rest of the
                    routed layer: ordering, offsets, the reroute, the replica schedule
  replica_transfer  the replica weights' transfer and, transposed, their gradients' return
  exchange          the token all-to-alls (a collective's time includes waiting for the other
                    ranks to reach it: on the busiest rank, little)
  experts           the expert kernels
  ideal_assignment  the force-balanced ideal's even assignment (the ideal mode only)
  rest              everything else: attention, router, shared expert, head, loss, optimizer

A fused instruction takes its root's scope: XLA fuses within a stage far more than across
stages, so the split is right to within what it fuses across them. An instruction's time is its
own (exclusive): a loop's or a conditional's event less the events
of the instructions it ran. A collective's time includes waiting for the other ranks to reach
it, so the rank that waits least in collectives is the busiest. ``outside_ops`` is the step's
wall time less all of them (dispatch, host work; what ran in parallel, counted twice, makes it
negative).
"""

from __future__ import annotations

import gzip
import json
import pathlib
import re
from collections.abc import Iterable

#: The terms, in the order a picture stacks them.
TERMS = (
    "rest",
    "experts",
    "exchange",
    "bookkeeping",
    "planner",
    "replica_transfer",
    "ideal_assignment",
)
#: Scope name -> term, the most specific first: an instruction takes the first whose name is a
#: component of its op_name (``exchange`` sits inside ``dispatch``, ``replica_transfer`` inside
#: ``experts``).
SCOPE_TERMS = (
    ("replica_transfer", "replica_transfer"),
    ("exchange", "exchange"),
    ("plan", "planner"),
    ("relay_schedule", "bookkeeping"),
    ("experts", "experts"),
    ("dispatch", "bookkeeping"),
    ("combine", "bookkeeping"),
    ("stats", "bookkeeping"),
    ("routed_experts", "bookkeeping"),
    ("force_balanced", "ideal_assignment"),
)

#: Collective instructions, by the name XLA gives them (their opcode, numbered).
_COLLECTIVE = re.compile(
    r"^(all-reduce|all-gather|all_gather|reduce-scatter|reduce_scatter|all-to-all|all_to_all|"
    r"ragged-all-to-all|collective-permute|collective_permute)"
)
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name=\"([^\"]*)\""
)
_MODULE = re.compile(r"^HloModule\s+([\w.\-]+)")


def module_name(hlo_text: str) -> str:
    """The name of the compiled module in ``hlo_text`` (its first ``HloModule`` line)."""
    for line in hlo_text.splitlines():
        match = _MODULE.match(line)
        if match:
            return match.group(1)
    raise ValueError("step_terms: no 'HloModule' line in the compiled text")


def instruction_terms(hlo_text: str) -> dict[str, str]:
    """Instruction name -> term (`SCOPE_TERMS` on its op_name; ``rest`` when none matches) of
    every instruction of ``hlo_text`` (``compiled.as_text()``) that carries an op_name."""
    out = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            out[match.group(1)] = term_of(match.group(2))
    return out


def term_of(op_name: str) -> str:
    """The term of an instruction traced under ``op_name`` (a ``/``-joined scope path)."""
    parts = set(op_name.split("/"))
    for scope, term in SCOPE_TERMS:
        if scope in parts:
            return term
    return "rest"


def exclusive_times(events: Iterable[dict]) -> list[tuple[dict, float]]:
    """Each complete event (``ph`` "X") with its exclusive duration (microseconds): its ``dur``
    less that of the events nested in it on the same thread (a loop's event holds its body's)."""
    by_thread: dict = {}
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, end, exclusive]
        for e in evs:
            while stack and e["ts"] >= stack[-1][1]:
                out.append(tuple(stack.pop()[::2]))
            if stack:
                stack[-1][2] -= min(e["dur"], stack[-1][1] - e["ts"])
            stack.append([e, e["ts"] + e["dur"], float(e["dur"])])
        out.extend(tuple(s[::2]) for s in stack)
    return out


def split_terms(events: Iterable[dict], hlo_text: str, steps: int) -> dict[str, dict]:
    """Seconds per step of each of `TERMS` from a trace's ``events`` over ``steps`` executions of
    the module compiled as ``hlo_text`` (events of other modules left out): ``{"terms_s":
    {term: s}, "collectives_s": {term: s}}``, the second the part of each term spent in
    collectives (their transfer and their wait)."""
    if steps < 1:
        raise ValueError(f"step_terms: steps={steps} must be >= 1")
    module, terms = module_name(hlo_text), instruction_terms(hlo_text)
    totals, collectives = dict.fromkeys(TERMS, 0.0), dict.fromkeys(TERMS, 0.0)
    for event, exclusive in exclusive_times(events):
        args = event.get("args", {})
        op = args.get("hlo_op")
        if args.get("hlo_module") == module and op == event.get("name"):
            term = terms.get(op, "rest")
            totals[term] += exclusive
            if _COLLECTIVE.match(op):
                collectives[term] += exclusive
    return {
        "terms_s": {term: us * 1e-6 / steps for term, us in totals.items()},
        "collectives_s": {term: us * 1e-6 / steps for term, us in collectives.items()},
    }


def read_trace(profile_dir: pathlib.Path) -> list[dict]:
    """The trace events of the one ``*.trace.json.gz`` that `jax.profiler.trace` (with
    ``create_perfetto_trace=True``) wrote under ``profile_dir``."""
    paths = sorted(pathlib.Path(profile_dir).rglob("*.trace.json.gz"))
    if len(paths) != 1:
        raise ValueError(f"step_terms: {len(paths)} trace files under {profile_dir}, expected 1")
    with gzip.open(paths[0], "rt") as f:
        return json.load(f)["traceEvents"]
