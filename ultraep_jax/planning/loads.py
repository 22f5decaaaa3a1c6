"""The exact loads of a call: each (token, choice) pair's expert, the per-expert counts, their
all-gather over the EP axis, and the plan that keeps every expert's tokens on its master.

An expert id outside [0, E) (or a masked token's) belongs to no expert: it is written E here, once,
and every later stage sends such a pair nowhere and counts it in no load.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ultraep_jax._vma import vary, varying_axes
from ultraep_jax.base.layout import Layout
from ultraep_jax.planning.plan_type import Plan


def pair_experts(
    experts: jax.Array, num_experts: int, mask_T: jax.Array | None = None
) -> jax.Array:
    """int32 [N]: each pair's expert from ``experts`` [T, K] (any shape), E (no expert) for an id
    outside [0, E) or a token that ``mask_T`` [T] marks False; the range is checked before the
    cast, so a wide id cannot wrap into it."""
    ok = (experts >= 0) & (experts < num_experts)
    if mask_T is not None:
        ok = ok & mask_T.reshape(mask_T.shape + (1,) * (experts.ndim - 1))
    return jnp.where(ok, experts, num_experts).astype(jnp.int32).reshape(-1)


def expert_loads(
    experts: jax.Array, num_experts: int, mask_T: jax.Array | None = None
) -> jax.Array:
    """int32 [E]: (token, choice) pairs routed to each expert, from ``experts`` [T, K] (any
    shape); ids outside [0, E) and masked tokens' pairs count for no expert (`pair_experts`:
    they become E, which the scatter drops)."""
    e = pair_experts(experts, num_experts, mask_T)
    return jnp.zeros((num_experts,), jnp.int32).at[e].add(1, mode="drop")


def gathered_loads(
    experts_N: jax.Array, masked: jax.Array, num_experts: int, axis_name: str | None
) -> tuple[jax.Array, jax.Array]:
    """(loads int32 [R, E], masked tokens int32 [R]) of the EP group: this rank's counts of
    ``experts_N`` [N] and ``masked`` [] all-gathered over ``axis_name`` (R = 1 when None), typed
    invariant over it: every rank of the group holds the same matrix, so the plan and the stats
    derived from it are too."""
    local = jnp.append(expert_loads(experts_N, num_experts), masked)
    if axis_name is None:
        gathered = local[None]
    else:
        gathered = jax.lax.all_gather(local, axis_name, to="invarying")
    return gathered[:, :-1], gathered[:, -1]


def masters_only_plan(loads: jax.Array) -> Plan:
    """The plan without balancing: every expert's tokens stay on its master (S = 0), typed
    varying as the loads are (as `planner.plan`'s)."""
    R = loads.shape[0]
    load_E = jnp.sum(loads, axis=0, dtype=jnp.int32)
    empty_RS = jnp.zeros((R, 0), jnp.int32)
    plan = Plan(empty_RS, empty_RS, load_E, Layout.of(loads).master_loads(load_E))
    return jax.tree.map(lambda a: vary(a, varying_axes(loads)), plan)
