"""Ragged backend: `jax.lax.ragged_all_to_all`, which moves only the rows that are needed.

For GPU and TPU; XLA:CPU cannot compile it. On GPU with 8+ ranks, XLA's implementation may fall
back to a host-synchronising path unless its device-kernel mode is on; keep the portable backend
selectable for that case.
"""

from __future__ import annotations

import jax


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
    """`jax.lax.ragged_all_to_all` over ``axis_name`` (``max_chunk`` is unused here)."""
    del max_chunk
    return jax.lax.ragged_all_to_all(
        operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name
    )
