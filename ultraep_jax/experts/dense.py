"""`dense_glu`: one gated expert on every token (a shared expert)."""

from __future__ import annotations

import jax

from ultraep_jax.base.activations import activation_fn


def dense_glu(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    activation: str = "silu",
) -> jax.Array:
    """[..., D]: one gated expert on every token: ``(act(x @ w_gate) * (x @ w_up)) @ w_down``
    with w_gate, w_up [D, F] and w_down [F, D] (a shared expert)."""
    act = activation_fn(activation)
    h = act(x @ w_gate.astype(x.dtype)) * (x @ w_up.astype(x.dtype))
    return h @ w_down.astype(x.dtype)
