"""Reroute: how many of each source rank's tokens go to each instance of each expert.

Instances are the E masters, then the R*S spare slots (`base.layout`). Every rank computes
the same counts from the same all-gathered loads and plan, so no rank needs to tell another what it
will send.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ultraep_jax.base.layout import Layout
from ultraep_jax.planning.plan_type import Plan


def _interval_overlap(lo_a, hi_a, lo_b, hi_b):
    return jnp.maximum(jnp.minimum(hi_a, hi_b) - jnp.maximum(lo_a, lo_b), 0)


def reroute_counts(loads: jax.Array, plan: Plan) -> jax.Array:
    """int32 [R, E + R*S]: pairs that source rank r sends to each instance.

    Locality first: a source that hosts an instance of expert e fills it from its own tokens
    (up to the instance's quota) before anything crosses the network. The remainder is matched
    in a fixed order: sources 0..R-1 against the expert's instances in instance order, as the
    overlaps of their prefix-sum intervals, so every instance gets exactly its quota and every
    source sends exactly its load.

    Args:
      loads: int32 [R, E], the all-gathered loads the plan was made from.
      plan: the plan of ``loads`` (``slot_expert`` [R, S], ``slot_quota`` [R, S],
        ``master_quota`` [E]).
    """
    R, E = loads.shape
    layout = Layout.of(loads, plan.slot_expert)
    inst_expert = layout.instance_experts(plan.slot_expert)  # [I]
    valid = inst_expert >= 0
    e_of = jnp.where(valid, inst_expert, 0)
    quota = jnp.where(valid, jnp.concatenate([plan.master_quota, plan.slot_quota.reshape(-1)]), 0)
    host = layout.instance_ranks()

    # Locality: source r hosts at most one instance of each expert (no rank holds one twice).
    hosted = (host[None, :] == jnp.arange(R)[:, None]) & valid[None, :]  # [R, I]
    want = loads[:, e_of]  # [R, I]: r's load for the instance's expert
    local = jnp.where(hosted, jnp.minimum(want, quota[None, :]), 0)
    src_left = loads - jnp.zeros_like(loads).at[:, e_of].add(local)  # [R, E]
    inst_left = quota - jnp.sum(local, axis=0)  # [I]

    # Fixed-order matching of what is left: prefix sums over sources and over each expert's
    # instances (in instance order), then interval overlaps.
    src_hi = jnp.cumsum(src_left, axis=0)
    src_lo = src_hi - src_left
    per_expert = jax.nn.one_hot(e_of, E, dtype=jnp.int32) * (inst_left * valid)[:, None]  # [I, E]
    inst_hi = jnp.take_along_axis(jnp.cumsum(per_expert, axis=0), e_of[:, None], axis=1)[:, 0]
    inst_lo = inst_hi - inst_left
    remote = _interval_overlap(src_lo[:, e_of], src_hi[:, e_of], inst_lo[None, :], inst_hi[None, :])
    return (local + jnp.where(valid[None, :], remote, 0)).astype(jnp.int32)
