"""Small helpers shared across the package."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def exclusive_cumsum(x: jax.Array, axis: int) -> jax.Array:
    """Sums of the entries before each one along ``axis`` (0 for the first)."""
    return jnp.cumsum(x, axis=axis) - x


def check_positive_int(owner: str, name: str, value) -> None:
    """Raises ValueError (one line naming ``owner.name``) unless ``value`` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")
