"""The "padded" backend: `ragged_all_to_all` semantics built from a fixed-size (padded)
`all_to_all`.

Runs on every platform (XLA:CPU cannot compile `ragged_all_to_all`) and is what the tests use.
It moves ``R * max_chunk`` rows per rank whatever the real sizes are, so GPUs use
`comm.ragged` by default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ultraep_jax.comm.exchange import Exchange


def padded_all_to_all(operand, output, exchange: Exchange, *, axis_name: str):
    """Same contract as `jax.lax.ragged_all_to_all` over ``axis_name``, with the sizes and
    offsets of ``exchange``: ``operand`` [send_rows, ...] in, ``output`` [recv_rows, ...] with the
    received rows written in, out. Moves ``R * exchange.max_chunk`` rows per rank."""
    input_offsets, send_sizes, _, recv_sizes = exchange.ragged_all_to_all_args()
    max_chunk = exchange.max_chunk
    step = jnp.arange(max_chunk, dtype=jnp.int32)
    rows = input_offsets[:, None] + step[None, :]  # [R, chunk]
    sending = step[None, :] < send_sizes[:, None]
    trailing = (1,) * (operand.ndim - 1)
    chunks = operand[jnp.clip(rows, 0, operand.shape[0] - 1)]  # [R, chunk, ...]
    chunks = jnp.where(sending.reshape(sending.shape + trailing), chunks, 0)
    received = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # [R(source), chunk, ...]
    # Where each source's rows go here: the exchange knows every rank's offsets, no need to ask.
    offsets = exchange.dst_start_RR[:, exchange.rank]
    dest = offsets[:, None] + step[None, :]
    dest = jnp.where(
        step[None, :] < recv_sizes[:, None], dest, output.shape[0]
    )  # out of range: skip
    return output.at[dest.reshape(-1)].set(
        received.reshape((-1,) + operand.shape[1:]), mode="drop", unique_indices=True
    )
