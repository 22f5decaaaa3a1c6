"""Communication over the EP axis: one dispatcher of ragged row exchanges,
`exchange_by_backend`, over one file per backend ("padded" is `padded.padded_all_to_all`,
"ragged" is `ragged.ragged_all_to_all`), used by the token exchange and the replica transfer.
Which backend "auto" is on a platform is `config.resolve`'s rule.

An `Exchange` (`comm.exchange`) holds every size and offset of one ragged all-to-all for
the whole EP group, so the return trip is `Exchange.reversed` and each call passes one argument.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ultraep_jax._vma import vary, varying_axes
from ultraep_jax.comm import padded, ragged
from ultraep_jax.comm.exchange import Exchange
from ultraep_jax.config import resolve
from ultraep_jax.config.execution import BACKENDS

__all__ = [
    "BACKENDS",
    "EXCHANGES",
    "Exchange",
    "exchange_by_backend",
    "local_exchange",
]

#: Each backend's `ragged_all_to_all`-like exchange (operand, output, exchange, *, axis_name), by
#: the names of `config.execution.BACKENDS`.
EXCHANGES = {"padded": padded.padded_all_to_all, "ragged": ragged.ragged_all_to_all}


def exchange_by_backend(
    operand: jax.Array, exchange: Exchange, *, axis_name: str, backend: str = "auto"
) -> jax.Array:
    """[recv_rows, ...]: ``operand`` [send_rows, ...] sent in ragged blocks to every peer on
    ``axis_name`` as ``exchange`` says, by the exchange of ``backend``; rows nobody writes are
    zero.

    ``backend``: "ragged" (`jax.lax.ragged_all_to_all`: only the needed bytes move; GPU/TPU),
    "padded" (a fixed-size all-to-all of ``R * max_chunk`` rows; any platform), or "auto":
    padded on CPU, ragged elsewhere, for the platform of the mesh traced on
    (`resolve.by_platform`).
    """
    if operand.shape[0] != exchange.send_rows:
        raise ValueError(
            f"exchange_by_backend: operand has {operand.shape[0]} rows, the exchange sends from "
            f"{exchange.send_rows}"
        )
    # The result varies over the exchange axis and whatever its inputs vary over. It is typed so
    # by construction: `ragged_all_to_all` types its result after ``output`` (jax <= 0.12.0), so
    # the buffer is made varying before the call. A cast of the result after the call would be
    # wrong: its transpose would psum the receive buffer's cotangent over the EP group, and each
    # sender would get every receiver's cotangent summed.
    inputs = (operand, *jax.tree.leaves(exchange))
    axes = tuple(sorted({axis_name}.union(*map(varying_axes, inputs))))
    operand = vary(operand, axes)
    output = vary(jnp.zeros((exchange.recv_rows,) + operand.shape[1:], operand.dtype), axes)

    def run(platform):
        exchange_ = EXCHANGES[resolve.choose("comm_backend", backend, platform)]
        return functools.partial(exchange_, axis_name=axis_name)

    return resolve.by_platform("comm_backend", backend, run, operand, output, exchange)


def local_exchange(operand: jax.Array, exchange: Exchange) -> jax.Array:
    """`exchange_by_backend` over an EP axis of one device (or none): [recv_rows, ...], the first
    ``sizes_RR[0, 0]`` rows of ``operand`` [send_rows, ...] from row 0, zeros after; no
    collective."""
    if exchange.sizes_RR.shape != (1, 1):
        raise ValueError(f"local_exchange: wants one rank, got sizes {exchange.sizes_RR.shape}")
    rows = jnp.arange(exchange.recv_rows, dtype=jnp.int32)
    src = exchange.src_start_RR[0, 0] + rows
    keep = (rows < exchange.sizes_RR[0, 0]).reshape((-1,) + (1,) * (operand.ndim - 1))
    return jnp.where(keep, operand[jnp.clip(src, 0, operand.shape[0] - 1)], 0)
