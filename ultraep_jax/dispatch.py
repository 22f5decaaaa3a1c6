"""Dispatch arithmetic: which (token, choice) pair goes to which instance, the order rows travel
in, every all-to-all size and offset, and what the receive capacity keeps.

Everything here is a function of the all-gathered counts, identical on every rank of an EP group,
so each rank knows every other rank's sizes and offsets without exchanging them.

Shapes: R ranks, E experts, E_m = E / R masters per rank, S slots per rank, G = E_m + S local
groups per rank, I = E + R*S instances, N = T * k pairs on this rank, C receive-buffer rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _exclusive_cumsum(x, axis):
    return jnp.cumsum(x, axis=axis) - x


def instance_index(num_experts: int, ep_size: int, slots_per_rank: int) -> np.ndarray:
    """int [R, G]: the instance at each (rank, local group): masters, then slots (static)."""
    em = num_experts // ep_size
    ranks = np.arange(ep_size)[:, None]
    masters = ranks * em + np.arange(em)[None, :]
    slots = num_experts + ranks * slots_per_rank + np.arange(slots_per_rank)[None, :]
    return np.concatenate([masters, slots], axis=1)


def rank_group_counts(assign: jax.Array, num_experts: int, slots_per_rank: int) -> jax.Array:
    """int32 [R(src), R(dst), G]: pairs source rank sends to each local group of each rank.

    ``assign``: [R, I] from `reroute.reroute_counts`.
    """
    R = assign.shape[0]
    return assign[:, instance_index(num_experts, R, slots_per_rank)]


def kept_counts(counts: jax.Array, capacity: int) -> jax.Array:
    """int32 [R(src), R(dst), G]: pairs that fit in each destination's ``capacity`` rows.

    A destination stores sources in rank order and each source's rows by local group; rows past
    ``capacity`` are dropped (so the drop is deterministic and every rank agrees on it).
    """
    per_source = jnp.sum(counts, axis=-1)  # [src, dst]
    start = _exclusive_cumsum(per_source, 0)[..., None] + _exclusive_cumsum(counts, -1)
    return jnp.clip(capacity - start, 0, counts)


def pair_instances(experts: jax.Array, assign_row: jax.Array, inst_expert: jax.Array) -> jax.Array:
    """int32 [N]: the instance each of this rank's pairs goes to.

    The j-th pair (in pair order) routed to expert e goes to e's instance whose slice of this
    rank's counts, laid out expert by expert in instance order, contains position j.

    Args:
      experts: int32 [N], the expert of each pair.
      assign_row: int32 [I], this rank's row of `reroute.reroute_counts`.
      inst_expert: int32 [I], each instance's expert (-1 for an empty slot).
    """
    I = inst_expert.shape[0]
    N = experts.shape[0]
    idx = jnp.arange(I, dtype=jnp.int32)
    # Instances expert-major (instance order within an expert); empty slots last.
    inst_order = jnp.argsort(jnp.where(inst_expert >= 0, inst_expert, I) * I + idx)
    bounds = jnp.cumsum(assign_row[inst_order])  # [I], inclusive ends in expert-major order
    pair_order = jnp.argsort(experts, stable=True)  # pairs expert-major
    slot = jnp.searchsorted(bounds, jnp.arange(N, dtype=jnp.int32), side="right")
    inst_sorted = inst_order[jnp.clip(slot, 0, I - 1)]
    return jnp.zeros((N,), jnp.int32).at[pair_order].set(inst_sorted, unique_indices=True)


def send_order(dest_rank: jax.Array, dest_group: jax.Array, num_groups: int) -> jax.Array:
    """int32 [N]: pairs sorted by (destination rank, local group, pair index)."""
    return jnp.argsort(dest_rank * num_groups + dest_group, stable=True).astype(jnp.int32)


def sent_mask(dest_rank_sorted: jax.Array, counts_row: jax.Array, kept_row: jax.Array):
    """bool [N]: which pairs, in send order, fit at their destination.

    Args:
      dest_rank_sorted: int32 [N], destination of each pair in send order.
      counts_row: int32 [R(dst)], this rank's pairs per destination.
      kept_row: int32 [R(dst)], how many of them fit (a prefix of each destination's block).
    """
    start = _exclusive_cumsum(counts_row, 0)
    position = jnp.arange(dest_rank_sorted.shape[0], dtype=jnp.int32) - start[dest_rank_sorted]
    return position < kept_row[dest_rank_sorted]


def group_major_positions(kept_in: jax.Array, capacity: int) -> jax.Array:
    """int32 [C]: for each row of this rank's receive buffer (sources in rank order, each by
    local group), its row once grouped by local group (groups in order, sources within);
    ``capacity`` (out of range) for unused rows.

    ``kept_in``: int32 [R(src), G], rows this rank received from each source for each group.
    """
    R, G = kept_in.shape
    source_major_start = _exclusive_cumsum(kept_in.reshape(-1), 0)  # blocks (src, g)
    group_total = jnp.sum(kept_in, axis=0)
    group_major_start = (
        _exclusive_cumsum(group_total, 0)[None, :] + _exclusive_cumsum(kept_in, 0)
    ).reshape(-1)
    rows = jnp.arange(capacity, dtype=jnp.int32)
    ends = source_major_start + kept_in.reshape(-1)
    block = jnp.clip(jnp.searchsorted(ends, rows, side="right"), 0, R * G - 1)
    pos = group_major_start[block] + rows - source_major_start[block]
    return jnp.where(rows < jnp.sum(kept_in), pos, capacity).astype(jnp.int32)
