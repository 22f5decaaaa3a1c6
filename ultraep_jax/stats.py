"""Load statistics, and `MoEStats`: what balancing did in one call of the layer."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ultraep_jax.base.layout import Layout


def imbalance(rank_load) -> jax.Array:
    """max / mean over the last axis of per-rank loads ``[..., R]``; 1.0 where the total is 0."""
    load = jnp.asarray(rank_load, jnp.float32)
    mean = jnp.mean(load, axis=-1)
    return jnp.where(mean > 0, jnp.max(load, axis=-1) / jnp.where(mean > 0, mean, 1.0), 1.0)


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
      invalid: int32 [], pairs of unmasked tokens whose expert id is outside [0, E) (possible
        only under `jit`, where `routed_experts` cannot check traced ids): they are sent nowhere,
        contribute nothing to the output, and are counted in no other stat.
      masked: int32 [], tokens whose ``token_mask`` is False: routed nowhere, in no load, plan,
        capacity or other stat, and 0 in the output.
      replicas: int32 [], replica instances used.
      over_capacity: int32 [], EP groups whose plan could not keep every rank within the receive
        buffer (their excess pairs are dropped and counted in ``dropped``).
      imbalance_before, imbalance_after: float32 [], max / mean of the rank loads.
      aux_loss, z_loss: float32 [], the router's load-balancing and z losses (`routers.Routing`)
        when the stats come from `MoE`; 0 from `routed_experts`, which sees no router.
      group_rows: int32 [R, G], rows each EP rank received for each of its local groups (E_m
        masters, then S replica slots; G = E_m without a balancer): the group sizes its experts
        ran on, all-gathered over the EP axis.
      transfer_send_max: float32 [], the most bytes one EP rank sends in the replica weight transfer
        under the relay schedule (`replicas.relay`, ``BalancerConfig.max_fanout`` and
        ``ranks_per_domain``; the portable exchange moves every copy in one hop instead, so on it
        this is what the relay schedule would send): copies times the bytes of one expert's
        w_gate, w_up and w_down (float32, so exact below 2**24 bytes); the gradients return the
        same bytes in backward. 0 without replicas. Computed from the plan, not measured.

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
    masked: jax.Array
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
        "masked",
        "replicas",
        "over_capacity",
        "group_rows",
    )

    @classmethod
    def of_group(
        cls, loads_RE, plan, dropped, invalid, masked, capacity: int, group_rows_RG, send_max
    ) -> MoEStats:
        """The stats of one EP group from its all-gathered loads [R, E], plan, drops, pairs of
        no expert, masked tokens, rows received per rank and local group [R, G] and the
        transfer's largest per-rank send in bytes."""
        load_E = jnp.sum(loads_RE, axis=0)
        before_R = Layout.of(loads_RE).master_loads(load_E)
        return cls(
            expert_load=load_E,
            rank_load_before=before_R,
            rank_load_after=plan.rank_load,
            dropped=dropped,
            invalid=invalid,
            masked=masked,
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
        """Aggregated over the EP groups along ``data_axes`` (the token axes other than the EP
        axis): counts summed, imbalances maxed (inside `shard_map`; identity without them)."""
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
