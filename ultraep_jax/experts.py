"""The experts: SwiGLU feed-forward networks applied to rows grouped by expert."""

from __future__ import annotations

import jax


def swiglu_experts(
    rows: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, group_sizes: jax.Array
) -> jax.Array:
    """[C, D]: ``(silu(x @ w_gate[g]) * (x @ w_up[g])) @ w_down[g]`` for each row's group g.

    Args:
      rows: [C, D], grouped: the first ``group_sizes[0]`` rows belong to group 0, and so on;
        rows past ``sum(group_sizes)`` give zeros.
      w_gate, w_up: [G, D, F]; w_down: [G, F, D].
      group_sizes: int32 [G].
    """
    gate = jax.lax.ragged_dot(rows, w_gate, group_sizes)
    up = jax.lax.ragged_dot(rows, w_up, group_sizes)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, group_sizes).astype(rows.dtype)
