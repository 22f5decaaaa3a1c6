"""Router: top-k expert choice per token, and the expert loads it produces."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(x: jax.Array, router_kernel: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Top-k routing with renormalised weights.

    Args:
      x: [T, D] tokens.
      router_kernel: [D, E].
      top_k: choices per token.

    Returns:
      experts: int32 [T, k], the chosen experts in descending probability.
      weights: float32 [T, k], softmax probabilities of those experts renormalised to sum 1.
    """
    logits = jnp.dot(x.astype(jnp.float32), router_kernel.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts.astype(jnp.int32), weights


def expert_loads(experts: jax.Array, num_experts: int) -> jax.Array:
    """int32 [E]: (token, choice) pairs routed to each expert, from ``experts`` [T, k]."""
    return jnp.zeros((num_experts,), jnp.int32).at[experts.reshape(-1)].add(1)
