"""The functional core of the balanced expert-parallel MoE: routed tokens in, combined output out.

`routed_experts` takes tokens, a routing result (expert ids and weights per token, from any
router) and the SwiGLU expert weights, and runs one `jax.shard_map` over the mesh (batch split
over every mesh axis, experts over the EP axis). On each device, `_moe_shard` runs the stages

  plan:     exact loads of this microbatch, all-gathered over the EP axis -> the FFI planner
  dispatch: reroute counts and offsets (`dispatch.plan_dispatch`) -> token all-to-all
  experts:  replica weights fetched (`transfer`, relayed, in `streaming` chunks) -> grouped
            SwiGLU over masters and slots
  combine:  results back (the reversed all-to-all) -> weighted sum per token

Each index of the other mesh axes ("data") is an independent EP group with its own plan.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ultraep_jax import comm, dispatch, relay, reroute, streaming
from ultraep_jax._ops import check_finite, check_positive_int
from ultraep_jax._vma import vary
from ultraep_jax.config import BalancerConfig
from ultraep_jax.experts import KERNELS, local_experts
from ultraep_jax.layout import Layout, check_divisible
from ultraep_jax.planner import plan as make_plan
from ultraep_jax.routers import expert_loads
from ultraep_jax.stats import imbalance


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEStats:
    """What balancing did in one call of the layer.

    Attributes:
      expert_load: int32 [E], (token, choice) pairs routed to each expert (ids in [0, E)).
      rank_load_before: int32 [R], pairs routed to each EP rank's master experts.
      rank_load_after: int32 [R], pairs each EP rank is planned to process after balancing
        (equal to ``rank_load_before`` without a balancer; pairs dropped for capacity included).
      dropped: int32 [], pairs that did not fit in their destination's receive buffer; they
        contribute nothing to the output.
      invalid: int32 [], pairs whose expert id is outside [0, E) (possible only under `jit`,
        where `routed_experts` cannot check traced ids): they are sent nowhere, contribute
        nothing to the output, and are counted in no other stat.
      replicas: int32 [], replica instances used.
      over_capacity: int32 [], EP groups whose plan could not keep every rank within the receive
        buffer (their excess pairs are dropped and counted in ``dropped``).
      imbalance_before, imbalance_after: float32 [], max / mean of the rank loads.
      aux_loss, z_loss: float32 [], the router's load-balancing and z losses (`routers.Routing`)
        when the stats come from `MoE`; 0 from `routed_experts`, which sees no router.
      group_rows: int32 [R, G], rows each EP rank received for each of its local groups (E_m
        masters, then S replica slots; G = E_m without a balancer): the group sizes its experts
        ran on, all-gathered over the EP axis.
      transfer_send_max: float32 [], the most bytes one EP rank sends in the replica weight
        transfer under the relay schedule (`relay`, ``BalancerConfig.max_fanout``): copies times
        the bytes of one expert's w_gate, w_up and w_down (float32, so exact below 2**24 bytes);
        the gradients return the same bytes in backward. 0 without replicas. Computed from the
        plan, not measured.

    With other mesh axes beside the EP axis, each of their indices is an independent EP group:
    loads, ``dropped``, ``replicas``, ``over_capacity`` and ``group_rows`` are summed over the
    groups (``group_rows[r, g]``: rows of local group g on EP rank r of every group), and the
    imbalances and ``transfer_send_max`` are the worst group's.
    """

    expert_load: jax.Array
    rank_load_before: jax.Array
    rank_load_after: jax.Array
    dropped: jax.Array
    invalid: jax.Array
    replicas: jax.Array
    over_capacity: jax.Array
    imbalance_before: jax.Array
    imbalance_after: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    group_rows: jax.Array
    transfer_send_max: jax.Array

    _SUMMED = (
        "expert_load",
        "rank_load_before",
        "rank_load_after",
        "dropped",
        "invalid",
        "replicas",
        "over_capacity",
        "group_rows",
    )

    @classmethod
    def of_group(
        cls, loads_RE, plan, dropped, invalid, capacity: int, group_rows_RG, send_max
    ) -> MoEStats:
        """The stats of one EP group from its all-gathered loads [R, E], plan, drops, pairs of
        no expert, rows received per rank and local group [R, G] and the transfer's largest
        per-rank send in bytes."""
        load_E = jnp.sum(loads_RE, axis=0)
        before_R = Layout.of(loads_RE).master_loads(load_E)
        return cls(
            expert_load=load_E,
            rank_load_before=before_R,
            rank_load_after=plan.rank_load,
            dropped=dropped,
            invalid=invalid,
            replicas=plan.num_replicas,
            over_capacity=(jnp.max(plan.rank_load) > capacity).astype(jnp.int32),
            imbalance_before=imbalance(before_R),
            imbalance_after=imbalance(plan.rank_load),
            aux_loss=jnp.float32(0),
            z_loss=jnp.float32(0),
            group_rows=group_rows_RG,
            transfer_send_max=send_max,
        )

    def over_groups(self, data_axes: tuple[str, ...]) -> MoEStats:
        """Aggregated over the EP groups along ``data_axes``: counts summed, imbalances maxed
        (inside `shard_map`; identity without data axes)."""
        if not data_axes:
            return self
        return dataclasses.replace(
            self,
            **{
                f.name: (jax.lax.psum if f.name in self._SUMMED else jax.lax.pmax)(
                    getattr(self, f.name), data_axes
                )
                for f in dataclasses.fields(self)
            },
        )


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """How routed experts run over a mesh: a frozen, hashable configuration.

    Attributes:
      mesh: the device mesh; it must have ``expert_axis``. Tokens are split over every mesh
        axis; the indices of the other axes are independent EP groups (data parallelism). Stored
        with every axis in Auto mode (`shard_map` does the splitting). An `AbstractMesh` traces
        and exports for the devices its ``abstract_device`` names, which this host may lack (build
        the layer under `nnx.eval_shape`: such a mesh holds no arrays); since jax 0.11 the CUDA
        lowering of the Pallas kernel with no GPU attached needs it, for the GPU's kind.
      num_experts: E; divisible by the EP size (an int; NumPy integers accepted).
      balancer: a `BalancerConfig`, or None for plain expert parallelism. Stored with E and the
        EP size filled in (leave them out of it; if it states them, they must agree).
      capacity_factor: receive-buffer rows per rank as a multiple of the pairs a rank routes
        (``top_k * tokens per device``; a finite number > 0, NumPy scalars accepted); pairs
        beyond it are dropped and counted. None sizes the buffer for the worst case (every pair
        to one rank) so that nothing is ever dropped.
      expert_axis: the name of the EP mesh axis.
      comm_backend: "auto" (fixed-size collectives on CPU, `ragged_all_to_all` elsewhere),
        "portable" or "ragged"; see `comm.ragged_exchange`. With EP size 1 nothing is exchanged.
      expert_kernel: one of `experts.KERNELS` ("auto": Mosaic GPU on Hopper where the shapes
        suit it, else Pallas/Triton, on CUDA; the tiled loop elsewhere).
      transfer_chunks: n >= 1 (at most d_ff): the replica weights move as n transfers of d_ff / n
        hidden columns each, and each chunk's slot matmuls read only that chunk, so XLA may
        overlap transfer and compute (`streaming`; ffi/TRANSFER.md). 1: one transfer.
    """

    mesh: Mesh | AbstractMesh
    num_experts: int
    balancer: BalancerConfig | None = None
    capacity_factor: float | None = 1.25
    expert_axis: str = "expert"
    comm_backend: str = "auto"
    expert_kernel: str = "auto"
    transfer_chunks: int = 1

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh | AbstractMesh):
            raise TypeError(
                "MoE: mesh must be a jax.sharding.Mesh or AbstractMesh, got "
                f"{type(self.mesh).__name__}"
            )
        if self.expert_axis not in self.mesh.axis_names:
            raise ValueError(
                f"MoE: the mesh has no EP axis {self.expert_axis!r} (axes: {self.mesh.axis_names})"
            )
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
        object.__setattr__(
            self,
            "transfer_chunks",
            check_positive_int("MoE", "transfer_chunks", self.transfer_chunks),
        )
        object.__setattr__(self, "mesh", _auto_axes_mesh(self.mesh))
        if self.ep_size > 1:  # with one rank nothing is exchanged (the portable copy)
            comm.check_platform(self.comm_backend, self.mesh)

    @property
    def ep_size(self) -> int:
        """R, devices on the EP axis."""
        return self.mesh.shape[self.expert_axis]

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The mesh axes other than the EP axis."""
        return tuple(a for a in self.mesh.axis_names if a != self.expert_axis)

    def capacity(self, tokens_per_device: int, top_k: int) -> int:
        """C, receive-buffer rows per rank for ``tokens_per_device`` tokens choosing ``top_k``
        experts on each device."""
        pairs = top_k * tokens_per_device
        worst = self.ep_size * pairs
        if self.capacity_factor is None:
            return worst
        return max(1, min(worst, math.ceil(self.capacity_factor * pairs)))

    @property
    def expert_sharding(self) -> NamedSharding:
        """Where expert weights [E, ...] live: split over the EP axis."""
        return NamedSharding(self.mesh, P(self.expert_axis))


def _auto_axes_mesh(mesh: Mesh | AbstractMesh) -> Mesh | AbstractMesh:
    """``mesh`` with every axis in Auto mode (its devices, or its abstract device, kept)."""
    auto = (AxisType.Auto,) * len(mesh.axis_names)
    if isinstance(mesh, Mesh):
        return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)
    return AbstractMesh(
        mesh.axis_sizes, mesh.axis_names, axis_types=auto, abstract_device=mesh.abstract_device
    )


def routed_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    params: tuple[jax.Array, jax.Array, jax.Array],
    ep: ExpertParallel,
) -> tuple[jax.Array, MoEStats]:
    """Routed SwiGLU experts over the mesh, balanced by the plan of this call's exact loads.

    Args:
      x: [B, L, D] tokens (B divisible by the mesh's device count).
      experts: int [B, L, k], each token's experts, in [0, E). Concrete ids (an eager call)
        are checked; traced ids (under `jit`) cannot be without a trip to the host, so there a
        pair whose id is outside [0, E) is skipped: it contributes nothing to y (nor gradients),
        is in no expert's load, and is counted in ``MoEStats.invalid``.
      weights: [B, L, k], each choice's weight (float32 recommended; any router's output). The
        weight of a pair that reaches no expert (an id outside [0, E), or dropped for capacity)
        is selected out, never multiplied by zero: NaN or inf there reaches neither y nor a
        gradient.
      params: (w_gate [E, D, F], w_up [E, D, F], w_down [E, F, D]).
      ep: where and how the experts run.

    Returns:
      y [B, L, D] in x's dtype, ``sum_j weights[..., j] * expert_{experts[..., j]}(x)``, and the
      call's `MoEStats`. Differentiable in x, weights and params.
    """
    _check_inputs(x, experts, weights, params, ep)
    w_gate, w_up, w_down = params
    capacity = ep.capacity(x.shape[0] // ep.mesh.size * x.shape[1], experts.shape[-1])
    _check_int32_sizes(x.shape[0] // ep.mesh.size * x.shape[1] * experts.shape[-1], capacity)
    args = (x, _int32_ids(experts, ep.num_experts), weights, w_gate, w_up, w_down)
    return with_auto_axes(functools.partial(_moe_call, ep, capacity), ep, *args)


def _int32_ids(experts: jax.Array, num_experts: int) -> jax.Array:
    """int32 [...]: ``experts`` (any integer dtype) with every id outside [0, E) made -1 before
    the cast, so that a wide id (int64 under ``jax_enable_x64``, uint32) cannot wrap into a
    valid expert (2**32 + 3 would become 3)."""
    if experts.dtype == jnp.int32:
        return experts
    valid = (experts >= 0) & (experts < num_experts)
    return jnp.where(valid, experts, -1).astype(jnp.int32)


def _check_int32_sizes(pairs: int, capacity: int) -> None:
    """Raises (one line naming the value) unless the pairs on a device and the receive buffer's
    rows fit the int32 indices of `dispatch`."""
    limit = 2**31 - 1
    if pairs > limit:
        raise ValueError(
            f"MoE: {pairs} (token, choice) pairs per device exceed 2**31 - 1 (dispatch indexes "
            "them in int32); split the batch over more devices"
        )
    if capacity > limit:
        raise ValueError(
            f"MoE: a receive buffer of {capacity} rows per device exceeds 2**31 - 1 (dispatch "
            "indexes it in int32); set a capacity_factor or split the batch over more devices"
        )


def check_dtype(name: str, a, want=jnp.floating) -> None:
    """Raises (one line naming the value) unless ``a``'s dtype is of the kind ``want``
    (`jnp.floating`: real floating point; `jnp.integer`)."""
    if not jnp.issubdtype(a.dtype, want):
        kind = "an integer" if want is jnp.integer else "a real floating-point"
        raise TypeError(f"MoE: {name} must have {kind} dtype, got {a.dtype}")


def _check_inputs(x, experts, weights, params, ep) -> None:
    """Raises (one line naming the value) unless `routed_experts` can run on these arguments."""
    if not isinstance(ep, ExpertParallel):
        raise TypeError(f"MoE: ep must be an ExpertParallel, got {type(ep).__name__}")
    if not isinstance(params, (tuple, list)) or len(params) != 3:
        raise ValueError(
            f"MoE: params must be (w_gate, w_up, w_down), got {type(params).__name__}"
            + (f" of {len(params)}" if isinstance(params, (tuple, list)) else "")
        )
    named = {"x": x, "experts": experts, "weights": weights}
    named.update(zip(("w_gate", "w_up", "w_down"), params, strict=True))
    for name, a in named.items():
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(f"MoE: {name} must be an array, got {type(a).__name__}")
        check_dtype(name, a, jnp.integer if name == "experts" else jnp.floating)
    w_gate, w_up, w_down = params
    if x.ndim != 3:
        raise ValueError(f"MoE: x must be [batch, seq, d_model], got shape {tuple(x.shape)}")
    if experts.shape != weights.shape or experts.shape[:2] != x.shape[:2] or experts.ndim != 3:
        raise ValueError(
            f"MoE: experts {tuple(experts.shape)} and weights {tuple(weights.shape)} must both "
            f"be [batch, seq, top_k] for x {tuple(x.shape)}"
        )
    if 0 in x.shape or experts.shape[-1] == 0:
        raise ValueError(
            f"MoE: batch, seq, d_model and top_k must be >= 1, got x {tuple(x.shape)} and "
            f"experts {tuple(experts.shape)}"
        )
    E, D = ep.num_experts, x.shape[-1]
    F = w_gate.shape[-1]
    if (w_gate.shape, w_up.shape, w_down.shape) != ((E, D, F), (E, D, F), (E, F, D)):
        raise ValueError(
            f"MoE: expert weights must be w_gate, w_up [E={E}, D={D}, F] and w_down [E, F, D]; "
            f"got {tuple(w_gate.shape)}, {tuple(w_up.shape)}, {tuple(w_down.shape)}"
        )
    if x.shape[0] % ep.mesh.size:
        raise ValueError(
            f"MoE: batch {x.shape[0]} is not divisible by the {ep.mesh.size} devices "
            f"of the mesh {dict(ep.mesh.shape)}"
        )
    if ep.transfer_chunks > F:
        raise ValueError(
            f"MoE: transfer_chunks={ep.transfer_chunks} exceeds d_ff={F} (a chunk is at least one "
            "hidden column)"
        )
    if not isinstance(experts, jax.core.Tracer):
        e = np.asarray(experts)
        if e.size and (e.min() < 0 or e.max() >= ep.num_experts):
            raise ValueError(
                f"MoE: experts must be in [0, {ep.num_experts}), got {e.min()}..{e.max()}"
            )


def with_auto_axes(fn, ep: ExpertParallel, x, *args):
    """``fn(x, *args)`` -> (y [B, ...], stats); when ``x`` carries explicit sharding types (a
    traced value on a mesh from `jax.make_mesh`), run ``fn`` with those axes in Auto mode and give
    y back split over the batch, the stats replicated."""
    typed_mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if isinstance(x, jax.core.Tracer) and AxisType.Explicit in getattr(
        typed_mesh, "axis_types", ()
    ):
        axes = tuple(ep.mesh.axis_names)
        out = (NamedSharding(typed_mesh, P(axes)), NamedSharding(typed_mesh, P()))
        return jax.sharding.auto_axes(fn, out_sharding=out)(x, *args)
    return fn(x, *args)


def _in_specs(ep: ExpertParallel) -> tuple[P, ...]:
    tokens, experts = P(tuple(ep.mesh.axis_names)), P(ep.expert_axis)
    return (tokens, tokens, tokens, experts, experts, experts)


def place(a, sharding):
    """``a`` on ``sharding``: `jax.device_put` for a concrete array, a sharding constraint for a
    traced one (inside `jit`, `vmap`, ...)."""
    if isinstance(a, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(a, sharding)
    return jax.device_put(a, sharding)


# Jitted so that a call outside `jax.jit` compiles once per shape, not op by op on every call;
# inside a jitted step it is inlined.
@functools.partial(jax.jit, static_argnums=(0, 1))
def _moe_call(ep: ExpertParallel, capacity: int, *args):
    specs = _in_specs(ep)
    args = [place(a, NamedSharding(ep.mesh, s)) for a, s in zip(args, specs, strict=True)]
    shard = functools.partial(_moe_shard, ep=ep, capacity=capacity)
    # The stats are typed invariant over the whole mesh (`_moe_shard`), so they leave as they
    # are: no collective moves them.
    out_specs = (specs[0], P())
    return jax.shard_map(shard, mesh=ep.mesh, in_specs=specs, out_specs=out_specs)(*args)


def _moe_shard(x_BLD, experts_BLK, weights_BLK, w_gate, w_up, w_down, *, ep, capacity):
    """One device's part of `routed_experts`: plan -> dispatch -> experts -> combine -> stats."""
    D, K = x_BLD.shape[-1], experts_BLK.shape[-1]
    tokens_TD = x_BLD.reshape(-1, D)
    experts_N = experts_BLK.reshape(-1)
    axis = ep.expert_axis
    # One rank: nothing to balance, and nothing crosses the network (XLA's ragged all-to-all
    # over one device is slow on GPU; the portable exchange is a copy).
    balancer = ep.balancer if ep.ep_size > 1 else None
    replicas = balancer is not None and balancer.slots_per_rank > 0
    backend = ep.comm_backend if ep.ep_size > 1 else "portable"
    masters = (w_gate, w_up, w_down)

    with jax.named_scope("plan"):
        loads_RE, plan = _plan(experts_N, ep, balancer, capacity)
    with jax.named_scope("dispatch"):
        route = dispatch.plan_dispatch(
            experts_N, loads_RE, plan, jax.lax.axis_index(axis), capacity
        )
        sent_CD = comm.ragged_exchange(
            tokens_TD[route.send_order_N // K], route.exchange, axis_name=axis, backend=backend
        )
    with jax.named_scope("experts"):
        rows_CD = dispatch.to_groups(sent_CD, route)
        if replicas:
            done_CD = streaming.experts_with_replicas(
                rows_CD,
                masters,
                plan.slot_expert,
                route.group_sizes_G,
                kernel=ep.expert_kernel,
                chunks=ep.transfer_chunks,
                max_fanout=balancer.max_fanout,
                axis_name=axis,
                backend=backend,
            )
        else:
            done_CD = local_experts(rows_CD, masters, None, route.group_sizes_G, ep.expert_kernel)
    with jax.named_scope("combine"):
        back_ND = comm.ragged_exchange(
            dispatch.from_groups(done_CD, route),
            route.exchange.reversed(),
            axis_name=axis,
            backend=backend,
        )
        y_TD = dispatch.combine(back_ND, route, weights_BLK.reshape(-1, K))
    send_max = (
        _transfer_send_max(plan, masters, balancer.max_fanout) if replicas else jnp.float32(0)
    )
    stats = _stats(ep, capacity, experts_N, loads_RE, plan, route, send_max)
    return y_TD.astype(x_BLD.dtype).reshape(x_BLD.shape), stats


def _plan(experts_N, ep: ExpertParallel, balancer: BalancerConfig | None, capacity: int):
    """(loads [R, E], plan) of this EP group: the exact loads all-gathered over the EP axis, and
    their plan (every expert on its master without a balancer)."""
    # Typed invariant over the EP axis (every rank of the group holds the same matrix), so that
    # the plan and the stats derived from it are too.
    local_E = expert_loads(experts_N, ep.num_experts)
    loads_RE = jax.lax.all_gather(local_E, ep.expert_axis, to="invarying")
    if balancer is None:
        plan = reroute.masters_only_plan(loads_RE)
    else:
        plan = make_plan(loads_RE, balancer, capacity=capacity)
    # The FFI result carries no sharding type: it is identical across the EP group but differs
    # between data groups, so mark it varying over those.
    return loads_RE, jax.tree.map(lambda a: vary(a, ep.data_axes), plan)


def _transfer_send_max(plan, masters, max_fanout: int) -> jax.Array:
    """float32 []: the most bytes one EP rank sends in the replica transfer of ``plan``."""
    copy_bytes = sum(w[0].size * w.dtype.itemsize for w in masters)
    em = masters[0].shape[0]
    return relay.largest_send_bytes(plan.slot_expert, em, max_fanout, copy_bytes)


def _stats(ep, capacity, experts_N, loads_RE, plan, route, send_max) -> MoEStats:
    """The call's `MoEStats`, typed invariant over the whole mesh."""
    # Pairs of ids outside [0, E) are in no load (`expert_loads`) and sent nowhere (`dispatch`).
    invalid = loads_RE.shape[0] * experts_N.shape[0] - jnp.sum(loads_RE)
    stats = MoEStats.of_group(
        loads_RE, plan, route.dropped, invalid, capacity, route.group_sizes_RG, send_max
    )
    # Invariant over the EP axis (a function of the gathered loads and the plan); summed or
    # maxed over the data groups, then invariant over the whole mesh.
    return jax.tree.map(lambda a: vary(a, ep.data_axes), stats).over_groups(ep.data_axes)
