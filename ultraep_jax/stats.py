"""Load statistics."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def imbalance(rank_load) -> jax.Array:
    """max / mean over the last axis of per-rank loads ``[..., R]``; 1.0 where the total is 0."""
    load = jnp.asarray(rank_load, jnp.float32)
    mean = jnp.mean(load, axis=-1)
    return jnp.where(mean > 0, jnp.max(load, axis=-1) / jnp.where(mean > 0, mean, 1.0), 1.0)


def master_rank_load(expert_load_E: jax.Array, ep_size: int) -> jax.Array:
    """int32 [R]: pairs each rank's master experts received (expert ``e`` on rank
    ``e // (E / R)``), from ``expert_load_E`` [E]."""
    return jnp.sum(expert_load_E.reshape(ep_size, -1), axis=1, dtype=jnp.int32)
