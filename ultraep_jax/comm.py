"""One entry point for ragged row exchange over the EP axis, whatever the backend.

An `Exchange` holds every size and offset of one ragged all-to-all for the whole EP group
(``[R, R]`` matrices, identical on every rank), so the return trip is `Exchange.reversed` and
each call site passes one argument.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ultraep_jax import comm_portable, comm_ragged
from ultraep_jax._vma import vary, varying_axes

BACKENDS = ("auto", "portable", "ragged")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Exchange:
    """Sizes and offsets of one ragged all-to-all over an EP group of R ranks.

    Attributes:
      sizes_RR: int32 [R(src), R(dst)], rows ``src`` sends to ``dst``.
      src_start_RR: int32 [R(src), R(dst)], where the rows for ``dst`` start in ``src``'s operand.
      dst_start_RR: int32 [R(src), R(dst)], where the rows from ``src`` start in ``dst``'s output.
      rank: int32 [], this rank's index on the EP axis.
      send_rows: static, rows of each rank's operand.
      recv_rows: static, rows of each rank's output.
      max_chunk: static bound on every entry of ``sizes_RR``.
    """

    sizes_RR: jax.Array
    src_start_RR: jax.Array
    dst_start_RR: jax.Array
    rank: jax.Array
    send_rows: int = dataclasses.field(metadata=dict(static=True))
    recv_rows: int = dataclasses.field(metadata=dict(static=True))
    max_chunk: int = dataclasses.field(metadata=dict(static=True))

    def reversed(self) -> Exchange:
        """The return trip: every block goes back from where it arrived to where it came from."""
        return Exchange(
            sizes_RR=self.sizes_RR.T,
            src_start_RR=self.dst_start_RR.T,
            dst_start_RR=self.src_start_RR.T,
            rank=self.rank,
            send_rows=self.recv_rows,
            recv_rows=self.send_rows,
            max_chunk=self.max_chunk,
        )

    def ragged_all_to_all_args(self) -> tuple[jax.Array, ...]:
        """This rank's ``(input_offsets, send_sizes, output_offsets, recv_sizes)``, each [R], in
        `jax.lax.ragged_all_to_all`'s terms. Offsets of empty blocks are 0 (always in range)."""
        me = self.rank
        send, recv = self.sizes_RR[me], self.sizes_RR[:, me]
        return (
            jnp.where(send > 0, self.src_start_RR[me], 0),
            send,
            jnp.where(send > 0, self.dst_start_RR[me], 0),
            recv,
        )


def ragged_exchange(
    operand: jax.Array, exchange: Exchange, *, axis_name: str, backend: str = "auto"
) -> jax.Array:
    """[recv_rows, ...]: ``operand`` [send_rows, ...] sent in ragged blocks to every peer on
    ``axis_name`` as ``exchange`` says; rows nobody writes are zero.

    ``backend``: "ragged" (`jax.lax.ragged_all_to_all`: only the needed bytes move; GPU/TPU),
    "portable" (a fixed-size all-to-all of ``R * max_chunk`` rows; any platform), or "auto":
    portable on CPU, ragged elsewhere, chosen per platform at lowering time.
    """
    if operand.shape[0] != exchange.send_rows:
        raise ValueError(
            f"ragged_exchange: operand has {operand.shape[0]} rows, the exchange sends from "
            f"{exchange.send_rows}"
        )
    output = jnp.zeros((exchange.recv_rows,) + operand.shape[1:], operand.dtype)
    args = (operand, output, *exchange.ragged_all_to_all_args())
    kw = dict(axis_name=axis_name, max_chunk=exchange.max_chunk)

    # The result varies over the exchange axis and whatever its inputs vary over; say so
    # explicitly (some transposes drop the type) so that both platform branches have one type.
    axes = tuple(sorted({axis_name} | varying_axes(operand)))

    def portable(*a):
        return vary(comm_portable.ragged_exchange(*a, **kw), axes)

    def ragged(*a):
        return vary(comm_ragged.ragged_exchange(*a, **kw), axes)

    if backend == "portable":
        return portable(*args)
    if backend == "ragged":
        return ragged(*args)
    if backend != "auto":
        raise ValueError(f"unknown communication backend {backend!r}; expected one of {BACKENDS}")
    return jax.lax.platform_dependent(*args, cpu=portable, default=ragged)
