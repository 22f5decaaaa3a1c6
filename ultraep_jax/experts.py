"""The experts: SwiGLU feed-forward networks applied to rows grouped by expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ultraep_jax import gmm
from ultraep_jax._ops import exclusive_cumsum
from ultraep_jax.tiled_experts import tiled_swiglu_parts

KERNELS = ("auto", "tiled", "ragged_dot", "pallas", "mgpu")


def dense_swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """[..., D]: one SwiGLU expert on every token: ``(silu(x @ w_gate) * (x @ w_up)) @ w_down``
    with w_gate, w_up [D, F] and w_down [F, D] (a shared expert)."""
    h = jax.nn.silu(x @ w_gate.astype(x.dtype)) * (x @ w_up.astype(x.dtype))
    return h @ w_down.astype(x.dtype)


def _cuda_grouped(lhs, rhs, group_sizes):
    """The CUDA grouped matmul of "auto": JAX's Hopper (Mosaic GPU) ragged-dot kernels on an
    H100/H200 when the operands suit them, else our Pallas (Triton) kernel."""
    if (
        gmm.is_hopper()
        and lhs.dtype == rhs.dtype
        and not gmm.mgpu_unsupported(lhs.shape, rhs.shape, lhs.dtype)
    ):
        return gmm.grouped_matmul_mgpu(lhs, rhs, group_sizes)
    return gmm.grouped_matmul(lhs, rhs, group_sizes)


def _grouped(lhs, rhs, group_sizes, kernel: str):
    """``ragged_dot(lhs, rhs, group_sizes)`` by the chosen matmul implementation."""
    if kernel == "pallas":
        return gmm.grouped_matmul(lhs, rhs, group_sizes)
    if kernel == "mgpu":
        return gmm.grouped_matmul_mgpu(lhs, rhs, group_sizes)
    if kernel == "cuda":
        return _cuda_grouped(lhs, rhs, group_sizes)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def _matmul_swiglu(rows, w_gate, w_up, w_down, group_sizes, first_row, kernel: str):
    """SwiGLU as three grouped matmuls over groups laid out from row 0; rows from ``first_row``
    are rotated to the front and back (the grouped matmuls know no row offset). The rotation is a
    dynamic roll (slices), whose transpose is another roll: a gather would transpose to a slow
    scatter-add."""
    shifted = first_row is not None
    if shifted:
        rows = jnp.roll(rows, -first_row, axis=0)
    gate = _grouped(rows, w_gate, group_sizes, kernel)
    up = _grouped(rows, w_up, group_sizes, kernel)
    out = _grouped(jax.nn.silu(gate) * up, w_down, group_sizes, kernel).astype(rows.dtype)
    if shifted:
        out = jnp.roll(out, first_row, axis=0)
    return out


def _tiled(rows, parts, group_sizes, first_row):
    sizes = group_sizes.astype(jnp.int32)
    start = exclusive_cumsum(sizes, 0) + (0 if first_row is None else first_row)
    return tiled_swiglu_parts(rows, parts, start, sizes)


def swiglu_experts(
    rows: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    group_sizes: jax.Array,
    kernel: str = "auto",
    first_row: jax.Array | None = None,
) -> jax.Array:
    """[C, D]: ``(silu(x @ w_gate[g]) * (x @ w_up[g])) @ w_down[g]`` for each row's group g.

    Args:
      rows: [C, D]. The groups are consecutive from row ``first_row`` (0 when None): the first
        ``group_sizes[0]`` rows from there belong to group 0, and so on; rows in no group give
        zeros.
      w_gate, w_up: [G, D, F]; w_down: [G, F, D].
      group_sizes: int32 [G].
      kernel: one of `KERNELS`: "tiled" (`tiled_experts`: a loop over row tiles whose cost tracks
        the rows present), "ragged_dot" (`jax.lax.ragged_dot`; a masked dense product on CPU),
        "pallas" (the Pallas/Triton kernel of `ultraep_jax.gmm`), "mgpu" (JAX's Hopper Mosaic GPU
        kernels), or "auto": on CUDA Mosaic GPU on Hopper where the shapes suit it, else Pallas;
        tiled elsewhere; chosen per platform at lowering time.
      first_row: int32 [], where the groups start.
    """
    args = (rows, w_gate, w_up, w_down, group_sizes, first_row)

    def tiled():
        return _tiled(rows, [(w_gate, w_up, w_down)], group_sizes, first_row)

    if kernel == "tiled":
        return tiled()
    if kernel in ("ragged_dot", "pallas", "mgpu"):
        return _matmul_swiglu(*args, kernel)
    if kernel != "auto":
        raise ValueError(f"unknown expert kernel {kernel!r}; expected one of {KERNELS}")
    return jax.lax.platform_dependent(cuda=lambda: _matmul_swiglu(*args, "cuda"), default=tiled)


def local_experts(
    rows: jax.Array,
    masters: tuple[jax.Array, jax.Array, jax.Array],
    replicas: tuple[jax.Array, jax.Array, jax.Array] | None,
    group_sizes: jax.Array,
    kernel: str = "auto",
) -> jax.Array:
    """[C, D]: every received row through its local instance: the E_m masters' groups first,
    then the S replica slots' groups.

    Args:
      rows: [C, D], grouped by local instance from row 0.
      masters: (w_gate, w_up [E_m, D, F], w_down [E_m, F, D]), this rank's master experts.
      replicas: the same for the S slots ([S, ...]), or None when there are no slots.
      group_sizes: int32 [E_m + S].
      kernel: see `swiglu_experts`.

    The tiled kernel runs masters and slots as one loop over both weight stacks (on a CPU nothing
    can overlap, and one loop has half the fixed cost; concatenating the stacks cost 3 % of a
    forward pass). The matmul kernels run them as two calls, so that the masters' work does not
    wait for the replica weights to arrive.
    """
    em = masters[0].shape[0]
    if replicas is None:
        return swiglu_experts(rows, *masters, group_sizes, kernel)

    def one_loop():
        return _tiled(rows, [masters, replicas], group_sizes, None)

    def two_calls(matmul_kernel):
        out = _matmul_swiglu(rows, *masters, group_sizes[:em], None, matmul_kernel)
        first = jnp.sum(group_sizes[:em])
        return out + _matmul_swiglu(rows, *replicas, group_sizes[em:], first, matmul_kernel)

    if kernel == "tiled":
        return one_loop()
    if kernel in ("ragged_dot", "pallas", "mgpu"):
        return two_calls(kernel)
    if kernel != "auto":
        raise ValueError(f"unknown expert kernel {kernel!r}; expected one of {KERNELS}")
    return jax.lax.platform_dependent(cuda=lambda: two_calls("cuda"), default=one_loop)
