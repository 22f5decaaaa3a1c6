"""Configuration: what the planner may do (`BalancerConfig`) and how routed experts run over a
mesh (`ExpertParallel`). Both are frozen and hashable: they key compiled code."""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ultraep_jax import comm
from ultraep_jax._ops import INT64_MAX, check_finite, check_int, check_positive_int
from ultraep_jax.activations import ACTIVATIONS
from ultraep_jax.experts import KERNELS
from ultraep_jax.layout import Layout, check_divisible

# Every integer field reaches the native planner as an int64 FFI attribute.
_INT64_MAX = INT64_MAX
# Loads are int32, so no expert ever has more tokens: a larger floor would mean the same.
MAX_MIN_TOKENS_PER_REPLICA = 2**31 - 1
# A rank fills at most num_experts - num_experts / ep_size slots (each foreign expert once); the
# bound keeps the planner's [ep_size, slots_per_rank] outputs and workspace allocatable.
MAX_SLOTS_PER_RANK = 4096
# The relay schedule computes in int32 (`relay`); no plan has that many copies of an expert.
MAX_FANOUT = 2**31 - 1
# Below this many tokens per EP rank a balanced layer cost more than plain dropless EP on every
# measured load, skewed or not (docs/serving.md, "The small-batch fallback").
DEFAULT_MIN_TOKENS_PER_RANK = 256


def _as_int(name: str, value, minimum: int, maximum: int = _INT64_MAX) -> int:
    """``value`` as a Python int in [minimum, maximum] (`check_int`: TypeError for a
    non-integer, ValueError out of range); NumPy integer scalars are accepted."""
    return check_int(f"BalancerConfig.{name}", value, minimum, maximum)


def _as_float(name: str, value) -> float:
    """``value`` as a finite Python float >= 0 (ints and NumPy integer/float scalars accepted)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"BalancerConfig.{name} must be a float, got {type(value).__name__} {value!r}"
        )
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"BalancerConfig.{name} must be finite and >= 0, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class BalancerConfig:
    """What the planner may do, for one expert-parallel group.

    Integer fields accept Python or NumPy integers and ``balance_eps`` any real scalar (NumPy
    float32 included); they are stored as Python ``int`` / ``float``.

    Attributes:
        num_experts: E, logical experts; expert ``e`` lives on rank ``e // (E // ep_size)``
            (`layout`). Optional: `plan` reads it from the load matrix's shape and the layer
            (`MoE`, `ExpertParallel`) from its own; when given, it must agree with them.
        ep_size: R, ranks on the expert-parallel mesh axis; must divide ``num_experts``.
            Optional, like ``num_experts`` (read from the loads' shape or the mesh).
        slots_per_rank: S, spare slots per rank, each able to hold one replica expert's weights,
            0 to 4096 (a rank fills at most ``num_experts - num_experts / ep_size`` of them). 0
            disables replication (the plan then keeps every token on its master).
        min_tokens_per_replica: the least tokens a replica may carry (each replica costs a weight
            transfer), 1 to 2**31 - 1 (no expert has more tokens, loads being int32); a smaller
            replica is allowed only when it exactly clears a rank's remaining excess, or in exact
            mode (``balance_eps == 0``) when the floor would stop the planner from reaching the
            mean.
        balance_eps: tolerance above the mean rank load: the planner aims for every rank at most
            ``ceil(mean * (1 + balance_eps))`` and raises the threshold only when its attempts
            fail there. 0 (exactly; a subnormal value is a tolerance) is exact mode: every rank
            at ``M = ceil(mean)`` whenever the planner's attempts find such a plan, with replicas
            below ``min_tokens_per_replica`` where needed. That is guaranteed whenever any plan at
            ``M`` exists if ``ep_size == 2`` or ``slots_per_rank >= num_experts - num_experts /
            ep_size``; otherwise the attempts are a heuristic, which missed ``M`` in 1 in 60,000
            to 80,000 small random cases where a plan at ``M`` exists (ffi/PLANNER.md, "What is
            guaranteed").
        master_keep_tokens: tokens an expert's master always keeps for itself.
        max_fanout: f, the relay bound of the replica weight transfer (ffi/TRANSFER.md): an
            expert's master sends its weights to at most f of its replicas (a rank whose masters
            are replicated shares f first-hop copies among them, at least one each) and every
            replica forwards them to at most f others, in a tree of as few hops as that allows;
            gradients return along the tree, summed at each relay. 0: no bound (every master sends
            every copy itself). The default 2 gave the shortest modelled transfer on the
            DeepSeek-R1, Qwen1.5-MoE and Switch traces (docs/results.md, "Relay"). At
            most 2**31 - 1 (the schedule computes in int32). Not
            a planner input: the plan is the same for every f. The portable (CPU) exchange moves
            every copy in one hop whatever f is: there every rank sends the same rows.
        min_tokens_per_rank: the fallback threshold: a layer whose EP ranks each hold fewer
            tokens than this (a static shape, so decided when the layer is traced) compiles plain
            expert parallelism, with no planner call, no replica slots and no weight transfer
            (`applies`), at the layer's own buffer (with a capacity factor, it drops what plain
            EP at that buffer drops, counted in ``MoEStats.dropped``). Small batches, such as
            decode steps padded to fixed buffers, gain too little from balancing to repay the
            planner and the transfer. The default, 256, is where balancing began to pay
            against plain dropless EP on skewed loads (docs/serving.md); 0: always balance.
    """

    num_experts: int | None = None
    ep_size: int | None = None
    slots_per_rank: int = 2
    min_tokens_per_replica: int = 1024
    balance_eps: float = 0.01
    master_keep_tokens: int = 1
    max_fanout: int = 2
    min_tokens_per_rank: int = DEFAULT_MIN_TOKENS_PER_RANK

    def __post_init__(self):
        # Normalised in place (the dataclass is frozen), so equal configs hash equal whatever
        # scalar types they were built from.
        for name, minimum, maximum in (
            ("num_experts", 1, _INT64_MAX),
            ("ep_size", 1, _INT64_MAX),
            ("slots_per_rank", 0, MAX_SLOTS_PER_RANK),
            ("min_tokens_per_replica", 1, MAX_MIN_TOKENS_PER_REPLICA),
            ("master_keep_tokens", 0, _INT64_MAX),
            ("max_fanout", 0, MAX_FANOUT),
            ("min_tokens_per_rank", 0, _INT64_MAX),
        ):
            if getattr(self, name) is not None or name not in ("num_experts", "ep_size"):
                value = _as_int(name, getattr(self, name), minimum, maximum)
                object.__setattr__(self, name, value)
        object.__setattr__(self, "balance_eps", _as_float("balance_eps", self.balance_eps))
        if self.num_experts is not None and self.ep_size is not None:
            check_divisible(self.num_experts, self.ep_size, "BalancerConfig")

    def sized(self, num_experts: int, ep_size: int, holder: str) -> BalancerConfig:
        """This configuration for E = ``num_experts`` experts on R = ``ep_size`` ranks, the sizes
        of ``holder`` (what they are read from, for the error): raises one line if the
        configuration states other sizes."""
        stated = (self.num_experts, self.ep_size)
        if any(
            v is not None and v != want
            for v, want in zip(stated, (num_experts, ep_size), strict=True)
        ):
            raise ValueError(
                f"BalancerConfig(num_experts={self.num_experts}, ep_size={self.ep_size}) does not "
                f"match {holder} ({num_experts} experts on {ep_size} ranks): leave num_experts and "
                f"ep_size out of the BalancerConfig (they are read from {holder})"
            )
        return dataclasses.replace(self, num_experts=num_experts, ep_size=ep_size)

    def applies(self, tokens_per_rank: int) -> bool:
        """Whether a layer whose EP ranks hold ``tokens_per_rank`` tokens each (static) balances:
        False below ``min_tokens_per_rank``, where it runs plain expert parallelism."""
        return tokens_per_rank >= self.min_tokens_per_rank

    @property
    def experts_per_rank(self) -> int:
        """E_m = E / R: master experts on each rank (of a configuration with both sizes)."""
        if self.num_experts is None or self.ep_size is None:
            raise ValueError(
                "BalancerConfig.experts_per_rank: num_experts and ep_size are not set (they are "
                "read from the loads or the layer; BalancerConfig.sized(E, R, ...) sets them)"
            )
        return Layout(self.num_experts, self.ep_size).experts_per_rank


#: Mesh axis names that the default ``ExpertParallel.token_axes`` leaves out: tensor-parallel axes,
#: over which a layer's tokens are replicated.
TENSOR_AXIS_NAMES = ("model", "tensor", "tp", "mp")


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """How routed experts run over a mesh: a frozen, hashable configuration.

    Attributes:
      mesh: the device mesh (a `Mesh`, or an `AbstractMesh` to trace and export for devices this
        host may lack; since jax 0.11 the CUDA lowering of the Pallas kernel with no GPU attached
        needs one, for the GPU's kind: build the layer under `nnx.eval_shape`). Stored with every
        axis in Auto mode (`shard_map` does the splitting); calls accept arrays typed on the
        mesh's Explicit form too.
      num_experts: E; divisible by the EP size (an int; NumPy integers accepted).
      balancer: a `BalancerConfig`, or None for plain expert parallelism. Stored with E and the
        EP size filled in (leave them out of it; if it states them, they must agree). Ignored
        when the EP size is 1 (nothing to balance).
      capacity_factor: receive-buffer rows per rank as a multiple of the pairs a rank routes
        (``top_k * tokens per device``; a finite number > 0, NumPy scalars accepted); pairs
        beyond it are dropped and counted. None sizes the buffer for the worst case (every pair
        to one rank) so that nothing is ever dropped.
      expert_axis: the name of the EP mesh axis. A mesh without it (or with it of size 1) runs
        every expert on every device: plain local experts, no exchange, no balancing.
      token_axes: the mesh axes tokens are split over (the EP axis among them when the mesh has
        it); on the other axes every device sees the same tokens. Each index of the token axes
        other than the EP axis is an independent EP group with its own plan. None (default):
        every mesh axis except those named in `TENSOR_AXIS_NAMES` ("model", "tensor", "tp",
        "mp").
      comm_backend: "auto" (fixed-size collectives on CPU, `ragged_all_to_all` elsewhere),
        "portable" or "ragged"; see `comm.ragged_exchange`. With EP size 1 nothing is exchanged.
      expert_kernel: one of `experts.KERNELS` ("auto": Mosaic GPU on Hopper where the shapes
        suit it, else Pallas/Triton, on CUDA; the tiled loop elsewhere).
      transfer_chunks: n >= 1 (at most d_ff): the replica weights move as n transfers of d_ff / n
        hidden columns each, and each chunk's slot matmuls read only that chunk, so XLA may
        overlap transfer and compute (`streaming`; ffi/TRANSFER.md). 1: one transfer.
      activation: the experts' gated activation, a name of `activations.ACTIVATIONS`: "silu"
        (SwiGLU, default), "gelu" (GeGLU, exact GELU), "gelu_tanh", "relu" (ReGLU).
    """

    mesh: Mesh | AbstractMesh
    num_experts: int
    balancer: BalancerConfig | None = None
    capacity_factor: float | None = 1.25
    expert_axis: str = "expert"
    comm_backend: str = "auto"
    expert_kernel: str = "auto"
    transfer_chunks: int = 1
    token_axes: tuple[str, ...] | None = None
    activation: str = "silu"

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh | AbstractMesh):
            raise TypeError(
                "MoE: mesh must be a jax.sharding.Mesh or AbstractMesh, got "
                f"{type(self.mesh).__name__}"
            )
        if not isinstance(self.expert_axis, str):
            raise TypeError(f"MoE: expert_axis must be a str, got {self.expert_axis!r}")
        object.__setattr__(self, "token_axes", self._checked_token_axes())
        object.__setattr__(
            self, "num_experts", check_positive_int("MoE", "num_experts", self.num_experts)
        )
        E, R = self.num_experts, self.ep_size
        check_divisible(E, R, f"MoE (mesh axis {self.expert_axis!r})")
        b = self.balancer
        if b is not None and not isinstance(b, BalancerConfig):
            raise TypeError(
                f"MoE: balancer must be a BalancerConfig or None, got {type(b).__name__}"
            )
        if b is not None:
            object.__setattr__(self, "balancer", b.sized(E, R, "the layer and its mesh"))
        if self.capacity_factor is not None:
            cf = check_finite("MoE", "capacity_factor", self.capacity_factor, positive=True)
            object.__setattr__(self, "capacity_factor", cf)
        if self.comm_backend not in comm.BACKENDS:
            raise ValueError(
                f"MoE: comm_backend must be one of {comm.BACKENDS}, got {self.comm_backend!r}"
            )
        if self.expert_kernel not in KERNELS:
            raise ValueError(
                f"MoE: expert_kernel must be one of {KERNELS}, got {self.expert_kernel!r}"
            )
        if not isinstance(self.activation, str) or self.activation not in ACTIVATIONS:
            raise ValueError(
                f"MoE: activation must be one of {tuple(ACTIVATIONS)}, got {self.activation!r}"
            )
        object.__setattr__(
            self,
            "transfer_chunks",
            check_positive_int("MoE", "transfer_chunks", self.transfer_chunks),
        )
        object.__setattr__(self, "mesh", _auto_axes_mesh(self.mesh))
        if self.ep_size > 1:  # with one rank nothing is exchanged (the portable copy)
            comm.check_platform(self.comm_backend, self.mesh)

    def _checked_token_axes(self) -> tuple[str, ...]:
        """``token_axes`` as a tuple of mesh axes in mesh order (the default when None); raises
        one line for an unknown or repeated axis, or one that leaves out the EP axis."""
        names = tuple(self.mesh.axis_names)
        if self.token_axes is None:
            return tuple(a for a in names if a not in TENSOR_AXIS_NAMES)
        axes = (self.token_axes,) if isinstance(self.token_axes, str) else self.token_axes
        axes = tuple(axes)
        unknown = [a for a in axes if a not in names]
        if unknown or len(set(axes)) != len(axes):
            raise ValueError(
                f"MoE: token_axes must be distinct axes of the mesh {names}, got {axes}"
            )
        if self.expert_axis in names and self.expert_axis not in axes:
            raise ValueError(
                f"MoE: token_axes {axes} must include the EP axis {self.expert_axis!r} (tokens "
                "are split over the EP ranks that exchange them)"
            )
        return tuple(a for a in names if a in axes)

    @property
    def has_ep_axis(self) -> bool:
        """Whether the mesh has the EP axis (of any size)."""
        return self.expert_axis in self.mesh.axis_names

    @property
    def ep_size(self) -> int:
        """R, devices on the EP axis (1 without one)."""
        return self.mesh.shape[self.expert_axis] if self.has_ep_axis else 1

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The token axes other than the EP axis: each of their indices is one EP group."""
        return tuple(a for a in self.token_axes if a != self.expert_axis)

    @property
    def token_devices(self) -> int:
        """Devices that tokens are split over: the product of the token axes' sizes."""
        return math.prod(self.mesh.shape[a] for a in self.token_axes)

    @property
    def active_balancer(self) -> BalancerConfig | None:
        """The balancer that runs: None with one EP rank (nothing to balance)."""
        return self.balancer if self.ep_size > 1 else None

    def capacity(self, tokens_per_device: int, top_k: int) -> int:
        """C, receive-buffer rows per rank for ``tokens_per_device`` tokens choosing ``top_k``
        experts on each device."""
        pairs = top_k * tokens_per_device
        worst = self.ep_size * pairs
        if self.capacity_factor is None:
            return worst
        return max(1, min(worst, math.ceil(self.capacity_factor * pairs)))

    @property
    def on_cpu(self) -> bool:
        """Whether the mesh's devices are CPUs (an abstract mesh's when its device says so)."""
        if isinstance(self.mesh, Mesh):
            return self.mesh.devices.flat[0].platform == "cpu"
        return getattr(self.mesh.abstract_device, "platform", None) == "cpu"

    @property
    def exchange_backend(self) -> str:
        """The exchange backend to trace: "auto" resolved now on a CPU mesh (the portable one),
        else as configured ("auto" then picks per platform at lowering time). Tracing only the
        branch that runs halves the traced program on CPU."""
        return "portable" if self.comm_backend == "auto" and self.on_cpu else self.comm_backend

    @property
    def kernel(self) -> str:
        """The expert kernel to trace: "auto" resolved now on a CPU mesh ("tiled"), else as
        configured."""
        return "tiled" if self.expert_kernel == "auto" and self.on_cpu else self.expert_kernel

    @property
    def token_spec(self) -> P:
        """The partition of a flat token axis [T, ...]: split over the token axes."""
        return P(self.token_axes or None)

    @property
    def expert_spec(self) -> P:
        """The partition of expert weights [E, ...]: split over the EP axis (replicated without
        one)."""
        return P(self.expert_axis) if self.has_ep_axis else P()

    @property
    def expert_sharding(self) -> NamedSharding:
        """Where expert weights [E, ...] live: split over the EP axis."""
        return NamedSharding(self.mesh, self.expert_spec)


def _auto_axes_mesh(mesh: Mesh | AbstractMesh) -> Mesh | AbstractMesh:
    """``mesh`` with every axis in Auto mode (its devices, or its abstract device, kept)."""
    auto = (AxisType.Auto,) * len(mesh.axis_names)
    if isinstance(mesh, Mesh):
        return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)
    return AbstractMesh(
        mesh.axis_sizes, mesh.axis_names, axis_types=auto, abstract_device=mesh.abstract_device
    )
