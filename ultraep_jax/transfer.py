"""Replica expert weights: each spare slot receives its expert's weights from the master's rank.

The transfer is linear in the master weights, so its transpose (the backward pass) sends each
replica's weight gradient back and adds it into the master's gradient: no custom VJP needed.
Nothing here waits on the masters' own matmuls, so XLA is free to overlap the transfer with them.

Two implementations behind `fetch_replica_experts`: a dense one (a row selection and a
reduce-scatter of ``R * k`` rows for the k leading slot columns in use, cheaper on XLA:CPU than an
all-to-all, and nothing when no replica is planned) and a ragged one
(`jax.lax.ragged_all_to_all`, which moves only the filled slots; GPU/TPU).

Shapes follow the package's axis legend (`ultraep_jax`); P is the weights of one expert, flattened.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ultraep_jax import comm
from ultraep_jax._vma import vary, varying_axes
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


def active_slots(slot_expert_RS: jax.Array) -> jax.Array:
    """int32 []: how many leading slot columns hold a replica on some rank (0 when none does);
    every slot from there on is empty on every rank."""
    S = slot_expert_RS.shape[1]
    used_S = jnp.any(slot_expert_RS >= 0, axis=0)
    return jnp.max(jnp.where(used_S, jnp.arange(1, S + 1, dtype=jnp.int32), 0))


def _fetch_dense(masters_MP: tuple, slot_expert_RS: jax.Array, axis_name: str) -> jax.Array:
    """[S, P] by a dense exchange of the leading slot columns in use: every rank sends each peer
    one row per such slot of that peer (its master's weights if it owns the slot's expert, else
    zeros) and each slot sums what it got; no exchange at all when no slot is in use.

    ``masters_MP``: this rank's master tensors, each flattened to [E_m, P_i] (P = sum of P_i).
    """
    em = masters_MP[0].shape[0]
    R, S = slot_expert_RS.shape
    me = jax.lax.axis_index(axis_name)
    P_ = sum(w.shape[1] for w in masters_MP)
    dtype = masters_MP[0].dtype
    # Every branch of the switch must have one type: varying over all that any input varies over.
    axes = {axis_name}.union(*(varying_axes(a) for a in (*masters_MP, slot_expert_RS)))

    def first(k):
        def fetch():
            slots = slot_expert_RS[:, :k]
            mine = (slot_owners(slots, em) == me).reshape(-1, 1).astype(dtype)  # [R * k, 1]
            local = (jnp.clip(slots, 0, None) % em).reshape(-1)
            # One fused gather per tensor, scaled to zero where another rank owns the slot.
            send = jnp.concatenate([w[local] * mine for w in masters_MP], axis=1)
            # Only the owner's row of each slot is non-zero, so summing over senders delivers
            # it: a reduce-scatter (XLA:CPU runs it and its transpose, an all-gather, faster
            # than an all-to-all).
            got = jax.lax.psum_scatter(send, axis_name, scatter_dimension=0, tiled=True)
            return vary(jnp.pad(got, ((0, S - k), (0, 0))), axes)

        return fetch

    # The plan is identical across the EP group, so every rank takes the same branch: the bytes
    # moved follow the slots in use (none without replicas), not the slots configured.
    branches = [lambda: vary(jnp.zeros((S, P_), dtype), axes)]
    branches += [first(k) for k in range(1, S + 1)]
    return jax.lax.switch(active_slots(slot_expert_RS), branches)


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
    flat = tuple(w.reshape(em, -1) for w in masters)

    def dense():
        return _fetch_dense(flat, slot_expert_RS, axis_name)

    def ragged():
        return _fetch_ragged(jnp.concatenate(flat, axis=1), slot_expert_RS, axis_name)

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
