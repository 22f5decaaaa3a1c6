"""The balanced expert-parallel MoE layer (Flax NNX).

Per step, inside one `jax.shard_map` over the mesh (batch split over every mesh axis, experts over
the EP axis): route -> exact loads of this microbatch, all-gathered over the EP axis -> plan (the
FFI custom call) -> reroute counts -> fetch replica weights -> dispatch rows -> grouped SwiGLU
experts -> send results back -> weighted combine. Each index of the other mesh axes ("data") is an
independent EP group with its own plan.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ultraep_jax import comm, dispatch, reroute, transfer
from ultraep_jax._vma import vary
from ultraep_jax.config import BalancerConfig
from ultraep_jax.experts import KERNELS, local_experts
from ultraep_jax.planner import plan as make_plan
from ultraep_jax.routing import expert_loads, route
from ultraep_jax.stats import imbalance


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEStats:
    """What balancing did in one call of the layer.

    Attributes:
      expert_load: int32 [E], (token, choice) pairs routed to each expert.
      rank_load_before: int32 [R], (token, choice) pairs routed to each EP rank's master experts.
      rank_load_after: int32 [R], pairs each EP rank is planned to process after balancing
        (equal to ``rank_load_before`` without a balancer; pairs dropped for capacity included).
      dropped: int32 [], pairs that did not fit in their destination's receive buffer; they
        contribute nothing to the output.
      replicas: int32 [], replica instances used.
      over_capacity: int32 [], EP groups whose plan could not keep every rank within the receive
        buffer (their excess pairs are dropped and counted in ``dropped``).
      imbalance_before, imbalance_after: float32 [], max / mean of the rank loads.

    With other mesh axes beside the EP axis, each of their indices is an independent EP group:
    loads, ``dropped``, ``replicas`` and ``over_capacity`` are summed over the groups, and the imbalances are the
    worst group's.
    """

    expert_load: jax.Array
    rank_load_before: jax.Array
    rank_load_after: jax.Array
    dropped: jax.Array
    replicas: jax.Array
    over_capacity: jax.Array
    imbalance_before: jax.Array
    imbalance_after: jax.Array


def _place(a, sharding):
    """Puts ``a`` on ``sharding``, which `shard_map` requires of its inputs."""
    if isinstance(a, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(a, sharding)
    return jax.device_put(a, sharding)


def _moe_shard(
    x,
    router_kernel,
    w_gate,
    w_up,
    w_down,
    *,
    num_experts,
    top_k,
    balancer,
    capacity,
    expert_axis,
    data_axes,
    backend,
    expert_kernel,
):
    """The layer on one device: x [b, s, D], w_* [E_m, ...] -> (y [b, s, D], stats)."""
    b, s, D = x.shape
    tokens = x.reshape(b * s, D)
    N = b * s * top_k
    R = jax.lax.axis_size(expert_axis)
    if R == 1:
        # One rank: nothing to balance, and nothing crosses the network (XLA's ragged
        # all-to-all over one device is slow on GPU, the portable exchange is a copy).
        balancer, backend = None, "portable"
    E, S = num_experts, (balancer.slots_per_rank if balancer is not None else 0)
    em, G = E // R, E // R + S
    me = jax.lax.axis_index(expert_axis)
    all_axes = data_axes + (expert_axis,)

    experts, weights = route(tokens, router_kernel, top_k)  # [T, k]
    loads = jax.lax.all_gather(expert_loads(experts, E), expert_axis)  # [R, E]
    # The plan is identical across the EP group; the FFI result carries no sharding type, so
    # mark it as per-device (it differs between data groups).
    if balancer is not None:
        plan = make_plan(loads, balancer, capacity=capacity)
    else:
        plan = reroute.masters_only_plan(loads)
    plan = jax.tree.map(lambda a: vary(a, all_axes), plan)

    assign = reroute.reroute_counts(loads, plan)  # [R, I]
    counts = dispatch.rank_group_counts(assign, E, S)  # [src, dst, G]
    kept = dispatch.kept_counts(counts, capacity)
    sent = jnp.sum(counts, axis=-1)  # [src, dst]
    kept_sent = jnp.sum(kept, axis=-1)
    recv_start = jnp.cumsum(sent, axis=0) - sent  # where src's block starts at dst
    send_start = jnp.cumsum(sent, axis=1) - sent  # where src's block for dst starts at src

    # Send side: pairs sorted by (destination rank, local group).
    inst = dispatch.pair_instances(experts.reshape(-1), assign[me], reroute.instance_experts(plan))
    dest_rank = reroute.instance_ranks(E, R, S)[inst]
    order = dispatch.send_order(dest_rank, reroute.instance_groups(E, R, S)[inst], G)
    chunk = min(N, capacity)
    to_peer = kept_sent[me] > 0
    buffer = comm.ragged_exchange(
        tokens[order // top_k],
        jnp.zeros((capacity, D), x.dtype),
        jnp.where(to_peer, send_start[me], 0),
        kept_sent[me],
        jnp.where(to_peer, recv_start[me], 0),
        kept_sent[:, me],
        axis_name=expert_axis,
        max_chunk=chunk,
        backend=backend,
    )

    # Receive side: regroup rows by local group (masters, then slots) and run the experts.
    kept_in = kept[:, me, :]  # [src, G]
    position = dispatch.group_major_positions(kept_in, capacity)
    rows = jnp.zeros_like(buffer).at[position].set(buffer, mode="drop", unique_indices=True)
    masters = (w_gate, w_up, w_down)
    replicas = None
    if S > 0:
        replicas = transfer.fetch_replica_experts(
            masters, plan.slot_expert, axis_name=expert_axis, backend=backend
        )
    out = local_experts(rows, masters, replicas, jnp.sum(kept_in, axis=0), expert_kernel)
    out = jnp.where((position < capacity)[:, None], out[jnp.clip(position, 0, capacity - 1)], 0)

    # Back to the sources, then the weighted combine.
    from_peer = kept_sent[:, me] > 0
    back = comm.ragged_exchange(
        out,
        jnp.zeros((N, D), out.dtype),
        jnp.where(from_peer, recv_start[:, me], 0),
        kept_sent[:, me],
        jnp.where(from_peer, send_start[:, me], 0),
        kept_sent[me],
        axis_name=expert_axis,
        max_chunk=chunk,
        backend=backend,
    )
    pair_out = jnp.zeros_like(back).at[order].set(back, unique_indices=True)
    y = jnp.einsum("tk,tkd->td", weights, pair_out.reshape(-1, top_k, D).astype(jnp.float32))

    load_e = jnp.sum(loads, axis=0)
    before = jnp.sum(load_e.reshape(R, em), axis=1)
    stats = MoEStats(
        expert_load=load_e,
        rank_load_before=before,
        rank_load_after=plan.rank_load,
        dropped=jnp.sum(counts) - jnp.sum(kept),
        replicas=plan.num_replicas if S > 0 else jnp.int32(0),
        over_capacity=(jnp.max(plan.rank_load) > capacity).astype(jnp.int32),
        imbalance_before=imbalance(before),
        imbalance_after=imbalance(plan.rank_load),
    )
    stats = jax.tree.map(lambda a: vary(a, all_axes), stats)
    if data_axes:
        stats = dataclasses.replace(
            stats,
            **{
                f: jax.lax.psum(getattr(stats, f), data_axes)
                for f in (
                    "expert_load",
                    "rank_load_before",
                    "rank_load_after",
                    "dropped",
                    "replicas",
                    "over_capacity",
                )
            },
            **{
                f: jax.lax.pmax(getattr(stats, f), data_axes)
                for f in ("imbalance_before", "imbalance_after")
            },
        )
    # Stats are identical across the EP group: every rank returns its copy on a leading axis.
    stats = jax.tree.map(lambda a: a[None], stats)
    return y.astype(x.dtype).reshape(b, s, D), stats


class MoE(nnx.Module):
    """A top-k MoE layer of SwiGLU experts, expert-parallel over ``mesh``, optionally balanced.

    Args:
      d_model: D, the token width.
      d_ff: F, each expert's hidden width.
      num_experts: E; must be divisible by the size of the EP axis.
      top_k: experts per token, 1 <= top_k <= E.
      mesh: the device mesh; it must have the EP axis. The batch is split over every mesh axis;
        the indices of the other axes are independent EP groups (data parallelism).
      balancer: a `BalancerConfig` (its ``num_experts`` and ``ep_size`` must match), or None for
        plain expert parallelism.
      capacity_factor: receive-buffer rows per rank, as a multiple of the pairs a rank routes
        (``top_k * tokens per device``); pairs beyond it are dropped and counted. None sizes the
        buffer for the worst case (every pair to one rank) so that nothing is ever dropped.
      expert_axis: the name of the EP mesh axis.
      comm_backend: "auto" (fixed-size collectives on CPU, `ragged_all_to_all` elsewhere),
        "portable" or "ragged"; see `comm.ragged_exchange` and `transfer.fetch_replica_experts`.
        With one rank on the EP axis nothing is exchanged.
      expert_kernel: the experts' implementation, one of `experts.KERNELS`: "auto" (on CUDA
        JAX's Mosaic GPU kernels on Hopper where the shapes suit them, else the Pallas/Triton
        kernel of `ultraep_jax.gmm`; elsewhere the tiled loop of `ultraep_jax.tiled_experts`),
        "tiled", "ragged_dot", "pallas" or "mgpu".
      param_dtype: dtype of the parameters.
      rngs: initialisation randomness.

    Parameters: ``router_kernel`` [D, E] (replicated); ``w_gate``, ``w_up`` [E, D, F] and
    ``w_down`` [E, F, D], split over the EP axis.

    Calling it on x [batch, seq, D] returns ``(y, stats)``: y [batch, seq, D] and a `MoEStats`.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        top_k: int,
        mesh: Mesh,
        balancer: BalancerConfig | None = None,
        capacity_factor: float | None = 1.25,
        *,
        expert_axis: str = "expert",
        comm_backend: str = "auto",
        expert_kernel: str = "auto",
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        for name, value in (
            ("d_model", d_model),
            ("d_ff", d_ff),
            ("num_experts", num_experts),
            ("top_k", top_k),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoE: {name} must be a positive int, got {value!r}")
        if not isinstance(mesh, Mesh):
            raise TypeError(f"MoE: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        if expert_axis not in mesh.axis_names:
            raise ValueError(
                f"MoE: the mesh has no EP axis {expert_axis!r} (axes: {mesh.axis_names})"
            )
        ep_size = mesh.shape[expert_axis]
        if num_experts % ep_size:
            raise ValueError(
                f"MoE: num_experts={num_experts} is not divisible by the EP size "
                f"{ep_size} (mesh axis {expert_axis!r})"
            )
        if top_k > num_experts:
            raise ValueError(f"MoE: top_k={top_k} exceeds num_experts={num_experts}")
        if balancer is not None:
            if not isinstance(balancer, BalancerConfig):
                raise TypeError(
                    f"MoE: balancer must be a BalancerConfig or None, got {type(balancer).__name__}"
                )
            if (balancer.num_experts, balancer.ep_size) != (num_experts, ep_size):
                raise ValueError(
                    f"MoE: balancer is for {balancer.num_experts} experts on {balancer.ep_size} "
                    f"ranks, but the layer has {num_experts} experts on {ep_size} ranks"
                )
        if capacity_factor is not None and not (
            isinstance(capacity_factor, (int, float)) and capacity_factor > 0
        ):
            raise ValueError(f"MoE: capacity_factor must be > 0 or None, got {capacity_factor!r}")
        if comm_backend not in comm.BACKENDS:
            raise ValueError(
                f"MoE: comm_backend must be one of {comm.BACKENDS}, got {comm_backend!r}"
            )
        if expert_kernel not in KERNELS:
            raise ValueError(f"MoE: expert_kernel must be one of {KERNELS}, got {expert_kernel!r}")
        self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, num_experts, top_k
        # Parameters and inputs live on the mesh with Auto axes: shard_map does the splitting,
        # and users can assign to parameters without explicit-sharding rules getting in the way.
        mesh = Mesh(
            mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names)
        )
        self.mesh, self.balancer, self.capacity_factor = mesh, balancer, capacity_factor
        self.expert_axis, self.comm_backend = expert_axis, comm_backend
        self.expert_kernel = expert_kernel

        init = jax.nn.initializers.normal
        experts = NamedSharding(mesh, P(expert_axis))
        replicated = NamedSharding(mesh, P())
        self.router_kernel = nnx.Param(
            jax.device_put(
                init(d_model**-0.5)(rngs.params(), (d_model, num_experts), param_dtype), replicated
            )
        )
        self.w_gate = nnx.Param(
            jax.device_put(
                init(d_model**-0.5)(rngs.params(), (num_experts, d_model, d_ff), param_dtype),
                experts,
            )
        )
        self.w_up = nnx.Param(
            jax.device_put(
                init(d_model**-0.5)(rngs.params(), (num_experts, d_model, d_ff), param_dtype),
                experts,
            )
        )
        self.w_down = nnx.Param(
            jax.device_put(
                init(d_ff**-0.5)(rngs.params(), (num_experts, d_ff, d_model), param_dtype), experts
            )
        )

    def capacity(self, tokens_per_device: int) -> int:
        """Receive-buffer rows per rank for ``tokens_per_device`` tokens on each device."""
        pairs = self.top_k * tokens_per_device
        worst = self.mesh.shape[self.expert_axis] * pairs
        if self.capacity_factor is None:
            return worst
        return max(1, min(worst, math.ceil(self.capacity_factor * pairs)))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEStats]:
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"MoE: x must be [batch, seq, d_model={self.d_model}], got shape {tuple(x.shape)}"
            )
        devices = self.mesh.size
        if x.shape[0] % devices:
            raise ValueError(
                f"MoE: batch {x.shape[0]} is not divisible by the {devices} devices "
                f"of the mesh {dict(self.mesh.shape)}"
            )
        typed_mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if isinstance(x, jax.core.Tracer) and AxisType.Explicit in getattr(
            typed_mesh, "axis_types", ()
        ):
            # x carries explicit sharding types (a mesh from jax.make_mesh): run the layer with
            # those axes in Auto mode and give y back split over the batch, stats replicated.
            axes = tuple(self.mesh.axis_names)
            out = (NamedSharding(typed_mesh, P(axes)), NamedSharding(typed_mesh, P()))
            y, stats = jax.sharding.auto_axes(self._apply, out_sharding=out)(x)
            return y, stats
        return self._apply(x)

    def _apply(self, x: jax.Array) -> tuple[jax.Array, MoEStats]:
        axes = tuple(self.mesh.axis_names)
        tokens_per_device = x.shape[0] // self.mesh.size * x.shape[1]
        spec = _ShardSpec(
            mesh=self.mesh,
            num_experts=self.num_experts,
            top_k=self.top_k,
            balancer=self.balancer,
            capacity=self.capacity(tokens_per_device),
            expert_axis=self.expert_axis,
            data_axes=tuple(a for a in axes if a != self.expert_axis),
            backend=self.comm_backend,
            expert_kernel=self.expert_kernel,
        )
        params = (self.router_kernel[...], self.w_gate[...], self.w_up[...], self.w_down[...])
        args = [_place(a, NamedSharding(self.mesh, s)) for a, s in zip((x, *params), spec.in_specs)]
        return _moe_call(spec, *args)


@dataclasses.dataclass(frozen=True)
class _ShardSpec:
    """Everything static about one call of the layer (hashable: a jit static argument)."""

    mesh: Mesh
    num_experts: int
    top_k: int
    balancer: BalancerConfig | None
    capacity: int
    expert_axis: str
    data_axes: tuple[str, ...]
    backend: str
    expert_kernel: str

    @property
    def in_specs(self):
        ea = self.expert_axis
        return (P(tuple(self.mesh.axis_names)), P(), P(ea), P(ea), P(ea))


# Jitted so that the layer called outside `jax.jit` compiles once per shape, not op by op on
# every call; inside a jitted step it is inlined.
@functools.partial(jax.jit, static_argnums=0)
def _moe_call(spec: _ShardSpec, x, router_kernel, w_gate, w_up, w_down):
    kw = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "mesh"}
    shard = functools.partial(_moe_shard, **kw)
    out_specs = (P(tuple(spec.mesh.axis_names)), P(spec.expert_axis))
    y, stats = jax.shard_map(shard, mesh=spec.mesh, in_specs=spec.in_specs, out_specs=out_specs)(
        x, router_kernel, w_gate, w_up, w_down
    )
    return y, jax.tree.map(lambda a: a[0], stats)
