"""`dense_glu`: one gated expert on every token (a shared expert)."""

from __future__ import annotations

import jax

from ultraep_jax.base.activations import check_activation, glu


def dense_glu(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    activation="silu",
) -> jax.Array:
    """[..., D]: one gated expert on every token: ``glu(x @ w_gate, x @ w_up) @ w_down`` with
    w_gate, w_up [D, F] and w_down [F, D] (a shared expert; ``glu``: `activations.glu` of
    ``activation``, for a name ``act(gate) * up``)."""
    check_activation(activation)
    h = glu(activation, x @ w_gate.astype(x.dtype), x @ w_up.astype(x.dtype))
    return h @ w_down.astype(x.dtype)
