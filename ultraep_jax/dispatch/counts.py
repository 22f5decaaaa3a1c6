"""Every rank's dispatch counts under one plan: pairs per (source rank, destination rank, local
group), and what each destination's receive buffer keeps.

They are functions of the all-gathered loads and the plan, identical on every rank of an EP group,
so each rank knows every other rank's sizes without exchanging them. Shapes follow the package's
axis legend (`ultraep_jax`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ultraep_jax._ops import exclusive_cumsum
from ultraep_jax.base.layout import Layout
from ultraep_jax.dispatch import reroute
from ultraep_jax.planning.plan_type import Plan


def rank_group_counts(assign_RI: jax.Array, layout: Layout) -> jax.Array:
    """int32 [R(src), R(dst), G]: pairs each source rank sends to each local group of each rank,
    from ``assign_RI`` [R, I] (`reroute.reroute_counts`)."""
    return assign_RI[:, layout.instance_at()]


def kept_counts(counts_RRG: jax.Array, capacity: int) -> jax.Array:
    """int32 [R(src), R(dst), G]: pairs that fit in each destination's ``capacity`` rows.

    A destination stores sources in rank order and each source's rows by local group; rows past
    ``capacity`` are dropped (so the drop is deterministic and every rank agrees on it).
    """
    per_source_RR = jnp.sum(counts_RRG, axis=-1)
    start_RRG = exclusive_cumsum(per_source_RR, 0)[..., None] + exclusive_cumsum(counts_RRG, -1)
    return jnp.clip(capacity - start_RRG, 0, counts_RRG)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupCounts:
    """Every rank's dispatch counts under one plan, identical on every rank of the EP group.

    Attributes:
      assign_RI: int32 [R, I], pairs each source rank sends to each instance
        (`reroute.reroute_counts`).
      routed_RRG: int32 [R(src), R(dst), G], pairs each source sends to each local group of each
        rank (`rank_group_counts`).
      kept_RRG: int32 [R(src), R(dst), G], those that fit in the destination's receive buffer
        (`kept_counts`).
    """

    assign_RI: jax.Array
    routed_RRG: jax.Array
    kept_RRG: jax.Array

    @property
    def group_sizes_RG(self) -> jax.Array:
        """int32 [R, G]: rows each rank receives for each of its local groups (masters, then
        slots): what each rank's experts run on."""
        return jnp.sum(self.kept_RRG, axis=0)


def group_counts(loads_RE: jax.Array, plan: Plan, capacity: int) -> GroupCounts:
    """The `GroupCounts` of ``plan`` (``slot_expert`` [R, S]; S may be 0) for the all-gathered
    ``loads_RE`` [R, E] it was made from, with ``capacity`` receive-buffer rows per rank."""
    assign_RI = reroute.reroute_counts(loads_RE, plan)
    routed_RRG = rank_group_counts(assign_RI, Layout.of(loads_RE, plan.slot_expert))
    return GroupCounts(assign_RI, routed_RRG, kept_counts(routed_RRG, capacity))
