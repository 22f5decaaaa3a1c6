"""`export`: `jax.export.export` with "auto" resolved for the platforms exported for."""

from __future__ import annotations

import functools

import jax

from ultraep_jax.config import resolve


def export(fun_jit, *, platforms, **kwargs):
    """`jax.export.export(fun_jit, platforms=platforms, **kwargs)`, whose returned function
    traces ``fun_jit`` with "auto" resolved for ``platforms`` (`config.resolve.lowering_for`),
    not for the devices of the mesh it was built on: a step on CPU devices exported for TPU
    carries TPU's expert kernel and exchange; for several platforms, each platform's, picked when
    the program runs. (The planner is resolved for each platform it is lowered for in any case.)

    Without it, "auto" follows the mesh's devices, and lowering that program for another
    platform raises one line naming this function.

    Args:
      fun_jit: a `jax.jit`-wrapped function, as `jax.export.export` takes.
      platforms: the platforms to export for: "cpu", "cuda" (or "gpu"), "rocm", "tpu"; one
        line names an unknown one.
      **kwargs: `jax.export.export`'s other arguments (``disabled_checks``).

    Returns:
      ``(*args, **kwargs) -> jax.export.Exported``, as `jax.export.export` returns.
    """
    targets = resolve.target_platforms(platforms)
    exporter = jax.export.export(fun_jit, platforms=targets, **kwargs)

    @functools.wraps(exporter)
    def traced(*args, **kw):
        with resolve.lowering_for(targets):
            return exporter(*args, **kw)

    return traced
