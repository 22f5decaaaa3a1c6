"""`Exchange`: every size and offset of one ragged all-to-all over an EP group.

Held as ``[R, R]`` matrices, identical on every rank, so that each rank reads its own row for
sending and its own column for receiving, and the return trip is the transpose.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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
    send_rows: int = dataclasses.field(metadata={"static": True})
    recv_rows: int = dataclasses.field(metadata={"static": True})
    max_chunk: int = dataclasses.field(metadata={"static": True})

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
