"""`grouped_matmul_mgpu`: `gmm_pallas.grouped_matmul`'s function through JAX's own Hopper kernels
written in Pallas' Mosaic GPU backend (``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`` and
``transposed_ragged_dot_mgpu``: TMA loads and wgmma, a persistent grid), with the same VJP
(bf16/f16 only; Hopper only; no interpreter).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ultraep_jax._vma import vary, varying_axes
from ultraep_jax.experts.gmm_pallas import group_bounds, pad_to, round_up


class MgpuTiles(NamedTuple):
    """Tile settings of JAX's Mosaic GPU ragged-dot kernels (see `grouped_matmul_mgpu`).

    The defaults were the fastest forward + backward of those timed on an H100 (bf16, K=7168,
    N=2048, G=8, M=32768; experiments/results/gpu_h100.txt): 5 pipeline stages, column tiles
    traversed in groups of 4 (grid_block_n=1 was 1.7x slower)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 5
    grid_block_n: int = 4


def mgpu_unsupported(lhs_shape, rhs_shape, dtype, tiles: MgpuTiles | None = None) -> str | None:
    """Why `grouped_matmul_mgpu` cannot take these operands (None: it can): the dtype must be
    bf16/f16, and K, N must be multiples of the tiles (the kernels do not pad)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (needs bfloat16 or float16)"
    (_, K), (_, _, N) = lhs_shape, rhs_shape
    t = MgpuTiles() if tiles is None else tiles
    for name, dim, tile in (
        ("K", K, t.block_k),  # forward: K in block_k chunks
        ("N", N, t.block_k),  # d_lhs: N in block_k chunks
        ("N", N, t.block_n),  # forward columns, d_rhs columns
        ("K", K, t.block_m),  # d_rhs rows
    ):
        if dim % tile:
            return f"{name}={dim} is not a multiple of {tile}"
    return None


def is_hopper() -> bool:
    """Whether JAX's default device is an NVIDIA GPU of compute capability 9.x."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def _clipped_sizes(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    starts, ends = group_bounds(group_sizes, num_rows)
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
    """`grouped_matmul` through JAX's Hopper (Mosaic GPU) ragged-dot kernels, differentiable.

    Same semantics as `grouped_matmul` (rows past ``sum(group_sizes)`` give zeros, a sum above M
    is clipped to M), for bf16/f16 operands of one dtype on an H100/H200; K and N must be
    multiples of the tiles (`mgpu_unsupported` says why not). Accumulates in float32; the
    result has the operands' dtype.
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
    Mp = round_up(M, max(tiles.block_m, tiles.block_k, 8))
    out = _gmm_mgpu(pad_to(lhs, 0, Mp), rhs, sizes, tiles)
    return out[:M] if Mp != M else out
