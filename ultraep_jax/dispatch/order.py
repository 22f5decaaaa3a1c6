"""This rank's dispatch: which instance each (token, choice) pair goes to, the order rows travel
in, and every size and offset of the token all-to-all (`Dispatch`).

Shapes follow the package's axis legend (`ultraep_jax`): R ranks, E experts, E_m = E / R masters
per rank, S slots per rank, G = E_m + S local groups per rank, I = E + R*S instances
(`base.layout`), N = T * k pairs on this rank, C receive-buffer rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ultraep_jax._ops import exclusive_cumsum
from ultraep_jax.base.layout import Layout
from ultraep_jax.comm.exchange import Exchange
from ultraep_jax.dispatch.counts import group_counts
from ultraep_jax.planning.plan_type import Plan


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dispatch:
    """Where this rank's pairs go and how received rows are laid out, for one layer call.

    Attributes:
      send_order_N: int32 [N], pair indices sorted by (destination rank, local group).
      exchange: the token all-to-all (`comm.exchange.Exchange`; ``.reversed()`` brings results
        back).
      group_row_C: int32 [C], for each receive-buffer row its row once grouped by local group;
        C (out of range) for unused rows.
      group_sizes_G: int32 [G], rows received for each local group (masters, then slots).
      group_sizes_RG: int32 [R, G], the same for every rank of the EP group (identical on every
        rank: a function of the gathered loads and the plan, so no collective is needed).
      dropped: int32 [], pairs of the whole EP group that did not fit in their receive buffer.
    """

    send_order_N: jax.Array
    exchange: Exchange
    group_row_C: jax.Array
    group_sizes_G: jax.Array
    group_sizes_RG: jax.Array
    dropped: jax.Array


def pair_instances(
    experts_N: jax.Array, assign_I: jax.Array, inst_expert_I: jax.Array
) -> jax.Array:
    """int32 [N]: the instance each of this rank's pairs goes to.

    The j-th pair (in pair order) routed to expert e goes to e's instance whose slice of this
    rank's counts, laid out expert by expert in instance order, contains position j. Pairs of
    expert E (no expert: not in the counts) get I (no instance).

    Args:
      experts_N: int32 [N], the expert of each pair, in [0, E].
      assign_I: int32 [I], this rank's row of `reroute.reroute_counts`.
      inst_expert_I: int32 [I], each instance's expert (-1 for an empty slot).
    """
    I = inst_expert_I.shape[0]
    N = experts_N.shape[0]
    idx = jnp.arange(I, dtype=jnp.int32)
    # Instances expert-major (instance order within an expert); empty slots last.
    # int32 whatever the default integer (argsort gives int64 under jax_enable_x64).
    inst_order = jnp.argsort(jnp.where(inst_expert_I >= 0, inst_expert_I, I) * I + idx).astype(
        jnp.int32
    )
    bounds = jnp.cumsum(assign_I[inst_order])  # inclusive ends in expert-major order
    pair_order = jnp.argsort(experts_N, stable=True)  # pairs expert-major
    slot = jnp.searchsorted(bounds, jnp.arange(N, dtype=jnp.int32), side="right")
    inst_sorted = jnp.append(inst_order, I)[slot]  # I past the counted pairs (expert E, last)
    return jnp.zeros((N,), jnp.int32).at[pair_order].set(inst_sorted, unique_indices=True)


def send_order(dest_rank_N: jax.Array, dest_group_N: jax.Array, num_groups: int) -> jax.Array:
    """int32 [N]: pairs sorted by (destination rank, local group, pair index)."""
    return jnp.argsort(dest_rank_N * num_groups + dest_group_N, stable=True).astype(jnp.int32)


def group_major_positions(kept_in_RG: jax.Array, capacity: int) -> jax.Array:
    """int32 [C]: for each row of this rank's receive buffer (sources in rank order, each by
    local group), its row once grouped by local group (groups in order, sources within);
    ``capacity`` (out of range) for unused rows.

    ``kept_in_RG``: int32 [R(src), G], rows this rank received from each source for each group.
    """
    R, G = kept_in_RG.shape
    source_major_start = exclusive_cumsum(kept_in_RG.reshape(-1), 0)  # blocks (src, g)
    group_total_G = jnp.sum(kept_in_RG, axis=0)
    group_major_start = (
        exclusive_cumsum(group_total_G, 0)[None, :] + exclusive_cumsum(kept_in_RG, 0)
    ).reshape(-1)
    rows = jnp.arange(capacity, dtype=jnp.int32)
    ends = source_major_start + kept_in_RG.reshape(-1)
    block = jnp.clip(jnp.searchsorted(ends, rows, side="right"), 0, R * G - 1)
    pos = group_major_start[block] + rows - source_major_start[block]
    return jnp.where(rows < jnp.sum(kept_in_RG), pos, capacity).astype(jnp.int32)


def plan_dispatch(
    experts_N: jax.Array, loads_RE: jax.Array, plan: Plan, rank: jax.Array, capacity: int
) -> Dispatch:
    """The `Dispatch` of this rank's pairs under ``plan``.

    Args:
      experts_N: int32 [N], the expert of each of this rank's pairs as `planning.loads.pair_experts`
        gives it (the id rule applied once, by the caller): E for a pair of no expert, which is
        sent nowhere, sorted after every sent block.
      loads_RE: int32 [R, E], the all-gathered loads the plan was made from.
      plan: the plan (``slot_expert`` [R, S]; S may be 0).
      rank: int32 [], this rank's index on the EP axis.
      capacity: C, receive-buffer rows per rank.
    """
    layout = Layout.of(loads_RE, plan.slot_expert)
    R = loads_RE.shape[0]
    N = experts_N.shape[0]
    counts = group_counts(loads_RE, plan, capacity)
    sizes_RR = jnp.sum(counts.kept_RRG, axis=-1)
    # Offsets count every routed pair: senders lay out all their pairs and send the kept prefix
    # of each block; a destination drops only past its last kept row, so every block with kept
    # rows starts at the same place whether dropped pairs are counted or not.
    sent_RR = jnp.sum(counts.routed_RRG, axis=-1)
    exchange = Exchange(
        sizes_RR=sizes_RR,
        src_start_RR=exclusive_cumsum(sent_RR, 1),
        dst_start_RR=exclusive_cumsum(sent_RR, 0),
        rank=rank,
        send_rows=N,
        recv_rows=capacity,
        max_chunk=min(N, capacity),
    )
    inst_N = pair_instances(
        experts_N, counts.assign_RI[rank], layout.instance_experts(plan.slot_expert)
    )
    # Instance I (none) is on rank R: after every rank's block, so never sent.
    order_N = send_order(
        jnp.append(layout.instance_ranks(), R)[inst_N],
        jnp.append(layout.instance_groups(), 0)[inst_N],
        layout.num_groups,
    )
    return Dispatch(
        send_order_N=order_N,
        exchange=exchange,
        group_row_C=group_major_positions(counts.kept_RRG[:, rank, :], capacity),
        group_sizes_G=counts.group_sizes_RG[rank],
        group_sizes_RG=counts.group_sizes_RG,
        dropped=jnp.sum(counts.routed_RRG) - jnp.sum(counts.kept_RRG),
    )
