"""Placing arrays on the layer's mesh, and running the layer on arrays typed by an Explicit mesh."""

from __future__ import annotations

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def place(a, sharding):
    """``a`` on ``sharding``: `jax.device_put` for a concrete array, a sharding constraint for a
    traced one (inside `jit`, `vmap`, ...)."""
    if isinstance(a, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(a, sharding)
    return jax.device_put(a, sharding)


def explicit_sharding(x) -> NamedSharding | None:
    """The sharding ``x`` is typed with when it is a traced value on a mesh with Explicit axes
    (as from `jax.make_mesh`), else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if isinstance(x, jax.core.Tracer) and AxisType.Explicit in getattr(mesh, "axis_types", ()):
        return sharding
    return None


def with_auto_axes(fn, x, *args):
    """``fn(x, *args)`` -> (y shaped like x, stats). When ``x`` carries Explicit sharding types,
    ``fn`` runs with those axes in Auto mode and y comes back typed with x's sharding, the stats
    replicated; a concrete ``x`` on a `NamedSharding` gets y on that sharding."""
    typed = explicit_sharding(x)
    if typed is not None:
        out = (typed, NamedSharding(typed.mesh, P()))
        return jax.sharding.auto_axes(fn, out_sharding=out)(x, *args)
    y, stats = fn(x, *args)
    if not isinstance(x, jax.core.Tracer) and isinstance(x.sharding, NamedSharding):
        y = jax.device_put(y, x.sharding)
    return y, stats
