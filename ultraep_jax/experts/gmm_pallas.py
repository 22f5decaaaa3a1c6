"""Grouped matrix multiplication (the MoE experts' matmul) as a Pallas kernel, with its VJP.

``grouped_matmul(lhs, rhs, group_sizes)`` has the semantics of
``jax.lax.ragged_dot(lhs, rhs, group_sizes)``: the rows of ``lhs`` [M, K] are grouped
contiguously (the first ``group_sizes[0]`` rows form group 0, and so on); row ``m`` of group ``g``
gives ``lhs[m] @ rhs[g]``; rows past ``sum(group_sizes)`` give zeros.

Design (megablox-style, for MoE shapes: thousands of rows, a few groups): the rows are cut into
tiles of ``tile_m`` rows. Tile metadata computed with `jnp` from ``group_sizes`` (static shapes)
says which groups each row tile overlaps, ``[group_lo[t], group_hi[t])``; the kernel's program
``(t, j)`` loops over those groups, multiplies the tile (rows outside the group masked to zero)
by ``rhs[g][:, j-th column tile]`` over ``K`` in ``tile_k`` chunks and accumulates in float32.
Over all tiles there are at most ``num_tiles + G - 1`` (tile, non-empty group) work items, and
each output tile is written by exactly one program (no atomics, no races). The weight gradient
``d_rhs[g] = lhs_g^T @ d_out_g`` is a second kernel: program ``(g, kk, j)`` loops over the row
tiles that group ``g`` overlaps.

On GPU the kernels lower through Pallas' Triton backend; ``interpret=True`` runs them anywhere
(slowly; used by the CPU tests). Pallas is imported lazily, so importing `ultraep_jax` does not
import Pallas or Triton. `gmm_mgpu` is the same function through JAX's own Hopper kernels.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ultraep_jax._vma import vary, varying_axes
from ultraep_jax.base.arguments import check_int


class _Cfg(NamedTuple):
    """Static kernel settings (hashable: a nondiff argument of the custom VJP)."""

    tile_m: int
    tile_n: int
    tile_k: int
    interpret: bool
    num_warps: int | None
    num_stages: int | None
    out_dtype: jnp.dtype | None = None  # None: the operands' result type


def _check_tile(name: str, value) -> int:
    value = check_int(f"grouped_matmul: {name}", value)
    if value < 16 or value & (value - 1):
        raise ValueError(f"grouped_matmul: {name} must be a power of two >= 16, got {value}")
    return value


def round_up(x: int, m: int) -> int:
    """The least multiple of ``m`` that is >= ``x``."""
    return -(-x // m) * m


def pad_to(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pads ``x`` along ``axis`` to ``size`` (a no-op when already that size)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def group_bounds(group_sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """int32 [G] row ranges ``[starts[g], ends[g])`` of the groups, clipped to ``num_rows``."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)
    ends = jnp.maximum(ends, 0)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def tile_groups(
    starts: jax.Array, ends: jax.Array, num_tiles: int, tile_m: int
) -> tuple[jax.Array, jax.Array]:
    """int32 [num_tiles] ``[group_lo[t], group_hi[t])``: the groups row tile ``t`` overlaps.

    Groups with ``end <= tile_start`` lie before the tile and groups with ``start >= tile_end``
    after it (``starts``/``ends`` are non-decreasing). An empty range means the tile holds no
    grouped row (it is past ``sum(group_sizes)``); empty groups inside the range cost one masked
    pass but contribute nothing.
    """
    tile_start = jnp.arange(num_tiles, dtype=jnp.int32)[:, None] * tile_m
    lo = jnp.sum(ends[None, :] <= tile_start, axis=1, dtype=jnp.int32)
    hi = jnp.sum(starts[None, :] < tile_start + tile_m, axis=1, dtype=jnp.int32)
    return lo, jnp.maximum(hi, lo)


def _compiler_params(cfg: _Cfg):
    # Always Triton's params on GPU: with none, Pallas picks Mosaic GPU (jax's default there).
    if cfg.interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    kwargs = {}
    if cfg.num_warps is not None:
        kwargs["num_warps"] = cfg.num_warps
    if cfg.num_stages is not None:
        kwargs["num_stages"] = cfg.num_stages
    return plgpu.CompilerParams(**kwargs)


def _match_vma(*arrays):
    """``arrays``, each marked as varying over every mesh axis any of them varies over (inside
    `jax.shard_map` Pallas needs the kernel's inputs and outputs to agree); a no-op outside."""
    axes = frozenset().union(*(varying_axes(a) for a in arrays))
    return tuple(vary(a, tuple(sorted(axes))) for a in arrays) if axes else arrays


def _out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """A ShapeDtypeStruct that varies over the mesh axes ``like`` varies over (across the jax
    versions' spellings: ``manual_axis_type`` in 0.10, ``vma`` before)."""
    aval = jax.typeof(like)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
    vma = getattr(aval, "vma", None)
    if vma:
        return jax.ShapeDtypeStruct(shape, dtype, vma=vma)
    return jax.ShapeDtypeStruct(shape, dtype)


def _precision(dtype):
    # float32 inputs: full-precision products (no TF32), as ragged_dot with HIGHEST precision.
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _gmm_kernel(cfg: _Cfg, nk: int, transpose_rhs: bool, precision):
    """The kernel of `_gmm_call`: program ``(t, j)`` accumulates row tile t times column tile j
    of every group the tile overlaps, over K in ``nk`` chunks, in float32, keeping of each
    group's product only the group's rows (a select after the product, not zeroed rows before
    it: 0 * inf in another group's weights would put NaN in this group's rows)."""
    from jax.experimental import pallas as pl

    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k

    def kernel(lo_ref, hi_ref, starts_ref, ends_ref, lhs_ref, rhs_ref, out_ref):
        t, j = pl.program_id(0), pl.program_id(1)
        row0 = pl.multiple_of(t * tm, tm)
        col0 = pl.multiple_of(j * tn, tn)
        rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)

        def group_body(g, acc):
            start, end = starts_ref[g], ends_ref[g]

            def k_body(k, acc):
                k0 = pl.multiple_of(k * tk, tk)
                a = lhs_ref[pl.ds(row0, tm), pl.ds(k0, tk)]
                if transpose_rhs:
                    b = rhs_ref[g, pl.ds(col0, tn), pl.ds(k0, tk)]  # [tn, tk]
                    dims = (((1,), (1,)), ((), ()))
                else:
                    b = rhs_ref[g, pl.ds(k0, tk), pl.ds(col0, tn)]  # [tk, tn]
                    dims = (((1,), (0,)), ((), ()))
                return acc + jax.lax.dot_general(
                    a, b, dims, precision=precision, preferred_element_type=jnp.float32
                )

            part = jax.lax.fori_loop(0, nk, k_body, jnp.zeros((tm, tn), jnp.float32))
            return acc + jnp.where((rows >= start) & (rows < end), part, 0.0)

        acc = jax.lax.fori_loop(lo_ref[t], hi_ref[t], group_body, jnp.zeros((tm, tn), jnp.float32))
        out_ref[pl.ds(row0, tm), pl.ds(col0, tn)] = acc.astype(out_ref.dtype)

    return kernel


def _gmm_call(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    cfg: _Cfg,
    *,
    transpose_rhs: bool,
    out_dtype,
) -> jax.Array:
    """[M, N] = grouped ``lhs [M, K] @ rhs[g]``, with ``rhs`` [G, K, N], or [G, N, K] and
    transposed per group when ``transpose_rhs``."""
    from jax.experimental import pallas as pl

    M, K = lhs.shape
    N = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    Mp, Np, Kp = round_up(M, tm), round_up(N, tn), round_up(K, tk)
    lhs_p = pad_to(pad_to(lhs, 0, Mp), 1, Kp)
    if transpose_rhs:
        rhs_p = pad_to(pad_to(rhs, 1, Np), 2, Kp)
    else:
        rhs_p = pad_to(pad_to(rhs, 1, Kp), 2, Np)
    num_tiles, nk = Mp // tm, Kp // tk
    starts, ends = group_bounds(group_sizes, M)
    group_lo, group_hi = tile_groups(starts, ends, num_tiles, tm)
    precision = _precision(jnp.result_type(lhs.dtype, rhs.dtype))
    args = _match_vma(group_lo, group_hi, starts, ends, lhs_p, rhs_p)
    out = pl.pallas_call(
        _gmm_kernel(cfg, nk, transpose_rhs, precision),
        out_shape=_out_struct((Mp, Np), out_dtype, args[0]),
        grid=(num_tiles, Np // tn),
        interpret=cfg.interpret,
        compiler_params=_compiler_params(cfg),
        name="ultraep_gmm",
    )(*args)
    return out[:M, :N] if (Mp, Np) != (M, N) else out


def _tgmm_call(
    lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, num_groups: int, cfg: _Cfg, out_dtype
) -> jax.Array:
    """[G, K, N]: ``lhs_g^T @ dout_g`` per group (zeros for an empty group), with ``lhs`` [M, K],
    ``dout`` [M, N]."""
    from jax.experimental import pallas as pl

    M, K = lhs.shape
    N = dout.shape[1]
    G = num_groups
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    Mp, Np, Kp = round_up(M, tm), round_up(N, tn), round_up(K, tk)
    lhs_p = pad_to(pad_to(lhs, 0, Mp), 1, Kp)
    dout_p = pad_to(pad_to(dout, 0, Mp), 1, Np)
    starts, ends = group_bounds(group_sizes, M)
    precision = _precision(jnp.result_type(lhs.dtype, dout.dtype))
    args = _match_vma(starts, ends, lhs_p, dout_p)

    def kernel(starts_ref, ends_ref, lhs_ref, dout_ref, out_ref):
        g, kk, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        k0 = pl.multiple_of(kk * tk, tk)
        col0 = pl.multiple_of(j * tn, tn)
        start, end = starts_ref[g], ends_ref[g]
        t_lo = start // tm
        t_hi = jnp.where(end > start, (end + tm - 1) // tm, t_lo)

        def body(t, acc):
            row0 = pl.multiple_of(t * tm, tm)
            rows_k = row0 + jax.lax.broadcasted_iota(jnp.int32, (tm, tk), 0)
            rows_n = row0 + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
            # Both sides selected: 0 * inf (or NaN) in another group's rows of either is NaN.
            a = lhs_ref[pl.ds(row0, tm), pl.ds(k0, tk)]  # [tm, tk]
            a = jnp.where((rows_k >= start) & (rows_k < end), a, jnp.zeros_like(a))
            b = dout_ref[pl.ds(row0, tm), pl.ds(col0, tn)]  # [tm, tn]
            b = jnp.where((rows_n >= start) & (rows_n < end), b, jnp.zeros_like(b))
            return acc + jax.lax.dot_general(
                a,
                b,
                (((0,), (0,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )

        acc = jax.lax.fori_loop(t_lo, t_hi, body, jnp.zeros((tk, tn), jnp.float32))
        out_ref[g, pl.ds(k0, tk), pl.ds(col0, tn)] = acc.astype(out_ref.dtype)

    out = pl.pallas_call(
        kernel,
        out_shape=_out_struct((G, Kp, Np), out_dtype, args[0]),
        grid=(G, Kp // tk, Np // tn),
        interpret=cfg.interpret,
        compiler_params=_compiler_params(cfg),
        name="ultraep_tgmm",
    )(*args)
    return out[:, :K, :N] if (Kp, Np) != (K, N) else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(lhs, rhs, group_sizes, cfg: _Cfg):
    out_dtype = jnp.result_type(lhs.dtype, rhs.dtype) if cfg.out_dtype is None else cfg.out_dtype
    return _gmm_call(lhs, rhs, group_sizes, cfg, transpose_rhs=False, out_dtype=out_dtype)


def _gmm_fwd(lhs, rhs, group_sizes, cfg: _Cfg):
    return _gmm(lhs, rhs, group_sizes, cfg), (lhs, rhs, group_sizes)


def _gmm_bwd(cfg: _Cfg, res, d_out):
    lhs, rhs, group_sizes = res
    # An out_dtype wider than the operands' (float32 products of bf16) gives a cotangent of it:
    # rounded to the operands' type, as the kernels take one type.
    d_out = d_out.astype(jnp.result_type(lhs.dtype, rhs.dtype))
    # d_lhs[m] = d_out[m] @ rhs[g]^T (rows past the total get zero gradient, as they should).
    d_lhs = _gmm_call(d_out, rhs, group_sizes, cfg, transpose_rhs=True, out_dtype=lhs.dtype)
    # d_rhs[g] = lhs_g^T @ d_out_g.
    d_rhs = _tgmm_call(lhs, d_out, group_sizes, rhs.shape[0], cfg, rhs.dtype)
    return d_lhs, d_rhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tile_m: int = 128,
    tile_n: int = 128,
    tile_k: int = 64,
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out_dtype=None,
) -> jax.Array:
    """[M, N]: ``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` as a Pallas kernel (differentiable).

    Args:
      lhs: [M, K], rows grouped contiguously: the first ``group_sizes[0]`` rows belong to group
        0, the next ``group_sizes[1]`` to group 1, and so on; rows past ``sum(group_sizes)``
        give zeros (and get zero gradient).
      rhs: [G, K, N], one matrix per group.
      group_sizes: int [G], non-negative; a sum above M is clipped to M.
      tile_m, tile_n, tile_k: tile sizes (powers of two >= 16); dimensions that are not multiples
        are zero-padded (a copy, so prefer multiples at large shapes).
      interpret: run the kernels in the Pallas interpreter (any backend; slow, for tests).
      num_warps, num_stages: Triton compiler settings (None: Pallas' defaults).
      out_dtype: the result's dtype (None: ``result_type(lhs, rhs)``); float32 keeps bf16
        operands' float32 sums unrounded (the cotangent is rounded to the operands' type in the
        backward kernels).

    Returns:
      [M, N] of dtype ``out_dtype``, accumulated in float32 (float32 inputs use full-precision
      products, no TF32).

    Gradients: ``d_lhs = grouped_matmul(d_out, rhs[g]^T)`` and ``d_rhs[g] = lhs_g^T @ d_out_g``,
    both Pallas kernels; none for ``group_sizes``.
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"grouped_matmul: need lhs [M, K] and rhs [G, K, N], got {lhs.shape} and {rhs.shape}"
        )
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(
            f"grouped_matmul: group_sizes must be [G={rhs.shape[0]}], got {group_sizes.shape}"
        )
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"grouped_matmul: group_sizes must be integer, got {group_sizes.dtype}")
    cfg = _Cfg(
        _check_tile("tile_m", tile_m),
        _check_tile("tile_n", tile_n),
        _check_tile("tile_k", tile_k),
        bool(interpret),
        num_warps,
        num_stages,
        None if out_dtype is None else jnp.dtype(out_dtype),
    )
    # Inside shard_map, give every operand the same "varies over" type, so that the custom VJP's
    # cotangents match its inputs; the implicit broadcast's transpose (a psum) stays outside.
    axes = tuple(sorted(varying_axes(lhs) | varying_axes(rhs) | varying_axes(group_sizes)))
    lhs, rhs, group_sizes = (vary(a, axes) for a in (lhs, rhs, group_sizes))
    return _gmm(lhs, rhs, group_sizes.astype(jnp.int32), cfg)
