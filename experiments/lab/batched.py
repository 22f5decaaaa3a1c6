"""The library's planner and replica-transfer schedule batched over many load or held-expert
matrices (``jit(vmap(...))``, cached per configuration), for the programs that plan or schedule
many layers at once. JAX and ultraep_jax are imported inside the functions.
"""

from __future__ import annotations

import functools


@functools.cache
def batched_planner(cfg, capacity: int | None = None):
    """``jax.jit(jax.vmap(uep.plan))`` for one ``BalancerConfig`` and receive buffer of
    ``capacity`` rows (None: unbounded): plans ``[N, R, E]`` int32 loads in one call, on the
    device the loads are on. Cached per config and capacity."""
    import jax

    import ultraep_jax as uep

    return jax.jit(jax.vmap(lambda loads: uep.plan(loads, cfg, capacity=capacity)))


@functools.cache
def batched_transfer(ep_size: int, experts_per_rank: int, max_fanout: int):
    """``jit(vmap(...))`` of the replica transfer of held-expert matrices ``[N, R, C]`` (each
    rank's instances of experts it does not master, -1 elsewhere: a plan's ``slot_expert``)
    under the relay bound ``max_fanout`` (0: direct; `replicas.relay`). Returns int32 [N]
    each: the busiest rank's copies sent, the transfer's length in copies (each hop as long as
    its busiest link, sending or receiving, summed over hops) and the hops it took."""
    import jax
    import jax.numpy as jnp

    from ultraep_jax import tools

    hops = tools.static_hops(ep_size, max_fanout)

    def one(held_RC):
        schedule = tools.relay_schedule(held_RC, experts_per_rank, max_fanout)
        sent_HR, received_HR = tools.hop_copies(schedule, hops)
        length = jnp.sum(jnp.maximum(sent_HR.max(axis=1), received_HR.max(axis=1)))
        return jnp.max(tools.send_copies(schedule)), length, jnp.max(schedule.hop_RS)

    return jax.jit(jax.vmap(one))


@functools.cache
def batched_schedule(ep_size: int, experts_per_rank: int, max_fanout: int, domain_size=None):
    """``jit(vmap(...))`` of the relay schedule (`replicas.relay.relay_schedule`) of held-expert
    matrices ``[N, R, C]`` (as `batched_transfer` takes them) under the relay bound
    ``max_fanout`` and fast domains of ``domain_size`` ranks (None: one domain). Returns its
    ``hop_RS`` and ``sender_RS``, int32 [N, R, C] each."""
    import jax

    from ultraep_jax import tools

    def one(held_RC):
        schedule = tools.relay_schedule(held_RC, experts_per_rank, max_fanout, domain_size)
        return schedule.hop_RS, schedule.sender_RS

    return jax.jit(jax.vmap(one))
