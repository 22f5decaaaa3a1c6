"""`ExpertParallel`: where routed experts run (the mesh, its axes, the sizes, the receive buffer),
with its `Execution` (how: planner, kernel, communication backend, transfer chunks, activation),
whose explicit choices are checked against the mesh's platform once. Frozen and hashable: it
keys compiled code."""

from __future__ import annotations

import dataclasses
import math

from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ultraep_jax.base.arguments import check_finite, check_positive_int
from ultraep_jax.base.layout import check_divisible
from ultraep_jax.config import resolve
from ultraep_jax.config.balancer import BalancerConfig
from ultraep_jax.config.execution import Execution

#: Mesh axis names that the default ``ExpertParallel.token_axes`` leaves out: tensor-parallel axes,
#: over which a layer's tokens are replicated.
TENSOR_AXIS_NAMES = ("model", "tensor", "tp", "mp")


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Where routed experts run over a mesh: a frozen, hashable configuration.

    Attributes:
      mesh: the device mesh (a `Mesh`, or an `AbstractMesh` to trace and export for devices this
        host may lack: its abstract device's platform and kind are what "auto" is resolved for;
        build the layer under `nnx.eval_shape`). Stored with every axis in Auto mode
        (`shard_map` does the splitting); calls accept arrays typed on the mesh's Explicit form
        too.
      num_experts: E; divisible by the EP size (an int; NumPy integers accepted).
      balancer: a `BalancerConfig`, or None for plain expert parallelism. Stored with E and the
        EP size filled in (leave them out of it; if it states them, they must agree). Ignored
        when the EP size is 1 (nothing to balance).
      capacity_factor: receive-buffer rows per rank as a multiple of the pairs a rank routes
        (``top_k * tokens per device``; a finite number > 0, NumPy scalars accepted); pairs
        beyond it are dropped and counted. None sizes the buffer for the worst case (every pair
        to one rank) so that nothing is ever dropped.
      expert_axis: the name of the EP mesh axis; a mesh without that axis is a one-line error.
        None (or an EP axis of size 1) runs every expert on every device: plain local experts,
        no exchange, no balancing.
      token_axes: the mesh axes tokens are split over (the EP axis among them when the mesh has
        it); on the other axes every device sees the same tokens. Each index of the token axes
        other than the EP axis is an independent EP group with its own plan. None (default):
        every mesh axis except those named in `TENSOR_AXIS_NAMES` ("model", "tensor", "tp",
        "mp") and the ``tensor_axis``.
      tensor_axis: the mesh axis that splits each expert's hidden width F (expert tensor
        parallelism, as Megatron's and MaxText's EP x TP), or None (default): the expert weights
        are whole on each EP rank. With it, w_gate and w_up [E, D, F] are split
        ``P(expert_axis, None, tensor_axis)`` and w_down [E, F, D] ``P(expert_axis,
        tensor_axis, None)`` (`weight_specs`; the experts' biases, if any: `bias_specs`); the
        tensor ranks of an EP rank see the same tokens and run the same plan, each computes its
        F slice of every expert it holds (a
        replica slot receiving only the master's slice of the same tensor index, its gradient
        returning the same way), and the partial outputs are summed over the tensor axis. It
        must be an axis of the mesh other than the EP axis and not a token axis; F must be
        divisible by its size.
      execution: how the experts run (`Execution`), its names kept as given: "auto" is
        resolved when the experts are traced, for the platform of this mesh (`config.resolve`).
        An explicit choice the mesh's devices cannot run is refused when the configuration is
        built: "ragged" on CPU devices (with more than one EP rank), "mgpu" off Hopper.
      comm_backend, expert_kernel, transfer_chunks, activation, planner: keywords that set the
        fields of the same names of ``execution``, and read them back as attributes.
    """

    mesh: Mesh | AbstractMesh
    num_experts: int
    balancer: BalancerConfig | None = None
    capacity_factor: float | None = 1.25
    expert_axis: str | None = "expert"
    _: dataclasses.KW_ONLY
    token_axes: tuple[str, ...] | None = None
    tensor_axis: str | None = None
    execution: Execution = Execution()
    comm_backend: dataclasses.InitVar[str | None] = None
    expert_kernel: dataclasses.InitVar[str | None] = None
    transfer_chunks: dataclasses.InitVar[int | None] = None
    activation: dataclasses.InitVar[str | None] = None
    planner: dataclasses.InitVar[str | None] = None

    def __post_init__(self, *how):
        if not isinstance(self.mesh, Mesh | AbstractMesh):
            raise TypeError(
                "ExpertParallel: mesh must be a jax.sharding.Mesh or AbstractMesh, got "
                f"{type(self.mesh).__name__}"
            )
        self._check_expert_axis()
        self._check_tensor_axis()
        object.__setattr__(self, "token_axes", self._checked_token_axes())
        object.__setattr__(
            self,
            "num_experts",
            check_positive_int("ExpertParallel", "num_experts", self.num_experts),
        )
        check_divisible(
            self.num_experts,
            self.ep_size,
            "ExpertParallel",
            axis=self.expert_axis,
            devices=self.token_devices,
        )
        object.__setattr__(self, "balancer", self._sized_balancer())
        if self.capacity_factor is not None:
            cf = check_finite(
                "ExpertParallel", "capacity_factor", self.capacity_factor, positive=True
            )
            object.__setattr__(self, "capacity_factor", cf)
        object.__setattr__(self, "execution", self._resolved_execution(how))
        object.__setattr__(self, "mesh", _auto_axes_mesh(self.mesh))

    def _check_expert_axis(self) -> None:
        """Raises one line unless ``expert_axis`` is None or an axis of the mesh: a misspelt
        name would otherwise run every expert locally and report perfect balance."""
        names = tuple(self.mesh.axis_names)
        if self.expert_axis is None:
            return
        if not isinstance(self.expert_axis, str):
            raise TypeError(
                f"ExpertParallel: expert_axis must be a str or None, got {self.expert_axis!r}"
            )
        if self.expert_axis not in names:
            raise ValueError(
                f"ExpertParallel: the mesh has no axis {self.expert_axis!r} (its axes: {names}); "
                "name the EP axis with expert_axis=..., or pass expert_axis=None to run every "
                "expert on every device"
            )

    def _check_tensor_axis(self) -> None:
        """Raises one line unless ``tensor_axis`` is None or an axis of the mesh other than the
        EP axis (the token axes are checked against it in `_checked_token_axes`)."""
        names = tuple(self.mesh.axis_names)
        if self.tensor_axis is None:
            return
        if not isinstance(self.tensor_axis, str):
            raise TypeError(
                f"ExpertParallel: tensor_axis must be a str or None, got {self.tensor_axis!r}"
            )
        if self.tensor_axis not in names:
            raise ValueError(
                f"ExpertParallel: the mesh has no axis {self.tensor_axis!r} (its axes: {names}) "
                "for tensor_axis"
            )
        if self.tensor_axis == self.expert_axis:
            raise ValueError(
                f"ExpertParallel: tensor_axis {self.tensor_axis!r} is also the EP axis; the "
                "experts' hidden width needs an axis of its own"
            )

    def _sized_balancer(self) -> BalancerConfig | None:
        """``balancer`` with E and R filled in; raises one line for a wrong type or sizes, or
        for a balancer with no spare slot."""
        b = self.balancer
        if b is None:
            return None
        if not isinstance(b, BalancerConfig):
            raise TypeError(
                f"ExpertParallel: balancer must be a BalancerConfig or None, got {type(b).__name__}"
            )
        if b.slots_per_rank == 0:
            raise ValueError(
                "ExpertParallel: BalancerConfig(slots_per_rank=0) leaves the balancer no spare "
                "slot to replicate into; use slots_per_rank >= 1, or balancer=None for plain "
                "expert parallelism"
            )
        return b.sized(self.num_experts, self.ep_size, "the layer and its mesh")

    def _resolved_execution(self, how: tuple) -> Execution:
        """``execution`` with the keywords in ``how`` (comm_backend, expert_kernel,
        transfer_chunks, activation, planner; None: as ``execution`` says) set, checked against
        the mesh's platform (`Execution.check_on`)."""
        if not isinstance(self.execution, Execution):
            raise TypeError(
                "ExpertParallel: execution must be an Execution, got "
                f"{type(self.execution).__name__}"
            )
        given = dict(zip(_HOW, how, strict=True))
        execution = dataclasses.replace(
            self.execution, **{k: v for k, v in given.items() if v is not None}
        )
        execution.check_on(self.platform, resolve.facts_of(self.mesh), exchanges=self.ep_size > 1)
        return execution

    def _checked_token_axes(self) -> tuple[str, ...]:
        """``token_axes`` as a tuple of mesh axes in mesh order (the default when None); raises
        one line for an unknown or repeated axis, or one that leaves out the EP axis."""
        names = tuple(self.mesh.axis_names)
        if self.token_axes is None:
            left_out = (*TENSOR_AXIS_NAMES, self.tensor_axis)
            return tuple(a for a in names if a not in left_out)
        axes = (self.token_axes,) if isinstance(self.token_axes, str) else self.token_axes
        axes = tuple(axes)
        unknown = [a for a in axes if a not in names]
        if unknown or len(set(axes)) != len(axes):
            raise ValueError(
                f"ExpertParallel: token_axes must be distinct axes of the mesh {names}, got {axes}"
            )
        if self.expert_axis in names and self.expert_axis not in axes:
            raise ValueError(
                f"ExpertParallel: token_axes {axes} must include the EP axis "
                f"{self.expert_axis!r} (tokens are split over the EP ranks that exchange them)"
            )
        if self.tensor_axis in axes:
            raise ValueError(
                f"ExpertParallel: token_axes {axes} include the tensor_axis "
                f"{self.tensor_axis!r} (its ranks must see the same tokens)"
            )
        return tuple(a for a in names if a in axes)

    @property
    def has_ep_axis(self) -> bool:
        """Whether the experts are split over an EP axis (of any size): False only with
        ``expert_axis=None``."""
        return self.expert_axis is not None

    @property
    def ep_size(self) -> int:
        """R, devices on the EP axis (1 without one)."""
        return self.mesh.shape[self.expert_axis] if self.has_ep_axis else 1

    @property
    def tensor_size(self) -> int:
        """Devices on the tensor axis, each holding F / tensor_size hidden columns (1 without
        one)."""
        return self.mesh.shape[self.tensor_axis] if self.tensor_axis is not None else 1

    def local_d_ff(self, d_ff: int, caller: str = "ExpertParallel") -> int:
        """The hidden columns of each expert on one device, ``d_ff / tensor_size``; raises one
        line (prefixed by ``caller``) unless the tensor size divides ``d_ff``."""
        if d_ff % self.tensor_size:
            raise ValueError(
                f"{caller}: d_ff={d_ff} is not divisible by the size {self.tensor_size} of the "
                f"tensor axis {self.tensor_axis!r}"
            )
        return d_ff // self.tensor_size

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

    def balances(self, tokens_per_device: int) -> bool:
        """Whether a call with ``tokens_per_device`` tokens on each device (static) runs the
        balancer: it is active (`active_balancer`) and the tokens reach its
        ``min_tokens_per_rank``."""
        b = self.active_balancer
        return b is not None and b.applies(tokens_per_device)

    def capacity(self, tokens_per_device: int, top_k: int) -> int:
        """C, receive-buffer rows per rank for ``tokens_per_device`` tokens choosing ``top_k``
        experts on each device: ``ceil(capacity_factor * pairs)``, or the worst case (every pair
        to one rank: nothing dropped) without a factor, and in the small-batch fallback (an
        active balancer below its ``min_tokens_per_rank``), which must never drop a pair the
        balanced path would have kept."""
        pairs = top_k * tokens_per_device
        worst = self.ep_size * pairs
        fallback = self.active_balancer is not None and not self.balances(tokens_per_device)
        if self.capacity_factor is None or fallback:
            return worst
        return max(1, min(worst, math.ceil(self.capacity_factor * pairs)))

    @property
    def platform(self) -> str | None:
        """The platform of the mesh's devices ("cpu", "gpu", ...; an abstract mesh's when its
        abstract device says; None otherwise): `resolve.platform_of`."""
        return resolve.platform_of(self.mesh)

    @property
    def device_kind(self) -> str | None:
        """The kind of the mesh's devices ("cpu", "NVIDIA H100 80GB HBM3", ...), as `platform`."""
        return resolve.device_kind_of(self.mesh)

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

    @property
    def weight_specs(self) -> tuple[P, P, P]:
        """The partitions of (w_gate [E, D, F], w_up [E, D, F], w_down [E, F, D]): E over the EP
        axis and, with a ``tensor_axis``, F over it (all three `expert_spec` without one)."""
        if self.tensor_axis is None:
            return (self.expert_spec,) * 3
        e = self.expert_axis if self.has_ep_axis else None
        over_f = P(e, None, self.tensor_axis)
        return over_f, over_f, P(e, self.tensor_axis, None)

    @property
    def weight_shardings(self) -> tuple[NamedSharding, NamedSharding, NamedSharding]:
        """Where (w_gate, w_up, w_down) live (`weight_specs`)."""
        return tuple(NamedSharding(self.mesh, spec) for spec in self.weight_specs)

    @property
    def bias_specs(self) -> tuple[P, P, P]:
        """The partitions of the experts' biases (b_gate [E, F], b_up [E, F], b_down [E, D]): E
        over the EP axis and, with a ``tensor_axis``, the gate and up biases' F over it, as their
        weights' (the down bias whole on every tensor rank: it is added once, after the sum over
        the tensor axis)."""
        if self.tensor_axis is None:
            return (self.expert_spec,) * 3
        e = self.expert_axis if self.has_ep_axis else None
        return P(e, self.tensor_axis), P(e, self.tensor_axis), P(e)

    @property
    def bias_shardings(self) -> tuple[NamedSharding, NamedSharding, NamedSharding]:
        """Where (b_gate, b_up, b_down) live (`bias_specs`)."""
        return tuple(NamedSharding(self.mesh, spec) for spec in self.bias_specs)


def _auto_axes_mesh(mesh: Mesh | AbstractMesh) -> Mesh | AbstractMesh:
    """``mesh`` with every axis in Auto mode (its devices, or its abstract device, kept)."""
    auto = (AxisType.Auto,) * len(mesh.axis_names)
    if isinstance(mesh, Mesh):
        return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)
    return AbstractMesh(
        mesh.axis_sizes, mesh.axis_names, axis_types=auto, abstract_device=mesh.abstract_device
    )


#: The `Execution` fields that `ExpertParallel` also takes as keywords.
_HOW = tuple(f.name for f in dataclasses.fields(Execution))


def _read_back(name: str) -> property:
    return property(lambda self: getattr(self.execution, name), doc=f"``execution.{name}``")


# The keywords read back (``ep.comm_backend`` is ``ep.execution.comm_backend``), set once the
# dataclass has its fields: a property in the class body would be taken for the InitVar's
# default, and without these an instance would read the InitVar's default, None.
ExpertParallel.comm_backend = _read_back("comm_backend")
ExpertParallel.expert_kernel = _read_back("expert_kernel")
ExpertParallel.transfer_chunks = _read_back("transfer_chunks")
ExpertParallel.activation = _read_back("activation")
ExpertParallel.planner = _read_back("planner")
