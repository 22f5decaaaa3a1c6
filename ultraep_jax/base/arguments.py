"""One-line checks of the values a user gives (ints, finite numbers), each naming the value as
its message shows it; the library's configuration and the programs around it (through
`ultraep_jax.tools`) use the same ones."""

from __future__ import annotations

import math
import numbers

import numpy as np

#: The largest value of an int64 (what the native planner's integer attributes are).
INT64_MAX = 2**63 - 1


def check_int(name: str, value, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as a Python int. Raises TypeError unless it is an integer (Python or NumPy; a
    bool is not one, nor is a float such as 2.0) and ValueError unless ``minimum <= value <=
    maximum``; each one line naming ``name`` as the message shows it ("MoE: top_k",
    "BalancerConfig.max_fanout", "--batch_size")."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {kind}, got {value}")
    if maximum is not None and value > maximum:
        bound = "fit in int64 (<= 2**63 - 1)" if maximum == INT64_MAX else f"be <= {maximum}"
        raise ValueError(f"{name} must {bound}, got {value}")
    return value


def check_positive_int(owner: str, name: str, value, minimum: int = 1) -> int:
    """`check_int` of ``owner: name`` (TypeError for a non-integer, ValueError below
    ``minimum``)."""
    return check_int(f"{owner}: {name}", value, minimum)


def check_finite(owner: str, name: str, value, *, positive: bool) -> float:
    """``value`` as a Python float; raises (one line naming ``owner: name``) TypeError unless it
    is a real number (Python or NumPy; a bool or a str is not one), and ValueError unless it is
    finite and > 0 if ``positive`` else >= 0."""
    bound = "> 0" if positive else ">= 0"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{owner}: {name} must be a finite number {bound}, got {type(value).__name__} {value!r}"
        )
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise ValueError(f"{owner}: {name} must be a finite number {bound}, got {value!r}")
    return float(value)
