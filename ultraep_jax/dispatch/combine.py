"""The received rows regrouped by local instance and back, and the combine: each token's expert
outputs weighted and summed (`Dispatch` says where every row is)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ultraep_jax.dispatch.order import Dispatch


def to_groups(buffer_CD: jax.Array, d: Dispatch) -> jax.Array:
    """[C, D]: the receive buffer regrouped by local group (masters, then slots) from row 0."""
    return (
        jnp.zeros_like(buffer_CD).at[d.group_row_C].set(buffer_CD, mode="drop", unique_indices=True)
    )


def from_groups(rows_CD: jax.Array, d: Dispatch) -> jax.Array:
    """[C, D]: the inverse of `to_groups` (zeros in unused rows), ready for the return trip."""
    C = rows_CD.shape[0]
    used = (d.group_row_C < C)[:, None]
    return jnp.where(used, rows_CD[jnp.clip(d.group_row_C, 0, C - 1)], 0)


def sent_pairs(d: Dispatch) -> jax.Array:
    """bool [N]: which of this rank's pairs (in pair order) reach an expert: not those of an id
    outside [0, E) (sent nowhere) nor those dropped for capacity (past their block's kept
    prefix)."""
    ex = d.exchange
    N = ex.send_rows
    start_R, size_R = ex.src_start_RR[ex.rank], ex.sizes_RR[ex.rank]
    # Blocks are laid out in destination order from row 0, so the block of a send-order row is
    # the last one starting at or before it; past every block, the last one (never kept there).
    rows_N = jnp.arange(N, dtype=jnp.int32)
    block_N = jnp.clip(jnp.searchsorted(start_R, rows_N, side="right") - 1, 0, None)
    kept_N = rows_N - start_R[block_N] < size_R[block_N]
    return jnp.zeros((N,), bool).at[d.send_order_N].set(kept_N, unique_indices=True)


def combine(back_ND: jax.Array, d: Dispatch, weights_TK: jax.Array) -> jax.Array:
    """float32 [T, D]: each token's expert outputs (``back_ND`` [N, D], in send order) weighted
    by ``weights_TK`` [T, k] and summed; pairs that reached no expert (`sent_pairs`) contribute
    zero whatever their weight (selected out, not multiplied by zero: a NaN or inf weight on such
    a pair reaches neither the token nor its weight's gradient)."""
    T, K = weights_TK.shape
    pair_out_ND = jnp.zeros_like(back_ND).at[d.send_order_N].set(back_ND, unique_indices=True)
    weights_TK = jnp.where(sent_pairs(d).reshape(T, K), weights_TK, 0)
    return jnp.einsum("tk,tkd->td", weights_TK, pair_out_ND.reshape(T, K, -1).astype(jnp.float32))
