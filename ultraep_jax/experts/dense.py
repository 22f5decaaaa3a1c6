"""`dense_glu`: one gated expert on every token (a shared expert)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
    ``activation``, for a name ``act(gate) * up``), in x's dtype. As in the routed experts'
    kernels, the products are float32, the gated unit is computed in float32 and rounded to x's
    dtype for the down matmul."""
    check_activation(activation)
    f32 = jnp.float32
    gate = jnp.dot(x, w_gate.astype(x.dtype), preferred_element_type=f32)
    up = jnp.dot(x, w_up.astype(x.dtype), preferred_element_type=f32)
    h = glu(activation, gate, up).astype(x.dtype)
    return jnp.dot(h, w_down.astype(x.dtype), preferred_element_type=f32).astype(x.dtype)
