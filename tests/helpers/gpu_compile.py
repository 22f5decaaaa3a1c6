"""XLA:GPU's compiler on a host without a GPU (DESIGN.md section 13): compile-only H100s of the
CUDA plugin (the library's `compile_only_mesh` and `target_config`, `ultraep_jax.deviceless`,
re-exported here), and what tests read in an optimized HLO module (``compiled.as_text()``,
parsed by `HloModule`): the all-reduces whose result reaches a ragged all-to-all
(`all_reduces_feeding_ragged`), and the collectives inside a conditional's branches whose
replica groups span devices of different data rows (`branch_collectives_across_rows`)."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np

from ultraep_jax.tools import DEVICE_KINDS, compile_only_mesh, cuda_plugin, target_config

# The compile-only devices are the library's (`tools`), re-exported for the tests.
__all__ = ["compile_only_mesh", "cuda_plugin", "target_config"]

#: The GPU the tests target (XLA's h100_sxm.txtpb): `compile_only_mesh`'s default, one node of
#: 8 whose device ids are row-major over the mesh (device ``d`` in data row ``d // ep``), which
#: `branch_collectives_across_rows` relies on.
H100 = DEVICE_KINDS["h100"]


#: XLA:GPU's options for a compile without a GPU that change nothing in the optimized module, its
#: buffers or its memory analysis (checked for the four steps of tests/library/test_gpu_compile.py:
#: the same module text, backend configs aside, and the same sizes), and halve its time: no
#: autotuning (without a device it compiles every candidate kernel config only to take the default
#: one) and ptxas without optimizations (only the machine code, which nothing here reads, differs).
COMPILE_ONLY_OPTIONS = {
    "xla_gpu_autotune_level": 0,
    "xla_gpu_disable_gpuasm_optimizations": True,
}


def compile_without_cache(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """``lowered.compile()`` with `COMPILE_ONLY_OPTIONS`, kept out of JAX's persistent
    compilation cache (tests/conftest.py turns it on): an executable for compile-only devices is
    written there but cannot be read back ("PjRtCompiler must be constructed with a Client"), so
    every later run would warn and compile again."""
    from jax._src import config  # the cache's threshold as a context manager

    with config.persistent_cache_min_compile_time_secs(float("inf")):
        return lowered.compile(compiler_options=COMPILE_ONLY_OPTIONS)


# -- the optimized HLO module ----------------------------------------------------------------


#: Collectives, by opcode (the asynchronous forms' -start: its -done takes the start's result).
ALL_REDUCE_OPS = frozenset({"all-reduce", "all-reduce-start", "all-reduce-done"})
COLLECTIVE_OPS = ALL_REDUCE_OPS | frozenset(
    {
        "all-gather",
        "all-gather-start",
        "all-gather-done",
        "all-to-all",
        "ragged-all-to-all",
        "ragged-all-to-all-start",
        "ragged-all-to-all-done",
        "reduce-scatter",
        "collective-permute",
        "collective-permute-start",
        "collective-permute-done",
        "collective-broadcast",
    }
)
RAGGED_OPS = frozenset({"ragged-all-to-all", "ragged-all-to-all-start"})
#: Attributes that name the computations an instruction calls.
_CALLS = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|branch_computations|"
    r"called_computations)=(\{[^}]*\}|%[\w.\-]+)"
)
_NAME = re.compile(r"%([\w.\-]+)")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%([\w.\-]+) = (.*)$")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s+\(.*\{$")


def _balanced_end(text: str, start: int) -> int:
    """The index just past the parenthesis that closes the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError(f"unbalanced parentheses in {text[start : start + 200]!r}")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its name, opcode, operand names, the text after its operands (its
    attributes) and the computations it calls, by attribute (``branch_computations`` of a
    conditional as ``true_computation`` and ``false_computation`` are, in branch order)."""

    name: str
    opcode: str
    operands: tuple[str, ...]
    operand_text: str
    attributes: str
    calls: tuple[tuple[str, str], ...]

    @classmethod
    def parse(cls, name: str, text: str) -> Instruction:
        """``text``: what follows ``%name = `` (shape, opcode, operands, attributes)."""
        shape_end = _balanced_end(text, 0) if text.startswith("(") else text.index(" ")
        rest = text[shape_end:].lstrip()
        opcode = rest[: rest.index("(")]
        operands_end = _balanced_end(rest, len(opcode))
        operand_text = rest[len(opcode) + 1 : operands_end - 1]
        operands = tuple(_NAME.findall(operand_text))
        attributes = rest[operands_end:]
        # Metadata strings come last and may hold anything: calls are read before them.
        head = attributes.split("metadata={", 1)[0]
        calls = tuple(
            (kind, callee)
            for kind, value in _CALLS.findall(head)
            for callee in _NAME.findall(value)
        )
        return cls(name, opcode, operands, operand_text, attributes, calls)

    def called(self, *kinds: str) -> list[str]:
        """The computations called through the attributes ``kinds`` (all when none given)."""
        return [callee for kind, callee in self.calls if not kinds or kind in kinds]

    def attribute(self, name: str) -> str | None:
        """The raw value of attribute ``name`` (up to the next top-level ``, ``), or None."""
        match = re.search(rf"\b{name}=", self.attributes)
        if match is None:
            return None
        text, depth = self.attributes[match.end() :], 0
        for i, char in enumerate(text):
            depth += {"{": 1, "[": 1, "(": 1, "}": -1, "]": -1, ")": -1}.get(char, 0)
            if depth == 0 and text.startswith(", ", i):
                return text[:i]
        return text


@dataclasses.dataclass
class Computation:
    """One computation: its instructions by name, the root's name, whether it is the entry."""

    name: str
    instructions: dict[str, Instruction]
    root: str
    entry: bool


class HloModule:
    """An optimized HLO module's computations (``compiled.as_text()``), and who calls each."""

    def __init__(self, text: str):
        self.computations: dict[str, Computation] = {}
        current = None
        for line in text.splitlines():
            if current is None:
                if (header := _COMPUTATION.match(line)) is not None:
                    current = Computation(header.group(2), {}, "", bool(header.group(1)))
                continue
            if line.startswith("}"):
                self.computations[current.name] = current
                current = None
                continue
            match = _INSTRUCTION.match(line)
            if match is None:
                raise ValueError(f"HloModule: cannot parse the line {line[:200]!r}")
            instruction = Instruction.parse(match.group(1), match.group(2))
            current.instructions[instruction.name] = instruction
            if line.lstrip().startswith("ROOT "):
                current.root = instruction.name
        #: computation -> [(calling computation, calling instruction)]
        self.callers: dict[str, list[tuple[str, str]]] = {}
        for computation in self.computations.values():
            for instruction in computation.instructions.values():
                for callee in instruction.called():
                    self.callers.setdefault(callee, []).append((computation.name, instruction.name))

    def instructions(self, opcodes) -> list[tuple[str, Instruction]]:
        """(computation, instruction) for every instruction whose opcode is in ``opcodes``."""
        return [
            (c.name, i)
            for c in self.computations.values()
            for i in c.instructions.values()
            if i.opcode in opcodes
        ]

    def reachable(self, roots) -> set[str]:
        """``roots`` and every computation they call, transitively."""
        seen, stack = set(), list(roots)
        while stack:
            name = stack.pop()
            if name not in seen:
                seen.add(name)
                for instruction in self.computations[name].instructions.values():
                    stack.extend(instruction.called())
        return seen


# -- what feeds a ragged all-to-all ------------------------------------------------------------


def _caller_operand(module: HloModule, callee: str, caller: tuple[str, str], number: int):
    """[(computation, instruction)]: what parameter ``number`` of ``callee`` is at the call
    ``caller`` (a conditional's operand of that branch, a loop's initial value, a call's or
    fusion's operand ``number``; every operand of a reduction's scalar computation)."""
    computation, name = caller
    call = module.computations[computation].instructions[name]
    if call.opcode == "conditional":
        branches = call.called("branch_computations", "true_computation", "false_computation")
        return [(computation, call.operands[1 + branches.index(callee)])]
    if call.opcode == "while":
        return [(computation, call.operands[0])]
    if call.called("to_apply") and callee in call.called("to_apply"):
        return [(computation, operand) for operand in call.operands]  # a reduction's scalars
    return [(computation, call.operands[number])]


def all_reduces_feeding_ragged(module: HloModule) -> list[tuple[str, str]]:
    """(ragged all-to-all, all-reduce) for every all-reduce whose result reaches an operand of a
    ragged all-to-all through instructions that are no collective: elementwise ops, bitcasts,
    copies, tuples and their elements (followed element by element), fusions and calls (into
    the called computation's root, and from its parameters back to the call's operands),
    conditionals (every branch's root, and from a branch's parameter to its operand) and while
    loops (the body's root, and from its parameter to the loop's initial value and the body's
    result). Another collective ends the walk. Parameters of the entry computation are the
    step's inputs. The walk from a computation entered through a call returns through that call
    only; one that starts inside a called computation leaves it through every call site."""
    found = []
    for computation, ragged in module.instructions(RAGGED_OPS):
        # (computation, instruction, tuple path, frames: the calls entered, innermost last)
        todo = [(computation, operand, (), ()) for operand in ragged.operands]
        seen = set()
        while todo:
            state = todo.pop()
            if state in seen:
                continue
            seen.add(state)
            comp, name, path, frames = state
            instruction = module.computations[comp].instructions[name]
            op = instruction.opcode
            if op in ALL_REDUCE_OPS:
                found.append((ragged.name, name))
            elif op in COLLECTIVE_OPS:
                continue
            elif op == "get-tuple-element":
                index = int(instruction.attribute("index"))
                todo.append((comp, instruction.operands[0], (index, *path), frames))
            elif op == "tuple":
                if path:
                    todo.append((comp, instruction.operands[path[0]], path[1:], frames))
                else:
                    todo.extend((comp, operand, (), frames) for operand in instruction.operands)
            elif op == "parameter":
                if module.computations[comp].entry:
                    continue
                callers = [frames[-1]] if frames else module.callers.get(comp, [])
                outer = frames[:-1]
                for caller in callers:
                    for caller_comp, operand in _caller_operand(
                        module, comp, caller, int(instruction.operand_text)
                    ):
                        todo.append((caller_comp, operand, path, outer))
                    caller_instruction = module.computations[caller[0]].instructions[caller[1]]
                    if caller_instruction.opcode == "while":  # the loop-carried value
                        todo.append((comp, module.computations[comp].root, path, frames))
            elif op in ("conditional", "while") or instruction.called("calls"):
                callees = (
                    instruction.called("body")
                    if op == "while"
                    else instruction.called(
                        "branch_computations", "true_computation", "false_computation", "calls"
                    )
                )
                for callee in callees:
                    inner_path = path if not op.endswith("-start") else ()
                    todo.append(
                        (
                            callee,
                            module.computations[callee].root,
                            inner_path,
                            (*frames, (comp, name)),
                        )
                    )
                if op == "while":
                    todo.append((comp, instruction.operands[0], path, frames))
            else:  # the result is computed from every operand
                todo.extend((comp, operand, (), frames) for operand in instruction.operands)
    return found


# -- collectives inside a conditional's branches ---------------------------------------------


def replica_groups(instruction: Instruction, num_devices: int) -> list[list[int]]:
    """The device groups of a collective, from its ``replica_groups`` (explicit lists, the iota
    form ``[G,S]<=[dims]T(perm)``, or the mesh-axes form ``mesh['a'=2,'b'=4] {'a'}`` of an iota
    mesh) or its ``source_target_pairs``; every device in one group where it names none. Raises
    one line on a form it does not read (a mesh with explicit device ids or sub-axes)."""
    pairs = instruction.attribute("source_target_pairs")
    if pairs is not None:
        return [[int(x) for x in p.split(",")] for p in re.findall(r"\{(\d+,\d+)\}", pairs)]
    value = instruction.attribute("replica_groups")
    if value is None or value.strip() in ("{}", "{{}}"):
        return [list(range(num_devices))]
    value = value.strip()
    if value.startswith("{"):
        return [[int(x) for x in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", value)]
    iota = re.fullmatch(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", value)
    if iota is not None:
        groups, size, dims, perm = iota.groups()
        ids = np.arange(num_devices).reshape([int(d) for d in dims.split(",")])
        if perm:
            ids = ids.transpose([int(p) for p in perm.split(",")])
        return ids.reshape(int(groups), int(size)).tolist()
    mesh = re.fullmatch(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", value)
    if mesh is None or ":" in mesh.group(2):
        raise ValueError(f"replica_groups: cannot read {value!r} of {instruction.name}")
    axes = [
        (a.strip().strip("'"), int(s)) for a, s in (x.split("=") for x in mesh.group(1).split(","))
    ]
    names = [a for a, _ in axes]
    grouped = [names.index(a.strip().strip("'")) for a in mesh.group(2).split(",") if a.strip()]
    ids = np.arange(num_devices).reshape([s for _, s in axes])
    kept = [i for i in range(len(axes)) if i not in grouped]
    ids = ids.transpose(kept + grouped)
    size = int(np.prod([axes[i][1] for i in grouped])) if grouped else 1
    return ids.reshape(-1, size).tolist()


def branch_collectives_across_rows(module: HloModule, mesh) -> list[tuple[str, str, list]]:
    """(conditional, collective, its groups) for every collective in a conditional's branch
    computations, or in a computation they call (fusions, loops, nested conditionals,
    asynchronous wrappers), whose device groups span devices of different data rows of
    ``mesh`` (device ``d`` in row ``d // mesh.shape["expert"]``, `compile_only_mesh`'s order):
    a collective over the data axis, which deadlocks where data groups take different branches.
    """
    ep, n = mesh.shape["expert"], mesh.devices.size
    found = []
    for _, conditional in module.instructions({"conditional"}):
        branches = conditional.called(
            "branch_computations", "true_computation", "false_computation"
        )
        for name in sorted(module.reachable(branches)):
            for instruction in module.computations[name].instructions.values():
                if instruction.opcode not in COLLECTIVE_OPS or instruction.opcode.endswith("-done"):
                    continue
                groups = replica_groups(instruction, n)
                if any(len({d // ep for d in group}) > 1 for group in groups):
                    found.append((conditional.name, instruction.name, groups))
    return found
