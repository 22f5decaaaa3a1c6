"""Replica expert weights: each spare slot receives its expert's weights from the master's rank.

The transfer is linear in the master weights, so its transpose (the backward pass) sends each
replica's weight gradient back and adds it into the master's gradient: no custom VJP needed.
Nothing here waits on the masters' own matmuls, so XLA is free to overlap the transfer with them.

Two implementations behind `fetch_replica_experts`: a dense one (a row selection and a
reduce-scatter of ``R * S`` rows, cheaper on XLA:CPU than an all-to-all) and
a ragged one (`jax.lax.ragged_all_to_all`, which moves only the filled slots; GPU/TPU).

Shapes follow the package's axis legend (`ultraep_jax`); P is the weights of one expert, flattened.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ultraep_jax import comm
from ultraep_jax.exchange import Exchange


def slot_owners(slot_expert_RS: jax.Array, experts_per_rank: int) -> jax.Array:
    """int32 [R, S]: the master rank of each slot's expert; R for an empty slot."""
    R = slot_expert_RS.shape[0]
    return jnp.where(slot_expert_RS >= 0, slot_expert_RS // experts_per_rank, R).astype(jnp.int32)


def _fetch_ragged(weights_MP: jax.Array, slot_expert_RS: jax.Array, axis_name: str) -> jax.Array:
    """[S, P] by one ragged exchange that moves only the filled slots (zeros for empty slots).

    Args:
      weights_MP: [E_m, P], this rank's master experts, flattened.
      slot_expert_RS: int32 [R, S], the plan's slots (identical on every rank of the EP group).
      axis_name: the EP mesh axis.
    """
    em = weights_MP.shape[0]
    R, S = slot_expert_RS.shape
    me = jax.lax.axis_index(axis_name)
    owner_RS = slot_owners(slot_expert_RS, em)
    slot_S = jnp.arange(S, dtype=jnp.int32)
    ranks_R = jnp.arange(R, dtype=jnp.int32)

    # Sender: for each destination t, the slots of t that hold one of my masters, in slot order,
    # first in t's block of S rows. Receiver t keeps its slots ordered by (owner, slot).
    mine_RS = owner_RS == me
    order_RS = jnp.argsort(jnp.where(mine_RS, 0, S) + slot_S[None, :], axis=1)
    local_RS = jnp.clip(slot_expert_RS, 0, None) % em
    operand = weights_MP[jnp.take_along_axis(local_RS, order_RS, axis=1).reshape(-1)]  # [R*S, P]
    owns = owner_RS[None, :, :] == ranks_R[:, None, None]  # [R(src), R(dst), S]
    exchange = Exchange(
        sizes_RR=jnp.sum(owns, axis=-1, dtype=jnp.int32),
        src_start_RR=jnp.broadcast_to(ranks_R[None, :] * S, (R, R)),
        dst_start_RR=jnp.sum(
            owner_RS[None, :, :] < ranks_R[:, None, None], axis=-1, dtype=jnp.int32
        ),
        rank=me,
        send_rows=R * S,
        recv_rows=S,
        max_chunk=S,
    )
    received = comm.ragged_exchange(operand, exchange, axis_name=axis_name, backend="ragged")
    # Back to slot order: slot s sits at its rank among (owner, slot) pairs.
    key_S = owner_RS[me] * S + slot_S
    return received[jnp.sum(key_S[None, :] < key_S[:, None], axis=1)]


def _fetch_dense(weights_MP: jax.Array, slot_expert_RS: jax.Array, axis_name: str) -> jax.Array:
    """[S, P] by a dense exchange: every rank sends each peer one row per slot of that peer (its
    master's weights if it owns the slot's expert, else zeros) and each slot sums what it got."""
    em = weights_MP.shape[0]
    me = jax.lax.axis_index(axis_name)
    mine = (slot_owners(slot_expert_RS, em) == me).reshape(-1)  # [R * S]
    local = (jnp.clip(slot_expert_RS, 0, None) % em).reshape(-1)
    send = jnp.where(mine[:, None], weights_MP[local], 0)  # [R(dst) * S, P]
    # Only the owner's row of each slot is non-zero, so summing over senders delivers it: a
    # reduce-scatter (XLA:CPU runs it and its transpose, an all-gather, faster than all-to-all).
    return jax.lax.psum_scatter(send, axis_name, scatter_dimension=0, tiled=True)


def fetch_replica_experts(
    masters: tuple[jax.Array, ...],
    slot_expert_RS: jax.Array,
    *,
    axis_name: str,
    backend: str = "auto",
) -> tuple[jax.Array, ...]:
    """The weights of the experts in this rank's spare slots, one exchange for all tensors.

    Args:
      masters: this rank's master weights, each [E_m, ...] (for SwiGLU: w_gate, w_up, w_down).
      slot_expert_RS: int32 [R, S], the plan's slots (identical on every rank of the EP group).
      axis_name: the EP mesh axis.
      backend: "portable" (the dense exchange), "ragged" (`ragged_all_to_all`), or "auto":
        dense on CPU, ragged elsewhere, chosen per platform at lowering time.

    Returns:
      One [S, ...] array per input, in the same order (zeros for empty slots).
    """
    em = masters[0].shape[0]
    flat_MP = jnp.concatenate([w.reshape(em, -1) for w in masters], axis=1)

    def dense():
        return _fetch_dense(flat_MP, slot_expert_RS, axis_name)

    def ragged():
        return _fetch_ragged(flat_MP, slot_expert_RS, axis_name)

    if backend == "portable":
        received_SP = dense()
    elif backend == "ragged":
        received_SP = ragged()
    elif backend == "auto":
        received_SP = jax.lax.platform_dependent(cpu=dense, default=ragged)
    else:
        raise ValueError(
            f"unknown communication backend {backend!r}; expected one of {comm.BACKENDS}"
        )
    S = slot_expert_RS.shape[1]
    sizes = [int(np.prod(w.shape[1:])) for w in masters]
    parts = jnp.split(received_SP, np.cumsum(sizes)[:-1].tolist(), axis=1)
    return tuple(p.reshape((S,) + w.shape[1:]) for p, w in zip(parts, masters, strict=True))
