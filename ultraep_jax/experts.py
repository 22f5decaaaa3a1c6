"""The experts: SwiGLU feed-forward networks applied to rows grouped by expert."""

from __future__ import annotations

import jax

from ultraep_jax import gmm

KERNELS = ("auto", "ragged_dot", "pallas", "mgpu")


def _cuda_auto(lhs, rhs, group_sizes):
    """The CUDA choice of "auto": JAX's Hopper (Mosaic GPU) ragged-dot kernels on an H100/H200
    when the operands suit them, else our Pallas (Triton) kernel."""
    if (
        gmm.is_hopper()
        and lhs.dtype == rhs.dtype
        and not gmm.mgpu_unsupported(lhs.shape, rhs.shape, lhs.dtype)
    ):
        return gmm.grouped_matmul_mgpu(lhs, rhs, group_sizes)
    return gmm.grouped_matmul(lhs, rhs, group_sizes)


def _grouped(lhs, rhs, group_sizes, kernel: str):
    """``ragged_dot(lhs, rhs, group_sizes)`` by the chosen implementation; "auto" takes
    `_cuda_auto` on CUDA and `jax.lax.ragged_dot` elsewhere, per platform at lowering."""
    if kernel == "ragged_dot":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)
    if kernel == "pallas":
        return gmm.grouped_matmul(lhs, rhs, group_sizes)
    if kernel == "mgpu":
        return gmm.grouped_matmul_mgpu(lhs, rhs, group_sizes)
    if kernel != "auto":
        raise ValueError(f"unknown expert kernel {kernel!r}; expected one of {KERNELS}")
    return jax.lax.platform_dependent(
        lhs, rhs, group_sizes, cuda=_cuda_auto, default=jax.lax.ragged_dot
    )


def swiglu_experts(
    rows: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    group_sizes: jax.Array,
    kernel: str = "auto",
) -> jax.Array:
    """[C, D]: ``(silu(x @ w_gate[g]) * (x @ w_up[g])) @ w_down[g]`` for each row's group g.

    Args:
      rows: [C, D], grouped: the first ``group_sizes[0]`` rows belong to group 0, and so on;
        rows past ``sum(group_sizes)`` give zeros.
      w_gate, w_up: [G, D, F]; w_down: [G, F, D].
      group_sizes: int32 [G].
      kernel: grouped-matmul implementation, one of `KERNELS`.
    """
    gate = _grouped(rows, w_gate, group_sizes, kernel)
    up = _grouped(rows, w_up, group_sizes, kernel)
    out = _grouped(jax.nn.silu(gate) * up, w_down, group_sizes, kernel)
    return out.astype(rows.dtype)
