"""Where each collective sits in a compiled XLA program, and which matmul kernels run while it is
in flight.

Reads the optimized HLO text (``jax.jit(f).lower(...).compile().as_text()``): its entry
computation lists the instructions in schedule order. An asynchronous collective is a ``*-start``
and a ``*-done`` instruction (or ``async-start`` / ``async-done`` around one); the kernels
scheduled between them, and independent of it (neither feeding it nor fed by it), are what can
run while it is in flight. A synchronous collective, or one inside a ``conditional`` / ``call`` /
``while``, overlaps nothing.
"""

from __future__ import annotations

import dataclasses
import re

#: Collective opcodes (each may also appear as ``<op>-start`` / ``<op>-done``).
COLLECTIVES = (
    "ragged-all-to-all",
    "all-to-all",
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "collective-permute",
)
#: Custom-call targets of matmul kernels: Mosaic GPU and Triton (the grouped-matmul kernels; no
#: other Pallas kernel runs in the layer), cuBLAS.
MATMUL_TARGETS = re.compile(r"mosaic_gpu|triton|cublas|gemm|matmul")

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_OP = re.compile(r"\s([a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(
    r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of a computation.

    Attributes:
      index: its position in the computation (the schedule order, for the entry).
      name: its name, without ``%``.
      op: its opcode (``fusion``, ``custom-call``, ``ragged-all-to-all-start``, ...).
      refs: the instruction names its operands and attributes mention (other names included:
        `entry_graph` keeps those of the same computation).
      called: the computations it calls.
      line: the instruction's text, without metadata and backend config.
    """

    index: int
    name: str
    op: str
    refs: tuple[str, ...]
    called: tuple[str, ...]
    line: str


def _instruction(index: int, line: str) -> Instruction | None:
    """The instruction of one HLO line, or None for a line that is none."""
    text = line.strip().removeprefix("ROOT ")
    if " = " not in text:
        return None
    name, rhs = text.split(" = ", 1)
    # Metadata and backend configs hold free text (op names such as "jit(f)/cond"), not operands.
    rhs = re.split(r", (?:metadata|backend_config|frontend_attributes)=", rhs)[0]
    op = _OP.search(rhs)
    if not op:
        return None
    called = _CALLED.findall(rhs)
    for group in _BRANCHES.findall(rhs):
        called += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
    refs = tuple(re.findall(r"%?([A-Za-z_][\w.\-]*)", rhs[op.end() :]))
    return Instruction(index, name.lstrip("%"), op.group(1), refs, tuple(called), rhs)


def computations(hlo_text: str) -> tuple[str, dict[str, list[Instruction]]]:
    """(the entry's name, {computation name: its instructions in order})."""
    comps: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line) if line and not line[0].isspace() else None
        if header:
            current = header.group(2)
            comps[current] = []
            entry = current if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            ins = _instruction(len(comps[current]), line)
            if ins is not None:
                comps[current].append(ins)
    return entry, comps


def collective_of(op: str) -> tuple[str, str] | None:
    """(collective, "sync" | "start" | "done") of an opcode, or None."""
    for c in COLLECTIVES:
        if op == c:
            return c, "sync"
        if op in (f"{c}-start", f"{c}-done"):
            return c, op[len(c) + 1 :]
    return None


def _holds(comp: str, comps: dict, seen: set) -> str | None:
    """The first collective inside computation ``comp`` or anything it calls, or None."""
    if comp in seen or comp not in comps:
        return None
    seen.add(comp)
    for ins in comps[comp]:
        found = collective_of(ins.op)
        if found:
            return found[0]
        for c in ins.called:
            inner = _holds(c, comps, seen)
            if inner:
                return inner
    return None


def is_matmul(ins: Instruction, comps: dict) -> bool:
    """A matmul kernel: a custom call to one of `MATMUL_TARGETS`, a dot, or a fusion around
    one."""
    if ins.op == "custom-call":
        target = _TARGET.search(ins.line)
        return bool(target and MATMUL_TARGETS.search(target.group(1)))
    if ins.op in ("dot", "ragged-dot"):
        return True
    return ins.op == "fusion" and any(
        is_matmul(inner, comps) for c in ins.called for inner in comps.get(c, ())
    )


def _closure(start: set[str], edges: dict[str, set[str]]) -> set[str]:
    out, todo = set(), list(start)
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in out:
                out.add(nxt)
                todo.append(nxt)
    return out


def overlap_report(hlo_text: str) -> dict:
    """Every collective of the entry computation in schedule order: its kind, whether it is
    asynchronous, its start and done positions, and how many of the matmul kernels independent
    of it (neither its ancestors nor its descendants) are scheduled while it is in flight.

    Returns:
      {"instructions": entry length, "matmuls": matmul kernels in the entry, "collectives":
      [{"name", "kind", "mode" ("async", "sync", or "inside <op>"), "start", "done",
      "independent_matmuls", "in_flight"}]}.
    """
    entry, comps = computations(hlo_text)
    order = comps.get(entry, [])
    names = {ins.name for ins in order}
    uses = {ins.name: {r for r in ins.refs if r in names and r != ins.name} for ins in order}
    users: dict[str, set[str]] = {}
    for name, used in uses.items():
        for u in used:
            users.setdefault(u, set()).add(name)
    matmuls = [ins for ins in order if is_matmul(ins, comps)]
    starts = {}
    found = []
    for ins in order:
        kind = collective_of(ins.op)
        if (kind and kind[1] == "start") or ins.op == "async-start":
            starts[ins.name] = ins
            continue
        if (kind and kind[1] == "done") or ins.op == "async-done":
            start = next((starts[r] for r in ins.refs if r in starts), ins)
            held = kind[0] if kind else _holds_any(start, comps)
            if held:
                found.append((held, "async", start, ins))
            continue
        if kind:
            found.append((kind[0], "sync", ins, ins))
            continue
        held = next((h for c in ins.called if (h := _holds(c, comps, set()))), None)
        if held and ins.op in ("conditional", "call", "while"):
            found.append((held, f"inside {ins.op}", ins, ins))
    out = []
    for kind, mode, start, done in found:
        before = _closure({start.name}, uses)
        after = _closure({done.name}, users)
        free = [m for m in matmuls if m.name not in before | after | {start.name, done.name}]
        out.append(
            {
                "name": done.name,
                "kind": kind,
                "mode": mode,
                "start": start.index,
                "done": done.index,
                "independent_matmuls": len(free),
                "in_flight": sum(start.index < m.index < done.index for m in free),
            }
        )
    return {"instructions": len(order), "matmuls": len(matmuls), "collectives": out}


def _holds_any(start: Instruction, comps: dict) -> str | None:
    """The collective an ``async-start`` wraps (in the computation it calls), or None."""
    return next((h for c in start.called if (h := _holds(c, comps, set()))), None)


def verdict(c: dict) -> str:
    """One line on one collective of `overlap_report`: overlapped or not, and why."""
    head = f"{c['kind']} {c['name']} ({c['mode']}, schedule {c['start']}..{c['done']})"
    n, k = c["independent_matmuls"], c["in_flight"]
    if c["mode"] != "async":
        return f"{head}: NOT overlapped ({c['mode']}: nothing runs while it is in flight)"
    if n == 0:
        return f"{head}: no matmul kernel is independent of it, nothing to overlap"
    state = "OVERLAPPED" if k == n else "partly overlapped" if k else "NOT overlapped (serialised)"
    return f"{head}: {k} of {n} independent matmul kernels scheduled while in flight: {state}"
