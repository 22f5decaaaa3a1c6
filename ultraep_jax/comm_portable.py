"""Portable backend: `ragged_all_to_all` semantics built from a fixed-size `all_to_all`.

Runs on every platform (XLA:CPU cannot compile `ragged_all_to_all`) and is what the tests use.
It moves ``R * max_chunk`` rows per rank whatever the real sizes are, so GPUs use
`comm_ragged` by default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_exchange(
    operand,
    output,
    input_offsets,
    send_sizes,
    output_offsets,
    recv_sizes,
    *,
    axis_name: str,
    max_chunk: int,
):
    """Same contract as `jax.lax.ragged_all_to_all` over ``axis_name``.

    Args:
      operand: [N, ...] rows to send; the rows for peer j are
        ``operand[input_offsets[j] : input_offsets[j] + send_sizes[j]]``.
      output: [M, ...] the buffer that received rows are written into.
      input_offsets, send_sizes: int32 [R].
      output_offsets: int32 [R], where peer j writes what it receives from this rank.
      recv_sizes: int32 [R], rows this rank receives from each peer.
      axis_name: the mesh axis to exchange over.
      max_chunk: a static bound on every send size.

    Returns:
      ``output`` with the received rows written in.
    """
    step = jnp.arange(max_chunk, dtype=jnp.int32)
    rows = input_offsets[:, None] + step[None, :]  # [R, chunk]
    sending = step[None, :] < send_sizes[:, None]
    trailing = (1,) * (operand.ndim - 1)
    chunks = operand[jnp.clip(rows, 0, operand.shape[0] - 1)]  # [R, chunk, ...]
    chunks = jnp.where(sending.reshape(sending.shape + trailing), chunks, 0)
    received = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # [R(source), chunk, ...]
    offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # chosen by sources
    dest = offsets[:, None] + step[None, :]
    dest = jnp.where(
        step[None, :] < recv_sizes[:, None], dest, output.shape[0]
    )  # out of range: skip
    return output.at[dest.reshape(-1)].set(
        received.reshape((-1,) + operand.shape[1:]), mode="drop", unique_indices=True
    )
