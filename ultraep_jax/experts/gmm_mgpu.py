"""`grouped_matmul_mgpu`: ``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` through JAX's own Hopper
kernels written in Pallas' Mosaic GPU backend (``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``
and ``transposed_ragged_dot_mgpu``: TMA loads and wgmma, a persistent grid), differentiable
(bf16/f16 only; Hopper only; no interpreter). The weight-gradient kernel reads the host's GPU
when traced (its grid is ``jax.devices()[0].core_count``, `base.operands.host_is_hopper`), so
they lower only on a Hopper host, never from a CPU host for a mesh of compile-only H100s (the
forward kernel alone would). Which operands they take: `base.operands` (`MgpuTiles`,
`mgpu_unsupported`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ultraep_jax._vma import vary, varying_axes
from ultraep_jax.base.operands import MgpuTiles, mgpu_unsupported
from ultraep_jax.base.operands import host_is_hopper as is_hopper

__all__ = ["MgpuTiles", "grouped_matmul_mgpu", "is_hopper", "mgpu_unsupported"]


def _round_up(x: int, m: int) -> int:
    """The least multiple of ``m`` that is >= ``x``."""
    return -(-x // m) * m


def _pad_rows(x: jax.Array, size: int) -> jax.Array:
    """``x`` zero-padded along axis 0 to ``size`` rows (a no-op when already that size)."""
    if x.shape[0] == size:
        return x
    return jnp.pad(x, [(0, size - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _group_bounds(group_sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """int32 [G] row ranges ``[starts[g], ends[g])`` of the groups, clipped to ``num_rows``."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)
    ends = jnp.maximum(ends, 0)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def _clipped_sizes(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    starts, ends = _group_bounds(group_sizes, num_rows)
    return ends - starts


def _zero_rows_past(out: jax.Array, total: jax.Array) -> jax.Array:
    """The Mosaic GPU kernels leave rows past the groups' total unwritten: zero them."""
    rows = jax.lax.broadcasted_iota(jnp.int32, out.shape, 0)
    return jnp.where(rows < total, out, jnp.zeros_like(out))


def _mgpu_ragged(lhs, rhs, sizes, tiles: MgpuTiles, transpose_rhs: bool):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    out = ragged_dot_mgpu.ragged_dot(
        lhs,
        rhs,
        group_sizes=sizes,
        transpose_rhs=transpose_rhs,
        **tiles._asdict(),  # the fields are the kernels' keyword arguments
    )
    out = _zero_rows_past(out, jnp.sum(sizes))
    return vary(out, tuple(sorted(varying_axes(lhs) | varying_axes(rhs) | varying_axes(sizes))))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm_mgpu(lhs, rhs, sizes, tiles: MgpuTiles):
    return _mgpu_ragged(lhs, rhs, sizes, tiles, transpose_rhs=False)


def _gmm_mgpu_fwd(lhs, rhs, sizes, tiles: MgpuTiles):
    return _gmm_mgpu(lhs, rhs, sizes, tiles), (lhs, rhs, sizes)


def _gmm_mgpu_bwd(tiles: MgpuTiles, res, d_out):
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    lhs, rhs, sizes = res
    d_out = d_out.astype(lhs.dtype)
    # d_lhs[m] = d_out[m] @ rhs[g]^T: the forward kernel with rhs read transposed.
    d_lhs = _mgpu_ragged(d_out, rhs, sizes, tiles, transpose_rhs=True)
    # d_rhs[g] = lhs_g^T @ d_out_g: the transposed kernel ("k" is the grouped row axis there).
    d_rhs = transposed_ragged_dot_mgpu.transposed_ragged_dot(
        lhs,
        d_out,
        group_sizes=sizes,
        **tiles._asdict(),  # the fields are the kernels' keyword arguments
    )
    d_rhs = vary(d_rhs.astype(rhs.dtype), tuple(sorted(varying_axes(rhs) | varying_axes(d_out))))
    return d_lhs, d_rhs, None


_gmm_mgpu.defvjp(_gmm_mgpu_fwd, _gmm_mgpu_bwd)


def grouped_matmul_mgpu(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, tiles: MgpuTiles | None = None
) -> jax.Array:
    """``jax.lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G])`` through JAX's Hopper
    (Mosaic GPU) ragged-dot kernels, differentiable.

    Rows past ``sum(group_sizes)`` give zeros, a sum above M is clipped to M; for bf16/f16
    operands of one dtype on an H100/H200; K and N must be multiples of the tiles
    (`mgpu_unsupported` says why not). Accumulates in float32; the result has the operands'
    dtype.
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"grouped_matmul_mgpu: need lhs [M, K] and rhs [G, K, N], got {lhs.shape} and "
            f"{rhs.shape}"
        )
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(
            f"grouped_matmul_mgpu: group_sizes must be [G={rhs.shape[0]}], got {group_sizes.shape}"
        )
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"grouped_matmul_mgpu: dtypes differ: {lhs.dtype} and {rhs.dtype}")
    tiles = MgpuTiles() if tiles is None else tiles
    why = mgpu_unsupported(lhs.shape, rhs.shape, lhs.dtype, tiles)
    if why is not None:
        raise ValueError(f"grouped_matmul_mgpu: unsupported operands: {why}")
    axes = tuple(sorted(varying_axes(lhs) | varying_axes(rhs) | varying_axes(group_sizes)))
    lhs, rhs, group_sizes = (vary(a, axes) for a in (lhs, rhs, group_sizes))
    M = lhs.shape[0]
    sizes = _clipped_sizes(group_sizes, M)
    # The kernels' TMA tiles need the row count to be a multiple of the row tiles: pad with zero
    # rows past every group (they give zeros and get zero gradient), then crop.
    Mp = _round_up(M, max(tiles.block_m, tiles.block_k, 8))
    out = _gmm_mgpu(_pad_rows(lhs, Mp), rhs, sizes, tiles)
    return out[:M] if Mp != M else out
