"""`Execution`: how the routed experts run (planner, expert kernel, communication backend,
transfer chunks, activation), and the names each choice may take. Names only: no kernel or
collective is imported here (`experts.registry` and `comm` map the names to code)."""

from __future__ import annotations

import dataclasses

from ultraep_jax.base.activations import ClampedSwiGLU, check_activation
from ultraep_jax.base.arguments import check_positive_int

#: What "auto" is on each platform (`jax.lax.platform_dependent` keywords). The planner's is
#: resolved when the computation is lowered, on every mesh (`planning.planner.plan`: only that
#: planner is traced); the others' on a mesh of CPU devices when the configuration is built (only
#: that branch is traced), on any other mesh when the computation is lowered
#: (`comm.by_backend`, `experts.registry`). XLA:CPU
#: cannot compile `ragged_all_to_all`. The kernel "cuda" is JAX's Mosaic GPU kernels on Hopper
#: where the shapes suit them, else XLA's `ragged_dot` (not the Pallas Triton backend, which JAX
#: 0.12 deprecates); TPU and ROCm run JAX's own
#: `ragged_all_to_all` and `ragged_dot`. The planner: the native FFI handler on CPU and on CUDA
#: (there only where the CUDA handler was built, `planning.planner.plan`), else the portable one.
AUTO = {
    "comm_backend": {"cpu": "portable", "default": "ragged"},
    "expert_kernel": {"cuda": "cuda", "cpu": "tiled", "default": "ragged_dot"},
    "planner": {"cpu": "native", "cuda": "native", "default": "portable"},
}
#: The communication backends of the token exchange and the replica transfer (`comm`).
BACKENDS = ("auto", "portable", "ragged")
#: The expert kernels (`experts.registry`).
KERNELS = ("auto", "tiled", "ragged_dot", "pallas", "mgpu")
#: The planners (`planning.planner.plan`): the FFI handler or the same plans in JAX.
PLANNERS = ("auto", "native", "portable")


def check_platform(comm_backend: str, platform: str | None) -> None:
    """Raises ValueError (one line naming the backend) when devices of ``platform`` cannot run
    ``comm_backend``: "ragged" on CPU (XLA:CPU has no `ragged_all_to_all`)."""
    if comm_backend == "ragged" and platform == "cpu":
        raise ValueError(
            "Execution: comm_backend='ragged' cannot run on CPU devices (XLA:CPU has no "
            "ragged_all_to_all); use 'portable' or 'auto'"
        )


def check_name(name: str, value, allowed, owner: str = "Execution") -> None:
    """Raises one line (``owner: name must be one of ...``) unless ``value`` is one of the names
    ``allowed`` (`BACKENDS`, `KERNELS`, `PLANNERS`): TypeError for a value that is no str (None
    included), ValueError for a str not among them."""
    if not isinstance(value, str):
        raise TypeError(
            f"{owner}: {name} must be one of {tuple(allowed)}, got {type(value).__name__} {value!r}"
        )
    if value not in allowed:
        raise ValueError(f"{owner}: {name} must be one of {tuple(allowed)}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Execution:
    """How the routed experts run: a frozen, hashable configuration (it keys compiled code).

    Attributes:
      comm_backend: "auto" (fixed-size collectives on CPU, `ragged_all_to_all` elsewhere),
        "portable" or "ragged": the token exchange's and the replica transfer's (`comm`).
      expert_kernel: one of `KERNELS` ("auto": Mosaic GPU on Hopper where the shapes suit it,
        else `jax.lax.ragged_dot`, on CUDA; the tiled loop on CPU; `experts.registry`; "pallas"
        is Pallas' Triton backend, deprecated by JAX 0.12, and only an explicit choice).
      transfer_chunks: n >= 1 (at most d_ff): the replica weights move as n transfers of d_ff / n
        hidden columns each, and each chunk's slot matmuls read only that chunk, so XLA may
        overlap transfer and compute (`replicas.streaming`; ffi/TRANSFER.md). 1: one transfer.
      activation: the experts' gated activation, a name of `ACTIVATIONS`: "silu" (SwiGLU,
        default), "gelu" (GeGLU, exact GELU), "gelu_tanh", "relu" (ReGLU); or a
        `ClampedSwiGLU` (gpt-oss's clamped unit, its limit and alpha as settings).
      planner: one of `PLANNERS`: "auto" (the native FFI handler on CPU, and on CUDA where the
        CUDA handler was built; the portable planner on TPU, ROCm and CUDA without the handler;
        chosen for the platform the step is lowered for), "native" or "portable" (the same plans,
        bit for bit).
    """

    comm_backend: str = "auto"
    expert_kernel: str = "auto"
    transfer_chunks: int = 1
    activation: str | ClampedSwiGLU = "silu"
    planner: str = "auto"

    def __post_init__(self):
        check_name("comm_backend", self.comm_backend, BACKENDS)
        check_name("expert_kernel", self.expert_kernel, KERNELS)
        check_activation(self.activation, "Execution")
        check_name("planner", self.planner, PLANNERS)
        chunks = check_positive_int("Execution", "transfer_chunks", self.transfer_chunks)
        object.__setattr__(self, "transfer_chunks", chunks)

    def on(self, platform: str | None, exchanges: bool = True) -> Execution:
        """This execution for devices of ``platform`` (None: not known before lowering): "auto"
        resolved by `AUTO` on CPU; raises one line for a backend the platform cannot run when
        anything is ``exchanges`` (an EP group of more than one rank)."""
        if exchanges:
            check_platform(self.comm_backend, platform)
        if platform != "cpu":
            return self
        # The planner's "auto" stays: `planning.planner.plan` resolves it when the step is
        # lowered, by the platform it is lowered for (one planner traced either way), so a step
        # built on CPU devices and exported for TPU plans portably there.
        resolved = {
            name: table.get(platform, table["default"])
            for name, table in AUTO.items()
            if getattr(self, name) == "auto" and name != "planner"
        }
        return dataclasses.replace(self, **resolved)
