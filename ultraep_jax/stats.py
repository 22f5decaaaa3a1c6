"""Load statistics."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def imbalance(rank_load) -> jax.Array:
    """max / mean over the last axis of per-rank loads ``[..., R]``; 1.0 where the total is 0."""
    load = jnp.asarray(rank_load, jnp.float32)
    mean = jnp.mean(load, axis=-1)
    return jnp.where(mean > 0, jnp.max(load, axis=-1) / jnp.where(mean > 0, mean, 1.0), 1.0)
