"""Placing arrays on the layer's mesh, and running the layer on arrays typed by an Explicit mesh."""

from __future__ import annotations

import functools

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
    """The sharding ``x`` is typed with when it lives on a mesh with Explicit axes (as from
    `jax.make_mesh`), traced or concrete, else None."""
    if isinstance(x, jax.core.Tracer):
        sharding = getattr(jax.typeof(x), "sharding", None)
    else:
        sharding = getattr(x, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if AxisType.Explicit in getattr(mesh, "axis_types", ()):
        return sharding
    return None


def with_auto_axes(fn, statics: tuple, x, *args):
    """``fn(*statics, x, *args)`` -> (y shaped like x, stats), ``statics`` hashable. When ``x`` is
    on a mesh with Explicit axes, ``fn`` runs with those axes in Auto mode and y comes back with
    x's sharding, the stats replicated; a concrete ``x`` on a `NamedSharding` gets y on that
    sharding."""
    if explicit_sharding(x) is not None:
        if isinstance(x, jax.core.Tracer):
            return _auto_axes_call(fn, statics, x, *args)
        # One compiled program per configuration and input types, not one per eager call.
        return _jitted_auto_axes_call(fn, statics)(x, *args)
    y, stats = fn(*statics, x, *args)
    if not isinstance(x, jax.core.Tracer) and isinstance(
        getattr(x, "sharding", None), NamedSharding
    ):
        y = jax.device_put(y, x.sharding)
    return y, stats


def _auto_axes_call(fn, statics: tuple, x, *args):
    typed = explicit_sharding(x)
    out = (typed, NamedSharding(typed.mesh, P()))
    return jax.sharding.auto_axes(functools.partial(fn, *statics), out_sharding=out)(x, *args)


@functools.cache
def _jitted_auto_axes_call(fn, statics: tuple):
    return jax.jit(functools.partial(_auto_axes_call, fn, statics))
