"""Replica expert weights: each spare slot receives its expert's weights from the master's rank.

The transfer is linear in the master weights, so its transpose (the backward pass) sends each
replica's weight gradient back and adds it into the master's gradient: no custom VJP needed.
Nothing here waits on the masters' own matmuls, so XLA is free to overlap the transfer with them.

Two implementations behind `fetch_replica_experts`: a dense one (a row selection and a
reduce-scatter of ``R * S`` rows, cheaper on XLA:CPU than an all-to-all) and
a ragged one (`jax.lax.ragged_all_to_all`, which moves only the filled slots; GPU/TPU).

Shapes: R ranks, S slots per rank, E_m master experts per rank, P weights per expert.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ultraep_jax import comm


def slot_owners(slot_expert: jax.Array, experts_per_rank: int) -> jax.Array:
    """int32 [R, S]: the master rank of each slot's expert; R for an empty slot."""
    R = slot_expert.shape[0]
    return jnp.where(slot_expert >= 0, slot_expert // experts_per_rank, R).astype(jnp.int32)


def _fetch_ragged(master_weights: jax.Array, slot_expert: jax.Array, axis_name: str) -> jax.Array:
    """[S, P] by one ragged exchange that moves only the filled slots (zeros for empty slots).

    Args:
      master_weights: [E_m, P], this rank's master experts, flattened.
      slot_expert: int32 [R, S], the plan's slots (identical on every rank of the EP group).
      axis_name: the EP mesh axis.
    """
    em = master_weights.shape[0]
    R, S = slot_expert.shape
    me = jax.lax.axis_index(axis_name)
    owner = slot_owners(slot_expert, em)  # [R, S]
    slot = jnp.arange(S, dtype=jnp.int32)

    # Sender: for each destination t, the slots of t that hold one of my masters, in slot order,
    # first in t's block of S rows.
    mine = owner == me
    order = jnp.argsort(jnp.where(mine, 0, S) + slot[None, :], axis=1)  # [R, S]
    local = jnp.clip(slot_expert, 0, None) % em
    operand = master_weights[jnp.take_along_axis(local, order, axis=1).reshape(-1)]  # [R*S, P]
    send_sizes = jnp.sum(mine, axis=1, dtype=jnp.int32)
    input_offsets = jnp.arange(R, dtype=jnp.int32) * S
    # Receiver t keeps its slots ordered by (owner, slot): my block starts after lower owners'.
    output_offsets = jnp.sum(owner < me, axis=1, dtype=jnp.int32)

    my_owner = owner[me]  # [S]
    recv_sizes = jnp.sum(my_owner[None, :] == jnp.arange(R)[:, None], axis=1, dtype=jnp.int32)
    received = comm.ragged_exchange(
        operand,
        jnp.zeros((S,) + master_weights.shape[1:], master_weights.dtype),
        input_offsets,
        send_sizes,
        output_offsets,
        recv_sizes,
        axis_name=axis_name,
        max_chunk=S,
        backend="ragged",
    )
    # Back to slot order: slot s sits at its rank among (owner, slot) pairs.
    key = my_owner * S + slot
    position = jnp.sum(key[None, :] < key[:, None], axis=1)
    return received[position]


def _fetch_dense(master_weights: jax.Array, slot_expert: jax.Array, axis_name: str) -> jax.Array:
    """[S, P] by a dense exchange: every rank sends each peer one row per slot of that peer (its
    master's weights if it owns the slot's expert, else zeros) and each slot sums what it got."""
    em = master_weights.shape[0]
    me = jax.lax.axis_index(axis_name)
    mine = (slot_owners(slot_expert, em) == me).reshape(-1)  # [R * S]
    local = (jnp.clip(slot_expert, 0, None) % em).reshape(-1)
    send = jnp.where(mine[:, None], master_weights[local], 0)  # [R(dst) * S, P]
    # Only the owner's row of each slot is non-zero, so summing over senders delivers it: a
    # reduce-scatter (XLA:CPU runs it and its transpose, an all-gather, faster than all-to-all).
    return jax.lax.psum_scatter(send, axis_name, scatter_dimension=0, tiled=True)


def fetch_replica_experts(
    master_experts: tuple[jax.Array, ...],
    slot_expert: jax.Array,
    *,
    axis_name: str,
    backend: str = "auto",
) -> tuple[jax.Array, ...]:
    """The weights of the experts in this rank's spare slots, one exchange for all tensors.

    Args:
      master_experts: this rank's master weights, each [E_m, ...] (for SwiGLU: w_gate, w_up,
        w_down).
      slot_expert: int32 [R, S], the plan's slots (identical on every rank of the EP group).
      axis_name: the EP mesh axis.
      backend: "portable" (the dense exchange), "ragged" (`ragged_all_to_all`), or "auto":
        dense on CPU, ragged elsewhere, chosen per platform at lowering time.

    Returns:
      One [S, ...] array per input, in the same order (zeros for empty slots).
    """
    em = master_experts[0].shape[0]
    flat = jnp.concatenate([w.reshape(em, -1) for w in master_experts], axis=1)  # [E_m, P]

    def dense():
        return _fetch_dense(flat, slot_expert, axis_name)

    def ragged():
        return _fetch_ragged(flat, slot_expert, axis_name)

    if backend == "portable":
        received = dense()
    elif backend == "ragged":
        received = ragged()
    elif backend == "auto":
        received = jax.lax.platform_dependent(cpu=dense, default=ragged)
    else:
        raise ValueError(
            f"unknown communication backend {backend!r}; expected one of {comm.BACKENDS}"
        )
    S = slot_expert.shape[1]
    sizes = [int(np.prod(w.shape[1:])) for w in master_experts]
    parts = jnp.split(received, np.cumsum(sizes)[:-1].tolist(), axis=1)
    return tuple(p.reshape((S,) + w.shape[1:]) for p, w in zip(parts, master_experts))
