"""shard_map's "varies across devices" typing, across JAX versions."""

from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
    """Mesh axes over which shard_map's type system says ``x`` varies."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax 0.10
    return mat.varying if mat is not None else frozenset(getattr(aval, "vma", ()))


def vary(x, axes):
    """Marks ``x`` as varying over ``axes`` (a no-op at run time)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x
