"""`grouped_matmul_tokamax`: ``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` (float32 products)
through tokamax's ragged dot (openxla/tokamax, the ``tokamax`` extra: Python >= 3.12, jax >=
0.11.1), forward and both transposed products inside our `custom_vjp`, each with the
implementation of the platform the program is traced for, never the host's.

tokamax picks an implementation from the host's default device when asked for none (a CUDA
export from a CPU host would silently get its XLA one), and refuses "mosaic" on a CPU host, so
the implementation is always named here (`implementations`), from the platform the resolver
resolved (`config.resolve`) and the mesh's device kind:

- TPU: "mosaic_tpu" (its Pallas Mosaic TPU kernel: TPU v5 and later, K and N >= 128,
  `base.operands.mosaic_tpu_unsupported`) for the forward product, d_lhs (the same kernel, rhs
  read transposed) and d_rhs (its transposed kernel); other operands "xla". Its rows are padded
  with zero rows (`_tpu_rows`) to a count that every row tile it may pick divides. It lowers on a
  CPU host inside a mesh whose abstract device is that TPU.
- CUDA: "mosaic_gpu" (its Pallas Mosaic GPU kernels) forward and d_lhs; d_rhs needs its Hopper
  transposed kernel, so on Ampere and Blackwell d_rhs runs its "xla" implementation
  (`jax.lax.ragged_dot_general`). Its kernels pick their variant and grid from JAX's default
  device when lowered (`base.operands.default_device`), so they lower only where that is a GPU
  of the mesh's kind: on the GPU host, or on any host within ``jax.default_device`` of one of
  the mesh's devices (a compile-only GPU serves); elsewhere `config.resolve` refuses them.
- CPU and every other platform: "xla", which equals `jax.lax.ragged_dot`, values and gradients.

Rows past ``sum(group_sizes)`` give zeros (the Mosaic kernels leave them unwritten).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ultraep_jax._vma import vary, varying_axes
from ultraep_jax.base import operands

#: lhs [M, K] x rhs [G, K, N] -> [M, N]: the forward product.
FORWARD = jax.lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [0], [0])
#: d_out [M, N] x rhs [G, K, N] -> d_lhs [M, K]: rhs read transposed.
D_LHS = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])
#: lhs [M, K] x d_out [M, N] -> d_rhs [G, K, N]: the groups along the contracted rows.
D_RHS = jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], [])


def implementations(platform: str | None, lhs_shape, rhs_shape, device_kind: str | None):
    """tokamax's implementation of (forward, d_lhs, d_rhs) for these operands on ``platform``
    (module docstring)."""
    if platform == "tpu" and operands.mosaic_tpu_unsupported(lhs_shape, rhs_shape, device_kind):
        return ("xla",) * 3
    if platform == "tpu":
        return ("mosaic_tpu",) * 3
    if platform == "cuda":
        # Its Mosaic GPU weight-gradient (ragged contracting) kernel exists for Hopper only, and
        # picks its variant from JAX's default device (as tokamax reads it).
        hopper = operands.is_hopper_gpu(operands.default_device())
        return ("mosaic_gpu", "mosaic_gpu", "mosaic_gpu" if hopper else "xla")
    return ("xla",) * 3


def _ragged_dot(lhs, rhs, sizes, dims, implementation: str, out_dtype):
    """One tokamax ragged dot, its result typed varying as its operands are."""
    import tokamax

    axes = tuple(sorted(varying_axes(lhs) | varying_axes(rhs) | varying_axes(sizes)))
    lhs, rhs, sizes = (vary(a, axes) for a in (lhs, rhs, sizes))
    kwargs = {}
    if axes and implementation != "xla":  # a Pallas call inside shard_map states its type
        kwargs["manual_axis_type"] = jax.sharding.ManualAxisType(varying=frozenset(axes))
    out = tokamax.ragged_dot_general(
        lhs,
        rhs,
        sizes,
        dims,
        preferred_element_type=out_dtype,
        implementation=implementation,
        **kwargs,
    )
    return vary(out, axes)


def _zero_rows_past(out: jax.Array, sizes: jax.Array) -> jax.Array:
    rows = jax.lax.broadcasted_iota(jnp.int32, out.shape, 0)
    return jnp.where(rows < jnp.sum(sizes), out, jnp.zeros_like(out))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(lhs, rhs, sizes, impls: tuple[str, str, str]):
    out = _ragged_dot(lhs, rhs, sizes, FORWARD, impls[0], jnp.float32)
    return _zero_rows_past(out, sizes)


def _gmm_fwd(lhs, rhs, sizes, impls):
    return _gmm(lhs, rhs, sizes, impls), (lhs, rhs, sizes)


def _gmm_bwd(impls, res, d_out):
    lhs, rhs, sizes = res
    d_out = _zero_rows_past(d_out, sizes).astype(lhs.dtype)
    d_lhs = _zero_rows_past(_ragged_dot(d_out, rhs, sizes, D_LHS, impls[1], lhs.dtype), sizes)
    d_rhs = _ragged_dot(lhs, d_out, sizes, D_RHS, impls[2], rhs.dtype)
    return d_lhs, d_rhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def grouped_matmul_tokamax(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    platform: str | None,
    device_kind: str | None = None,
) -> jax.Array:
    """float32 [M, N]: ``jax.lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G])``
    through tokamax, differentiable, with the implementations of ``platform`` (the resolved
    platform the program is traced for; None: "xla") on devices of ``device_kind``
    (`implementations`)."""
    impls = implementations(platform, lhs.shape, rhs.shape, device_kind)
    lhs, rhs, group_sizes = _typed_alike(lhs, rhs, group_sizes.astype(jnp.int32))
    M = lhs.shape[0]
    rows = _tpu_rows(M) if impls[0] == "mosaic_tpu" else M
    padded = jnp.pad(lhs, ((0, rows - M), (0, 0))) if rows != M else lhs
    out = _gmm(padded, rhs, group_sizes, impls)
    return out[:M] if rows != M else out


def _typed_alike(*operands) -> tuple:
    """``operands``, each typed varying over every axis any of them varies over, cast before
    `_gmm`'s `custom_vjp`: its rule gives each cotangent the type of the products, which vary as
    all operands together (weights invariant over "data" against rows varying over it, say), and
    a cotangent must have its primal's type. The cast's transpose (a psum of the weights'
    cotangent over the extra axes) then runs outside the rule, where the cast is; a caller inside
    a branch chosen by a plan casts before the branch (`replicas.streaming`), and this cast is a
    no-op there. Returning cotangents of the primals' types instead would put that psum in the
    rule, inside any such branch: a collective that groups taking the other branch never reach."""
    axes = frozenset().union(*map(varying_axes, operands))
    return tuple(vary(a, tuple(sorted(axes))) for a in operands)


def _tpu_rows(M: int) -> int:
    """The rows the Mosaic TPU kernel gets for M: it needs them divisible by its row tile (128 by
    default; from min(M, 1024) halved to multiples of 128 by its TPU7x heuristics), so a power
    of two from 128 up to 1024, then a multiple of 1024. The padding rows are past every group:
    zeros, with zero gradient."""
    if M > 1024:
        return -(-M // 1024) * 1024
    return max(128, 1 << (M - 1).bit_length())
