"""Replica expert weights: each spare slot receives its expert's weights from the master's rank,
directly or through relays (`relay`: each holder forwards to at most ``max_fanout`` others).

The transfer is linear in the master weights, so its transpose (the backward pass) sends each
replica's weight gradient back along the same path, summed at every relay and added into the
master's gradient: no custom VJP needed. Nothing here waits on the masters' own matmuls, so XLA is
free to overlap the transfer with them.

The transfer has two paths behind `fetch_replica_experts`, by the communication backend
(`TRANSFERS`): "dense" for the "padded" backend (one hop: a row selection and a reduce-scatter of
``R * S`` rows, cheaper on XLA:CPU than the padded all-to-all, which would move R times its
rows), and "exchanged" for "ragged" (each relay hop one exchange of only the receiving slots,
`jax.lax.ragged_all_to_all`; GPU/TPU; a hop with no work is skipped by a `lax.cond`).

Shapes follow the package's axis legend (`ultraep_jax`); P is the weights of one expert, flattened.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ultraep_jax import comm
from ultraep_jax._vma import vary, varying_axes
from ultraep_jax.comm.exchange import Exchange
from ultraep_jax.config import resolve
from ultraep_jax.replicas import relay

#: The transfer's path for each communication backend: "dense" (a reduce-scatter of every slot
#: column in use, one hop) for "padded", "exchanged" (a ragged exchange of the receiving slots per
#: relay hop) for "ragged".
TRANSFERS = {"padded": "dense", "ragged": "exchanged"}


def _hop_exchange(table_NP, sender_RS, source_RS, axis_name: str, backend: str, send_rows: int):
    """[S, P] by one ragged exchange (`comm.exchange_by_backend` by ``backend``) that moves only
    the slots receiving in this hop (zeros for the others): slot (me, s) gets row
    ``source_RS[me, s]`` of rank ``sender_RS[me, s]``'s table.

    Args:
      table_NP: [N, P], this rank's rows to send from (its masters, or its slots when relaying).
      sender_RS: int32 [R, S], the rank that sends each slot its row; R where none does.
      source_RS: int32 [R, S], the row of the sender's table.
      axis_name: the EP mesh axis.
      send_rows: static, the most rows any rank sends in this hop (`relay.hop_send_bound`): the
        operand holds only the rows sent, not one per slot of the group (R x S expert copies,
        gigabytes at DeepSeek-V3's expert size and EP64).
    """
    R, S = sender_RS.shape
    me = jax.lax.axis_index(axis_name)
    slot_S = jnp.arange(S, dtype=jnp.int32)
    ranks_R = jnp.arange(R, dtype=jnp.int32)

    # Sender: the rows I send, destination after destination, each destination's in slot order
    # (a stable sort of the flat (destination, slot) cells puts mine first, in that order).
    # Receiver t keeps its slots ordered by (sender, slot).
    mine_N = (sender_RS == me).reshape(-1)
    cells = jnp.argsort(~mine_N, stable=True)[:send_rows]
    operand = table_NP[source_RS.reshape(-1)[cells]]  # [send_rows, P]
    sends = sender_RS[None, :, :] == ranks_R[:, None, None]  # [R(src), R(dst), S]
    sizes_RR = jnp.sum(sends, axis=-1, dtype=jnp.int32)
    exchange = Exchange(
        sizes_RR=sizes_RR,
        src_start_RR=jnp.cumsum(sizes_RR, axis=1, dtype=jnp.int32) - sizes_RR,
        dst_start_RR=jnp.sum(
            sender_RS[None, :, :] < ranks_R[:, None, None], axis=-1, dtype=jnp.int32
        ),
        rank=me,
        send_rows=send_rows,
        recv_rows=S,
        max_chunk=min(S, send_rows),
    )
    received = comm.exchange_by_backend(operand, exchange, axis_name=axis_name, backend=backend)
    # Back to slot order: slot s sits at its rank among (sender, slot) pairs.
    key_S = sender_RS[me] * S + slot_S
    return received[jnp.sum(key_S[None, :] < key_S[:, None], axis=1)]


def active_slots(slot_expert_RS: jax.Array) -> jax.Array:
    """int32 []: how many leading slot columns hold a replica on some rank (0 when none does);
    every slot from there on is empty on every rank."""
    return _leading_columns(jnp.any(slot_expert_RS >= 0, axis=0))


def _leading_columns(used_S: jax.Array) -> jax.Array:
    """int32 []: the columns up to the last one in use (bool [S]); 0 when none is."""
    S = used_S.shape[0]
    return jnp.max(jnp.where(used_S, jnp.arange(1, S + 1, dtype=jnp.int32), 0))


def column_buckets(S: int) -> tuple[int, ...]:
    """The slot-column counts the dense hop compiles a branch for: 1, 2, 4, ... and S (a hop
    moves the smallest that holds its columns in use: at most twice the bytes needed, with
    log2(S) + 1 branches rather than S; at S = 2 the two a skip-or-move cond had)."""
    return tuple(sorted({*(1 << i for i in range(max(S - 1, 0).bit_length())), S} - {0}))


def _hop_dense(tables: tuple, sender_RS: jax.Array, source_RS: jax.Array, axis_name: str):
    """[S, P] by a dense exchange: every rank sends each peer one row per slot column in use (the
    row it sends that slot, or zeros) and each slot sums what it got. It always exchanges (at
    least one column): the layer runs it only when the plan has a replica
    (`replicas.streaming`'s ``lax.cond``), so a branch that skipped it would only cost compile
    time.

    ``tables``: this rank's rows to send from, each [N, P_i] (P = sum of P_i); ``sender_RS`` and
    ``source_RS`` as in `_hop_exchange`.
    """
    R, S = sender_RS.shape
    me = jax.lax.axis_index(axis_name)
    P_ = sum(w.shape[1] for w in tables)
    dtype = jnp.result_type(*tables)  # what the concatenation below makes of mixed dtypes
    # Every branch of the switch must have one type: varying over all that any input varies over.
    axes = {axis_name}.union(*(varying_axes(a) for a in (*tables, sender_RS, source_RS)))

    def fetch(k: int):
        def moved():
            mine = (sender_RS[:, :k] == me).reshape(-1, 1)  # bool [R * k, 1]
            rows = source_RS[:, :k].reshape(-1)
            # One fused gather per tensor, zero where another rank sends the slot: a select, not
            # a product with a 0/1 mask, so that inf or NaN in one expert's weights stays in the
            # slots of that expert (inf * 0 is NaN, and the sum would spread it to every slot
            # gathering the same row); its transpose is a select too.
            send = jnp.concatenate([jnp.where(mine, w[rows], 0) for w in tables], axis=1)
            # Only the sender's row of each slot is non-zero, so summing over senders delivers
            # it: a reduce-scatter (XLA:CPU runs it and its transpose, an all-gather, faster
            # than an all-to-all).
            got = jax.lax.psum_scatter(send, axis_name, scatter_dimension=0, tiled=True)
            return vary(jnp.pad(got, ((0, S - k), (0, 0))), axes)

        return moved

    buckets = column_buckets(S)
    if not buckets:  # no slot column: nothing to move
        return vary(jnp.zeros((S, P_), dtype), axes)
    # The plan is identical across the EP group, so every rank takes the same branch: the one
    # that moves the fewest slot columns holding every receiving slot (plans fill columns from
    # the first), as bytes on the wire and copies cost per column moved.
    used = _leading_columns(jnp.any(sender_RS < R, axis=0))
    branch = jnp.sum(jnp.asarray(buckets, jnp.int32) < used)
    return jax.lax.switch(branch, [fetch(k) for k in buckets])


def _hop_exchange_if_any(table_NP, sender_RS, source_RS, axis_name, backend, send_rows):
    """`_hop_exchange`, skipped (zeros, no exchange) when no slot receives in this hop."""
    R, S = sender_RS.shape
    axes = {axis_name}.union(*(varying_axes(a) for a in (table_NP, sender_RS, source_RS)))

    def skip():
        return vary(jnp.zeros((S, table_NP.shape[1]), table_NP.dtype), axes)

    def hop():
        hop = _hop_exchange(table_NP, sender_RS, source_RS, axis_name, backend, send_rows)
        return vary(hop, axes)

    return jax.lax.cond(jnp.any(sender_RS < R), hop, skip)


def _relayed(masters, schedule: relay.RelaySchedule, num_hops: int, hop, hop_if_any) -> jax.Array:
    """[S, P]: every slot's weights by ``schedule`` (`relay.relay_schedule`, at most ``num_hops``
    hops): hop 1 from the masters, each later hop from the slots that already hold them. A relayed
    slot receives into zeros, so adding each hop's rows is exact, and the transpose sums a slot's
    gradient into the slot (or master) that sent it: gradients return along the tree. ``hop``
    and ``hop_if_any`` take (table, senders [R, S], sources [R, S], the hop's number)."""
    R = schedule.sender_RS.shape[0]

    def senders(h):
        return jnp.where(schedule.hop_RS == h, schedule.sender_RS, R)

    slots_SP = hop(masters, senders(1), schedule.source_RS, 1)
    for h in range(2, num_hops + 1):
        slots_SP = slots_SP + hop_if_any(slots_SP, senders(h), schedule.source_RS, h)
    return slots_SP


def fetch_replica_experts(
    masters: tuple[jax.Array, ...],
    slot_expert_RS: jax.Array,
    *,
    axis_name: str,
    backend: str = "auto",
    max_fanout: int = 0,
    domain_size: int | None = None,
    schedule: relay.RelaySchedule | None = None,
) -> tuple[jax.Array, ...]:
    """The weights of the experts in this rank's spare slots, one exchange per relay hop for all
    tensors.

    Args:
      masters: this rank's master weights, each [E_m, ...] (gated experts: w_gate, w_up, w_down,
        and their biases if any).
      slot_expert_RS: int32 [R, S], the plan's slots (identical on every rank of the EP group).
      axis_name: the EP mesh axis.
      backend: a communication backend (`config.execution.BACKENDS`), whose transfer path is
        `TRANSFERS`' : "padded" (the dense path), "ragged" (the exchanged path,
        `ragged_all_to_all`), or "auto": padded on CPU, ragged elsewhere, for the platform of the
        mesh traced on (`resolve.by_platform`).
      max_fanout: the relay bound f (`BalancerConfig.max_fanout`; ffi/TRANSFER.md); 0: every
        master sends every copy itself, in one exchange. The dense path ignores it: there every
        rank sends the same rows in a hop whoever holds the weights, so it moves every copy in
        one hop.
      domain_size: ranks per fast domain (`BalancerConfig.ranks_per_domain`; None: one); the
        dense path ignores it as it does ``max_fanout``.
      schedule: ``relay.relay_schedule(slot_expert_RS, E_m, max_fanout, domain_size)``, with
        this call's ``max_fanout`` and ``domain_size`` (the exchanged hops' operands are sized by
        them, `relay.hop_send_bound`), when the caller has it already (the layer computes it once
        per call, for the transfer and its `MoEStats.transfer_send_max`); None: computed here.

    Returns:
      One [S, ...] array per input, in the same order (zeros for empty slots).
    """
    em = masters[0].shape[0]
    flat = tuple(w.reshape(em, -1) for w in masters)

    def dense():
        def hop(tables, sender_RS, source_RS, h):
            del h  # one hop, every slot column in use from every rank
            tables = tables if isinstance(tables, tuple) else (tables,)
            return _hop_dense(tables, sender_RS, source_RS, axis_name)

        # The dense hop's reduce-scatter has every rank send R * S rows whatever the fan-out, so
        # a relay would only add hops (bytes, collectives and compile time): one hop here.
        direct = relay.direct_schedule(slot_expert_RS, em)
        return _relayed(flat, direct, 1, hop, hop)

    R, S = slot_expert_RS.shape

    def rows(h):
        return relay.hop_send_bound(R, S, em, max_fanout, domain_size, h)

    def exchanged(name):
        def hop(table, sender_RS, source_RS, h):
            return _hop_exchange(table, sender_RS, source_RS, axis_name, name, rows(h))

        def hop_if_any(table, sender_RS, source_RS, h):
            return _hop_exchange_if_any(table, sender_RS, source_RS, axis_name, name, rows(h))

        table = jnp.concatenate(flat, axis=1)
        return lambda: _relayed(table, relayed(), num_hops, hop, hop_if_any)

    def relayed():
        if schedule is not None:
            return schedule
        return relay.relay_schedule(slot_expert_RS, em, max_fanout, domain_size)

    num_hops = relay.schedule_hops(R, max_fanout, domain_size)

    paths = {"dense": dense, "exchanged": exchanged("ragged")}

    def run(platform):
        return paths[TRANSFERS[resolve.choose("comm_backend", backend, platform)]]

    return _unflattened(resolve.by_platform("comm_backend", backend, run), masters)


def _unflattened(received_SP: jax.Array, masters: tuple) -> tuple[jax.Array, ...]:
    """``received_SP`` [S, P] split into one [S, ...] array per master tensor: masters of
    different dtypes travel in their common one (exactly) and come back as their own."""
    S = received_SP.shape[0]
    sizes = [int(np.prod(w.shape[1:])) for w in masters]
    parts = jnp.split(received_SP, np.cumsum(sizes)[:-1].tolist(), axis=1)
    return tuple(
        p.reshape((S,) + w.shape[1:]).astype(w.dtype) for p, w in zip(parts, masters, strict=True)
    )
