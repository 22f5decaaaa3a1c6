"""Small array helpers shared across the package (the argument checks are
`base.arguments`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def exclusive_cumsum(x: jax.Array, axis: int) -> jax.Array:
    """Sums of the entries before each one along ``axis`` (0 for the first)."""
    return jnp.cumsum(x, axis=axis) - x
