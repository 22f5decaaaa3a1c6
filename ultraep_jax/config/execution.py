"""`Execution`: how the routed experts run (planner, expert kernel, communication backend,
transfer chunks, activation), and the names each choice may take. Names only: no kernel or
collective is imported here; what a name is on each platform, "auto" included, is
`config.resolve` (the one resolver), and `experts.registry` and `comm` map the names to code."""

from __future__ import annotations

import dataclasses

from ultraep_jax.base.activations import ClampedSwiGLU, check_activation
from ultraep_jax.base.arguments import check_positive_int
from ultraep_jax.config import resolve

#: The communication backends of the token exchange and the replica transfer (`comm`).
BACKENDS = resolve.NAMES["comm_backend"]
#: The expert kernels (`experts.registry`).
KERNELS = resolve.NAMES["expert_kernel"]
#: The planners (`planning.planner.plan`): the FFI handler or the same plans in JAX.
PLANNERS = resolve.NAMES["planner"]


def check_name(name: str, value, allowed, owner: str = "Execution") -> str:
    """``value`` as the choice ``name`` takes it (``allowed``: `BACKENDS`, `KERNELS`,
    `PLANNERS`; a deprecated alias mapped, with a DeprecationWarning); raises one line (``owner:
    name must be one of ...``, or what replaced a retired name): TypeError for a value that is no
    str (None included), ValueError for a str not among them."""
    if name in resolve.NAMES:
        return resolve.check_name(name, value, owner)
    if not isinstance(value, str):
        raise TypeError(
            f"{owner}: {name} must be one of {tuple(allowed)}, got {type(value).__name__} {value!r}"
        )
    if value not in allowed:
        raise ValueError(f"{owner}: {name} must be one of {tuple(allowed)}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Execution:
    """How the routed experts run: a frozen, hashable configuration (it keys compiled code).

    Every choice is a name ("auto" by default), resolved for the platform of the mesh the
    experts are traced on (`config.resolve`; docs/gpu.md's tables say what each name is where).

    Attributes:
      comm_backend: one of `BACKENDS`: "ragged" (`jax.lax.ragged_all_to_all`: only the needed
        rows move; not on CPU), "padded" (a fixed-size all_to_all, and a dense reduce-scatter for
        the replica transfer; any platform), or "auto" (padded on CPU, ragged elsewhere): the
        token exchange's and the replica transfer's (`comm`). "portable" is a deprecated name
        of "padded".
      expert_kernel: one of `KERNELS`: "tiled" (the CPU's loop), "ragged_dot" (XLA's), "mgpu"
        (JAX's Mosaic GPU kernels, Hopper), "tokamax" (tokamax's ragged dot, its extra), or
        "auto": tiled on CPU; on CUDA Mosaic GPU on Hopper where the operands suit it, else
        `jax.lax.ragged_dot`; on TPU tokamax's Mosaic TPU kernel where it is installed and takes
        the operands, else `ragged_dot` (`experts.registry`).
      transfer_chunks: n >= 1 (at most d_ff): the replica weights move as n transfers of d_ff / n
        hidden columns each, and each chunk's slot matmuls read only that chunk, so XLA may
        overlap transfer and compute (`replicas.streaming`; ffi/TRANSFER.md). 1: one transfer.
      activation: the experts' gated activation, a name of `ACTIVATIONS`: "silu" (SwiGLU,
        default), "gelu" (GeGLU, exact GELU), "gelu_tanh", "relu" (ReGLU); or a
        `ClampedSwiGLU` (gpt-oss's clamped unit, its limit and alpha as settings).
      planner: one of `PLANNERS`: "native" (the FFI handler), "portable" (the same plans in JAX,
        bit for bit), or "auto": native on CPU, and on CUDA where the CUDA handler was built;
        portable on TPU, ROCm and CUDA without the handler; chosen for each platform the step
        is lowered for (`planning.planner.plan`).
    """

    comm_backend: str = "auto"
    expert_kernel: str = "auto"
    transfer_chunks: int = 1
    activation: str | ClampedSwiGLU = "silu"
    planner: str = "auto"

    def __post_init__(self):
        backend = check_name("comm_backend", self.comm_backend, BACKENDS)
        object.__setattr__(self, "comm_backend", backend)
        check_name("expert_kernel", self.expert_kernel, KERNELS)
        check_activation(self.activation, "Execution")
        check_name("planner", self.planner, PLANNERS)
        chunks = check_positive_int("Execution", "transfer_chunks", self.transfer_chunks)
        object.__setattr__(self, "transfer_chunks", chunks)

    def check_on(self, platform: str | None, facts: resolve.Facts, exchanges: bool) -> None:
        """Raises our one-line refusal (`resolve.resolve`) for an explicit kernel, or a backend
        when anything is ``exchanges`` (an EP group of more than one rank), that devices of
        ``platform`` (None: not known before tracing: nothing to check), of which ``facts``
        (`resolve.facts_of` the mesh) are said, cannot run. "auto" is resolved when the experts
        are traced, from the same mesh."""
        if platform is None:
            return
        if exchanges:
            resolve.resolve("comm_backend", self.comm_backend, platform, facts)
        resolve.resolve("expert_kernel", self.expert_kernel, platform, facts)
