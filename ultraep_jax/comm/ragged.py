"""The "ragged" backend: `jax.lax.ragged_all_to_all`, which moves only the rows that are needed.

For GPU and TPU; XLA:CPU cannot compile it. On GPU with 8+ ranks, XLA's implementation may fall
back to a host-synchronising path unless its device-kernel mode is on; keep the padded backend
(`comm.padded`) selectable for that case.
"""

from __future__ import annotations

import jax

from ultraep_jax.comm.exchange import Exchange


def ragged_all_to_all(operand, output, exchange: Exchange, *, axis_name: str):
    """`jax.lax.ragged_all_to_all` over ``axis_name`` with the sizes and offsets of
    ``exchange``."""
    return jax.lax.ragged_all_to_all(
        operand, output, *exchange.ragged_all_to_all_args(), axis_name=axis_name
    )
