"""The one resolver: what "auto", or an explicit name, is for the planner, the expert kernel and
the communication backend on a platform.

Each kind has one ordered list of `Candidate`s (`CANDIDATES`), each with its ``supported``
predicate (True, or why not: the reason our one-line refusal gives) and its ``auto`` predicate
(whether "auto" takes it there); "auto" is the first candidate of the list that both allow
(tokamax's ragged dot, whose ``IMPLEMENTATIONS`` and ``supported_on`` are the model, keeps the
same two lists: every implementation, and the order its default tries them in). `resolve` is the
rule; nothing else decides.

Where the platform comes from, at trace time (`traced_platform`): the platforms a program is
traced to be exported for, where the caller said (`lowering_for`, which `ultraep_jax.export`
sets); else the mesh the code is traced on, on every mesh: a concrete mesh's devices or an
abstract mesh's device (`platform_of`; inside a `shard_map`, its mesh). The expert kernel and the
exchange are resolved there, once, in Python (`choose`: "auto" resolved; an explicit name as
given, checked where the configuration is built, `Execution.check_on`, for its mesh's platform).
"auto" resolved from a mesh's devices holds only for that platform: lowered for another (a TPU
export of a step on CPU devices, made without `lowering_for`), it raises our one line instead of
running the mesh's choice there (`_lowered_only_for`). Where nothing names one platform (an
export for several, an abstract mesh without a device, no mesh at all), `by_platform` picks each
platform's choice when the program is lowered (`per_platform`: `jax.lax.platform_dependent`, used
nowhere else). The planner, whose native candidate is a custom call registered per platform and
not differentiated, is resolved by the same rule for each platform the program is lowered for
(`planning.planner`).

The facts a predicate reads beside the platform (`Facts`: the mesh's devices' kind, compute
capability and core count, `facts_of`; the planner's CUDA handler; one grouped matmul's operands)
are given by the caller: this module imports no stage. The mesh's facts are the target's, never
the host's: a step traced on a CPU host for a mesh of compile-only H100s (a deviceless compile)
or an abstract mesh of H100s gets the H100's choices, where the kernels themselves can be lowered
from that host (what each reads of the host: `base.operands`). The operand rules themselves are
`base.operands`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re
import sys
import warnings
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.extend
import jax.interpreters.ad
import jax.interpreters.batching
import jax.interpreters.mlir

from ultraep_jax.base import operands

#: The platforms a program is lowered for (`jax.export` names), and the one that stands for any
#: other in `by_platform`.
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
OTHER = "other"


class Operands(NamedTuple):
    """One grouped matmul's operands: lhs [M, K] and rhs [G, K, N], their shapes and dtypes."""

    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    lhs_dtype: object
    rhs_dtype: object

    @classmethod
    def of(cls, lhs, rhs) -> Operands:
        return cls(tuple(lhs.shape), tuple(rhs.shape), lhs.dtype, rhs.dtype)


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a candidate's predicates read beside the platform.

    Attributes:
      device_kind: the mesh's device kind ("cpu", "NVIDIA H100 80GB HBM3", "TPU v5 lite"), or
        None when no mesh says.
      cuda_handler: whether this install has the native planner's CUDA handler
        (`planning.native.has_cuda_handler`).
      operands: one grouped matmul's `Operands`, or None where the choice is made for every
        matmul of a kernel at once (then no predicate refuses for the operands).
      compute_capability: the mesh's GPUs' compute capability ("9.0"), where its devices carry
        one (a concrete mesh's GPUs, compile-only ones included; an abstract device has none),
        else None.
      core_count: the mesh's GPUs' streaming multiprocessors (132 on an H100 SXM), where its
        devices carry them (a GPU's ``core_count``, an abstract GPU's ``num_cores``), else None.
    """

    device_kind: str | None = None
    cuda_handler: bool = False
    operands: Operands | None = None
    compute_capability: str | None = None
    core_count: int | None = None

    def without_mesh(self) -> Facts:
        """These facts less the mesh's devices' (for a platform that is not theirs)."""
        return dataclasses.replace(self, device_kind=None, compute_capability=None, core_count=None)


Predicate = Callable[[str, Facts], "bool | str"]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One choice of a kind.

    Attributes:
      name: its name (`Execution`'s field takes it).
      doc: what it is, one line (docs/gpu.md's table is checked against it).
      supported: ``(platform, facts) -> True | reason``: whether it runs there; an explicit
        choice is refused with the reason where it does not.
      auto: ``(platform, facts) -> bool``: whether "auto" takes it there (where supported).
      instead: what the refusal suggests instead.
      cpu_compiles: whether XLA:CPU compiles what it lowers to for any platform. An export for
        several platforms, CPU among them, is compiled whole on CPU, every other platform's
        branch included: there a candidate that XLA:CPU cannot compile (a collective or kernel
        it lacks) is refused for every platform, and "auto" passes it over.
    """

    name: str
    doc: str
    supported: Predicate
    auto: Callable[[str, Facts], bool]
    instead: str
    cpu_compiles: bool = True

    def refusal(self, kind: str, platform: str, facts: Facts) -> str | None:
        """Our one-line refusal of this candidate on ``platform`` (None: it is supported)."""
        why = self.supported(platform, facts)
        if why is True and platform != "cpu" and not self.cpu_compiles and _beside_cpu():
            why = (
                f"an export for {_TARGETS.value} is compiled whole on CPU, {platform!r} "
                "branch included, and XLA:CPU cannot compile its ops; export for "
                f"{platform!r} apart"
            )
        if why is True:
            return None
        return f"{kind}={self.name!r}: {why}; {self.instead}"


def _beside_cpu() -> bool:
    """Whether the program traced is lowered for CPU among other platforms (`lowering_for`)."""
    targets = _TARGETS.value
    return targets is not None and len(targets) > 1 and "cpu" in targets


def _anywhere(platform: str, facts: Facts) -> bool:
    return True


def _native_supported(platform: str, facts: Facts) -> bool | str:
    """The FFI handler is registered for the platform: CPU always; CUDA where it was built."""
    if platform == "cpu" or (platform == "cuda" and facts.cuda_handler):
        return True
    if platform == "cuda":
        return (
            "this install has no CUDA planner handler (ULTRAEP_BUILD_CUDA=ON pip install ... "
            "builds it)"
        )
    return f"no native planner handler exists for {platform!r} devices"


def _ragged_supported(platform: str, facts: Facts) -> bool | str:
    if platform == "cpu":
        return "cannot run on CPU devices (XLA:CPU has no ragged_all_to_all)"
    return True


def _mgpu_supported(platform: str, facts: Facts) -> bool | str:
    """JAX's Mosaic GPU kernels: a Hopper target (the mesh's devices: their compute capability
    where they carry one, else their kind; any NVIDIA GPU where no mesh says), lowered on a
    Hopper host (`operands.host_is_hopper`: JAX's weight-gradient kernel reads the host's first
    device, whatever the mesh), bf16/f16 operands of one dtype whose K and N fit the tiles
    (`operands.mgpu_unsupported`)."""
    if platform != "cuda":
        return f"JAX's Mosaic GPU kernels run on NVIDIA GPUs, not {platform!r} devices"
    known = facts.device_kind is not None or facts.compute_capability is not None
    if known and not operands.is_hopper(facts.device_kind, facts.compute_capability):
        cc = facts.compute_capability
        cc = "" if cc is None else f", compute capability {cc}"
        return (
            "JAX's Mosaic GPU ragged-dot kernels need a Hopper GPU (compute capability 9.x), "
            f"not {facts.device_kind!r}{cc}"
        )
    if not operands.host_is_hopper():
        sms = "" if facts.core_count is None else f" (the mesh's GPUs have {facts.core_count})"
        return (
            "JAX's Mosaic GPU kernels read this host's GPU when they are lowered: the weight "
            "gradient's grid is jax.devices()[0].core_count (jax/experimental/pallas/ops/gpu/"
            "transposed_ragged_dot_mgpu.py), the SMs of this host's first device, whatever the "
            f"mesh{sms}, and this host has no Hopper GPU, so a deviceless compile or a CUDA "
            "export from it can use 'ragged_dot'"
        )
    ops = facts.operands
    if ops is None:
        return True
    if ops.lhs_dtype != ops.rhs_dtype:
        return f"operand dtypes differ ({ops.lhs_dtype} and {ops.rhs_dtype})"
    why = operands.mgpu_unsupported(ops.lhs_shape, ops.rhs_shape, ops.lhs_dtype)
    return True if why is None else f"unsupported operands: {why}"


def tokamax_installed() -> bool:
    """Whether tokamax can be imported (its extra: Python >= 3.12, jax >= 0.11.1)."""
    return importlib.util.find_spec("tokamax") is not None


def _tokamax_supported(platform: str, facts: Facts) -> bool | str:
    """tokamax's ragged dot with the platform's implementation (`experts.gmm_tokamax`): installed,
    and for CUDA lowered where JAX's default device is a GPU of the mesh's kind (tokamax's Mosaic
    GPU kernel picks its variant and grid from that device, `operands.default_device`, whatever
    the target): the GPU host's, or within ``jax.default_device`` of one of the mesh's devices
    (a compile-only GPU serves)."""
    if not tokamax_installed():
        return "tokamax is not installed (pip install 'ultraep_jax[tokamax]': Python >= 3.12)"
    if platform != "cuda":
        return True
    device = operands.default_device()
    if device.platform != "gpu":
        return (
            "tokamax's Mosaic GPU kernel picks its variant from JAX's default device "
            f"(jax.extend.backend.get_default_device(): {device.platform!r} here), so it cannot "
            "lower for CUDA here (it raises 'Unsupported GPU architecture'); lower on the GPU "
            "host, or within jax.default_device(<a device of the mesh>)"
        )
    if facts.device_kind is not None and device.device_kind != facts.device_kind:
        return (
            "tokamax's Mosaic GPU kernel picks its variant from JAX's default device, a "
            f"{device.device_kind!r}, not the mesh's {facts.device_kind!r}; lower within "
            "jax.default_device(<a device of the mesh>)"
        )
    return True


def _tokamax_auto(platform: str, facts: Facts) -> bool:
    """ "auto" takes tokamax on TPU, where its Mosaic TPU kernel takes the device and the
    operands, forward and backward. Not on CUDA until a GPU A/B against JAX's Mosaic GPU
    kernels ("mgpu", the only GPU kernel measured) decides."""
    if platform != "tpu":
        return False
    ops = facts.operands
    shapes = ((128, 128), (1, 128, 128)) if ops is None else (ops.lhs_shape, ops.rhs_shape)
    return operands.mosaic_tpu_unsupported(*shapes, facts.device_kind) is None


_INSTEAD_KERNEL = "use expert_kernel='auto' or 'ragged_dot'"

#: Each kind's candidates, in the order "auto" tries them.
CANDIDATES: dict[str, tuple[Candidate, ...]] = {
    "planner": (
        Candidate(
            "native",
            "the FFI custom call (C++ on CPU, CUDA where its handler was built)",
            _native_supported,
            _anywhere,
            "use planner='auto' (the portable planner there) or 'portable' (docs/gpu.md)",
        ),
        Candidate(
            "portable",
            "the same plans written in JAX (planning/portable.py)",
            _anywhere,
            _anywhere,
            "use planner='auto'",
        ),
    ),
    "expert_kernel": (
        Candidate(
            "tokamax",
            "tokamax's ragged dot with the target's implementation (Mosaic TPU on TPU v5+ where "
            "K, N >= 128; its XLA implementation, jax.lax.ragged_dot's values, on TPU v4 or below "
            "128)",
            _tokamax_supported,
            _tokamax_auto,
            _INSTEAD_KERNEL,
            cpu_compiles=False,
        ),
        Candidate(
            "mgpu",
            "JAX's Mosaic GPU ragged-dot kernels (Hopper; bf16/f16, K and N multiples of 128)",
            _mgpu_supported,
            _anywhere,
            _INSTEAD_KERNEL,
            cpu_compiles=False,
        ),
        Candidate(
            "ragged_dot",
            "XLA's jax.lax.ragged_dot",
            _anywhere,
            lambda platform, facts: platform != "cpu",
            _INSTEAD_KERNEL,
            cpu_compiles=False,  # off CPU it lowers to XLA's ragged-dot, which XLA:CPU lacks
        ),
        Candidate(
            "tiled",
            "the tiled loop over row tiles (its cost tracks the rows present)",
            _anywhere,
            lambda platform, facts: platform == "cpu" or _beside_cpu(),
            _INSTEAD_KERNEL,
        ),
    ),
    "comm_backend": (
        Candidate(
            "ragged",
            "jax.lax.ragged_all_to_all: only the rows needed move",
            _ragged_supported,
            _anywhere,
            "use comm_backend='padded' or 'auto'",
            cpu_compiles=False,
        ),
        Candidate(
            "padded",
            "a fixed-size all_to_all of R x max_chunk rows (the transfer: a dense reduce-scatter)",
            _anywhere,
            _anywhere,
            "use comm_backend='auto'",
        ),
    ),
}

#: The names each kind takes: "auto" and its candidates'.
NAMES = {kind: ("auto", *(c.name for c in found)) for kind, found in CANDIDATES.items()}

#: Names no longer taken, with the line that says what replaced them.
RETIRED = {
    ("expert_kernel", "pallas"): (
        "expert_kernel='pallas' (our Pallas kernel on Pallas' Triton backend, which JAX "
        "deprecates) was removed; use expert_kernel='tokamax' (tokamax's maintained ragged dot) "
        "or 'mgpu' (JAX's Mosaic GPU kernels, Hopper)"
    ),
}

#: Deprecated names and the names they stand for.
ALIASES = {("comm_backend", "portable"): "padded"}


def check_name(kind: str, name, owner: str) -> str:
    """``name`` as ``kind`` takes it: a name of `NAMES` (a deprecated alias mapped, with one
    DeprecationWarning naming its replacement); raises one line prefixed by ``owner``:
    TypeError for a value that is no str (None included), ValueError for a retired or unknown
    name."""
    allowed = NAMES[kind]
    if not isinstance(name, str):
        raise TypeError(
            f"{owner}: {kind} must be one of {allowed}, got {type(name).__name__} {name!r}"
        )
    if (kind, name) in ALIASES:
        new = ALIASES[kind, name]
        warnings.warn(
            f"{kind}={name!r} is deprecated: it is {kind}={new!r} (the name 'portable' is the "
            "planner written in JAX)",
            DeprecationWarning,
            stacklevel=_caller_level(),
        )
        return new
    if (kind, name) in RETIRED:
        raise ValueError(f"{owner}: {RETIRED[kind, name]}")
    if name not in allowed:
        raise ValueError(f"{owner}: {kind} must be one of {allowed}, got {name!r}")
    return name


def choose(kind: str, name: str, platform: str | None, facts: Facts | None = None) -> str:
    """What the code traced for ``platform`` runs: "auto" resolved (`resolve`); an explicit name
    as it is (the user's choice, checked once where the configuration is built,
    `Execution.check_on`, so that a step on CPU devices exported for CUDA may still name
    "ragged")."""
    name = check_name(kind, name, "choose")
    if name == "auto":
        return resolve(kind, name, platform, facts)
    targets = _TARGETS.value
    if targets is not None:  # an export's platforms: each must take the name
        for target in targets:
            resolve(kind, name, target, _facts_for(target, facts))
    elif platform is None:  # no platform known: refused where it runs on none
        _check_runs_somewhere(kind, name, facts)
    return name


def _facts_for(target: str, facts: Facts | None) -> Facts:
    """``facts`` without the mesh's devices' where the mesh is not of ``target``."""
    facts = Facts() if facts is None else facts
    if canonical_platform(platform_of(jax.sharding.get_abstract_mesh()), facts.device_kind) != (
        target
    ):
        facts = facts.without_mesh()
    return facts


def _check_runs_somewhere(kind: str, name: str, facts: Facts | None) -> None:
    """Raises the first platform's refusal of the explicit ``name`` where no platform takes it
    (tokamax not installed, say)."""
    candidate = _candidate(kind, name)
    # The accelerators first: their refusal says why a kernel or exchange of theirs cannot run.
    refusals = [candidate.refusal(kind, p, facts or Facts()) for p in (*PLATFORMS[1:], "cpu")]
    if all(r is not None for r in refusals):
        raise ValueError(refusals[0])


def _caller_level() -> int:
    """`warnings.warn`'s stacklevel of the first frame outside this package (and outside the
    dataclasses' generated code and flax, whose module construction calls our `uep.MoE`): the
    user's call, which a warning filter then names."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flax = sys.modules.get("flax")
    inside = (package,) + (() if flax is None else (os.path.dirname(flax.__file__),))
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(inside) or name == "<string>" or name == dataclasses.__file__):
            return level
        frame, level = frame.f_back, level + 1
    return 1


def canonical_platform(platform: str | None, device_kind: str | None = None) -> str | None:
    """A device's platform as a lowering names it: "gpu" is "cuda", or "rocm" for an AMD
    device kind (XLA's ROCm executor reports a product name, "AMD Instinct MI300X", or the
    architecture, "gfx942:sramecc+:xnack-", "gfx950"); None stays None (unknown)."""
    if platform is None:
        return None
    platform = platform.lower()
    if platform == "gpu":
        return "rocm" if _AMD_KIND.search(device_kind or "") else "cuda"
    return platform


#: An AMD GPU's device kind: its product name or its gfx architecture.
_AMD_KIND = re.compile(r"\b(AMD|Radeon|Instinct)\b|\bgfx\d", re.IGNORECASE)


def resolve(kind: str, name: str, platform: str | None, facts: Facts | None = None) -> str:
    """The concrete choice of ``kind`` ("planner", "expert_kernel", "comm_backend") that
    ``name`` is on ``platform`` ("cpu", "gpu"/"cuda", "rocm", "tpu"), given ``facts``.

    "auto": the first of `CANDIDATES`\\ [kind] whose ``auto`` and ``supported`` predicates both
    hold. A candidate's name: itself where ``supported`` holds, else a ValueError (one line:
    why, and what instead); on an unknown platform (None) every explicit name is itself, and
    "auto" is an error (`by_platform` resolves it per platform)."""
    facts = Facts() if facts is None else facts
    name = check_name(kind, name, "resolve")
    platform = canonical_platform(platform, facts.device_kind)
    if name != "auto":
        if platform is not None:
            if (refusal := _candidate(kind, name).refusal(kind, platform, facts)) is not None:
                raise ValueError(refusal)
        return name
    if platform is None:
        raise ValueError(f"resolve: {kind}='auto' needs a platform (by_platform picks one)")
    for candidate in CANDIDATES[kind]:
        if candidate.auto(platform, facts) and candidate.refusal(kind, platform, facts) is None:
            return candidate.name
    raise AssertionError(f"no {kind} candidate for {platform!r}")  # the last one runs anywhere


def _device(mesh):
    """A device of ``mesh`` (a `Mesh`'s first; an `AbstractMesh`'s abstract device), or None."""
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh.devices.flat[0]
    return getattr(mesh, "abstract_device", None)


def platform_of(mesh) -> str | None:
    """The platform of a mesh's devices ("cpu", "gpu", "tpu"): a `Mesh`'s, or an abstract
    mesh's device's; None when it has none (or ``mesh`` is None)."""
    return getattr(_device(mesh), "platform", None)


def device_kind_of(mesh) -> str | None:
    """The device kind of a mesh's devices (as `platform_of`), or None."""
    return getattr(_device(mesh), "device_kind", None)


def facts_of(mesh, **given) -> Facts:
    """`Facts` of a mesh's devices (a `Mesh`'s first device, an abstract mesh's device; none for
    None or a mesh without one): their kind, and for GPUs their compute capability and core
    count where the devices carry them (a compile-only H100: "9.0" and 132; an abstract H100:
    its ``num_cores``, no compute capability); and ``given``."""
    device = _device(mesh)
    if device is None:
        return Facts(**given)
    gpu = getattr(device, "platform", None) == "gpu"
    capability = getattr(device, "compute_capability", None) if gpu else None
    cores = getattr(device, "core_count", getattr(device, "num_cores", None)) if gpu else None
    return Facts(
        device_kind=getattr(device, "device_kind", None),
        compute_capability=None if capability is None else str(capability),
        core_count=cores,
        **given,
    )


#: The platforms the program being traced is to be lowered for, where the caller said
#: (`lowering_for`), else None: a JAX user context, so that a jitted function traced under other
#: targets is traced again, not served from JAX's cache.
_TARGETS = jax.make_user_context(None)


def target_platforms(platforms) -> tuple[str, ...]:
    """``platforms`` (a name or names of `PLATFORMS`; "gpu" is "cuda") as lowering names them,
    once each; raises one line for none or an unknown one."""
    if isinstance(platforms, str):
        platforms = (platforms,)
    if not isinstance(platforms, (tuple, list)):
        raise TypeError(
            f"platforms must be a platform name or a list of them ({PLATFORMS}), got "
            f"{type(platforms).__name__} {platforms!r}"
        )
    targets = tuple(dict.fromkeys(canonical_platform(p) for p in platforms))
    if not targets or any(p not in PLATFORMS for p in targets):
        raise ValueError(f"platforms must name some of {PLATFORMS}, got {tuple(platforms)!r}")
    return targets


@contextlib.contextmanager
def lowering_for(platforms):
    """Within: "auto" is resolved for ``platforms`` (`target_platforms`), not for the mesh's
    devices: one platform's choices, or for several each platform's, picked when the program is
    lowered. For `jax.export` of a step traced on another platform's devices
    (`ultraep_jax.export` wraps it)."""
    with _TARGETS(target_platforms(platforms)):
        yield


def _mesh_platform() -> str | None:
    return canonical_platform(platform_of(jax.sharding.get_abstract_mesh()), _mesh_kind())


def _mesh_kind() -> str | None:
    return device_kind_of(jax.sharding.get_abstract_mesh())


def traced_platform() -> str | None:
    """The platform the code being traced is for: the one of `lowering_for` where it names one;
    None where it names several; else the platform of the mesh traced on
    (`jax.sharding.get_abstract_mesh`: a shard_map's, or one set with `jax.set_mesh`), or None
    when no mesh says."""
    targets = _TARGETS.value
    if targets is not None:
        return targets[0] if len(targets) == 1 else None
    return platform_of(jax.sharding.get_abstract_mesh())


def traced_facts(**given) -> Facts:
    """`Facts` of the traced mesh's devices (`facts_of`; where the mesh's platform is the one
    traced for: none for an export to another), and ``given``."""
    facts = facts_of(jax.sharding.get_abstract_mesh(), **given)
    targets = _TARGETS.value
    if targets is not None and targets != (_mesh_platform(),):
        facts = facts.without_mesh()
    return facts


def by_platform(kind: str, name: str, run: Callable[[str | None], Callable], *args):
    """``run(platform)(*args)`` for the platform traced for (`traced_platform`; ``run`` resolves
    ``name`` for the platform it is given). For "auto" where no one platform is named, every
    named platform's ``run`` (`lowering_for`'s, else every platform's) is traced and the
    lowering picks its own (`per_platform`); an explicit name needs no platform (``run(None)``).
    "auto" resolved from the mesh's devices is marked to be lowered for their platform alone."""
    platform = traced_platform()
    targets = _TARGETS.value
    if platform is None and name == "auto":
        if targets is not None:
            return per_platform({p: run(p) for p in targets}, *args)
        # No platform named at all: a lowering for several, CPU among them, compiles every
        # branch on CPU, so the result is marked to refuse that where a platform's choice is of
        # ops XLA:CPU cannot compile (outside the switch: a branch may be lowered for its own
        # platform alone).
        facts = traced_facts()
        held = {p: _candidate(kind, resolve(kind, name, p, facts)).cpu_compiles for p in PLATFORMS}
        out = per_platform({p: run(p) for p in (*PLATFORMS, OTHER)}, *args)
        not_held = tuple(p for p in PLATFORMS if not held[p])
        return _mark(out, kind=kind, platform=not_held, rule="not_beside_cpu") if not_held else out
    out = run(platform)(*args)
    if name == "auto" and targets is None:
        out = _mark(out, kind=kind, platform=_mesh_platform(), rule="only")
    return out


def _candidate(kind: str, name: str) -> Candidate:
    (found,) = (c for c in CANDIDATES[kind] if c.name == name)
    return found


def _mark(tree, **params):
    """``tree`` with its first leaf marked (`_platform_check_p`, an identity) so that lowering
    it where ``params``' rule forbids raises our one line (`_check_lowering`)."""
    leaves, treedef = jax.tree.flatten(tree)
    leaves[0] = _platform_check_p.bind(leaves[0], **params)
    return jax.tree.unflatten(treedef, leaves)


# An identity on one array that lowers to nothing, checking the platforms it is lowered for.
_platform_check_p = jax.extend.core.Primitive("ultraep_resolved_for")
_platform_check_p.def_impl(lambda x, **params: x)
_platform_check_p.def_abstract_eval(lambda x, **params: x)


def _check_lowering(ctx, x, *, kind: str, platform, rule: str):
    """Rule "only": "auto" resolved for ``platform`` from the mesh is lowered for it alone.
    Rule "not_beside_cpu": none of the platforms ``platform`` (a tuple), whose choices are of ops
    XLA:CPU cannot compile, is lowered beside CPU (XLA:CPU would compile their branches)."""
    lowered = tuple(ctx.module_context.platforms)
    if rule == "not_beside_cpu":
        if "cpu" in lowered and (beside := [p for p in lowered if p in platform]):
            raise ValueError(
                f"ultraep_jax: {kind}='auto' on {beside[0]!r} lowers to ops XLA:CPU cannot "
                f"compile, and a program lowered for {lowered} is compiled whole on CPU; trace "
                f"it within ultraep_jax.export(..., platforms={list(lowered)}), which takes "
                f"choices XLA:CPU compiles for every platform, or export CPU apart"
            )
        return [x]
    if lowered != (platform,):
        raise ValueError(
            f"ultraep_jax: {kind}='auto' was resolved for {platform!r} from the mesh's devices, "
            f"and the program is lowered for {lowered}; trace it within "
            f"ultraep_jax.export(..., platforms={list(lowered)}) (or lowering_for), on a mesh "
            f"of the target, or name the {kind}"
        )
    return [x]


def _check_jvp(primals, tangents, **params):
    return _platform_check_p.bind(primals[0], **params), tangents[0]


def _check_batch(args, dims, **params):
    return _platform_check_p.bind(args[0], **params), dims[0]


jax.interpreters.mlir.register_lowering(_platform_check_p, _check_lowering)
jax.interpreters.ad.primitive_jvps[_platform_check_p] = _check_jvp
jax.interpreters.batching.primitive_batchers[_platform_check_p] = _check_batch


def per_platform(impls: dict, *args):
    """``impls[p](*args)`` for the platform p the program is lowered for, when it is lowered
    (``impls``: by platform, `OTHER` for any other): the one use of
    `jax.lax.platform_dependent`, for a program whose platform nothing named when it was traced
    (an abstract mesh without a device, no mesh, an export to several platforms). One entry is
    called as it is."""
    if len(impls) == 1:
        (impl,) = impls.values()
        return impl(*args)
    branches = {p: impl for p, impl in impls.items() if p != OTHER}
    if OTHER in impls:
        branches["default"] = impls[OTHER]
    return jax.lax.platform_dependent(*args, **branches)


def candidate_table() -> tuple[tuple[str, str, str], ...]:
    """(kind, name, doc) of every candidate, in `CANDIDATES` order (for the docs' tables)."""
    return tuple((kind, c.name, c.doc) for kind, found in CANDIDATES.items() for c in found)
