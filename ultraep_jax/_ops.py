"""Small helpers shared across the package."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np


def exclusive_cumsum(x: jax.Array, axis: int) -> jax.Array:
    """Sums of the entries before each one along ``axis`` (0 for the first)."""
    return jnp.cumsum(x, axis=axis) - x


def check_positive_int(owner: str, name: str, value, minimum: int = 1) -> int:
    """``value`` as a Python int; raises ValueError (one line naming ``owner.name``) unless it is
    an integer >= ``minimum`` (Python or NumPy; a bool is not one)."""
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, numbers.Integral)
        or value < minimum
    ):
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{owner}: {name} must be {kind}, got {value!r}")
    return int(value)


def check_finite(owner: str, name: str, value, *, positive: bool) -> float:
    """``value`` as a Python float; raises ValueError (one line naming ``owner.name``) unless it
    is a finite real number (Python or NumPy; a bool is not one), > 0 if ``positive`` else >= 0."""
    ok = (
        not isinstance(value, (bool, np.bool_))
        and isinstance(value, numbers.Real)
        and math.isfinite(value)
        and (value > 0 if positive else value >= 0)
    )
    if not ok:
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{owner}: {name} must be a finite number {bound}, got {value!r}")
    return float(value)
