"""The summary statistics (median, p90, max, min, mean) the programs state of per-layer values."""

from __future__ import annotations


def summary(values, stats=("median", "p90", "max", "min", "mean")) -> dict:
    """The ``stats`` (median, p90, max, min, mean) of per-layer ``values``, as floats."""
    import numpy as np

    v = np.asarray(values, np.float64)
    every = {
        "median": np.median,
        "p90": lambda a: np.percentile(a, 90),
        "max": np.max,
        "min": np.min,
        "mean": np.mean,
    }
    return {k: float(every[k](v)) for k in stats}
