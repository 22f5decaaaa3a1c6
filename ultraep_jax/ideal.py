"""The force-balanced ideal: a timing reference, not a model.

`force_balanced` replaces a router's choices by an assignment under which every expert and every
EP rank gets the same number of pairs (to within one where the pairs do not divide evenly), with
the same pairs per token, the same shapes, buffers, kernels and collectives as the real layer, and
the router's own weights (so the backward pass does the same work). Run with ``balancer=None`` it
is the step a perfect balancer with no cost would give: the reference of "% of the
force-balanced ideal". It changes what the model computes: use it to time, never to train.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ultraep_jax.config import ExpertParallel


def even_experts(real_T: jax.Array, top_k: int, num_experts: int, ep_size: int) -> jax.Array:
    """int32 [T, K]: an even assignment of the real tokens' pairs to experts.

    The real tokens' pairs, numbered ``p = 0, 1, ...`` in token order, cycle over the experts so
    that consecutive pairs go to consecutive EP ranks: pair ``p`` goes to rank ``p % R``, to its
    master ``(p // R) % E_m``. So any run of P consecutive pairs gives each expert ``floor(P / E)``
    or ``ceil(P / E)`` of them and each rank ``floor(P / R)`` or ``ceil(P / R)``, and a token's K
    pairs (K <= E) go to K distinct experts.

    Args:
      real_T: bool [T], True for a real token (padding takes no pair).
      top_k: K.
      num_experts, ep_size: E and R (R divides E).
    """
    E_m = num_experts // ep_size
    first_T = jnp.cumsum(real_T.astype(jnp.int32)) * top_k - top_k * real_T.astype(jnp.int32)
    p_TK = (first_T[:, None] + jnp.arange(top_k, dtype=jnp.int32)) % num_experts
    return (p_TK % ep_size) * E_m + (p_TK // ep_size) % E_m


def force_balanced(
    experts: jax.Array, ep: ExpertParallel, token_mask: jax.Array | None = None
) -> jax.Array:
    """The force-balanced ideal's experts for a call of `routed_experts` with ``ep``: int32
    [..., K], experts' shape, from `even_experts` over the tokens in their global order.

    Tokens are split over the devices in contiguous blocks (``ep.token_spec``), so each device
    and, when the mesh lists the data axes before the EP axis, each EP group holds a contiguous
    run of the cycle: exactly equal loads when each device's real pairs are a multiple of E
    (every expert and rank the same), else within one pair of equal per expert and per rank of
    each EP group. Only the ids change: pass the router's weights with them.

    Args:
      experts: int [..., K], the router's choices (only the shape is used).
      ep: the `ExpertParallel` the call runs with.
      token_mask: bool [...] (experts' leading shape), True for a real token; None: all real.
    """
    K = experts.shape[-1]
    if K > ep.num_experts:
        raise ValueError(
            f"force_balanced: top_k={K} exceeds num_experts={ep.num_experts} (a token's "
            "choices must be distinct experts)"
        )
    lead = experts.shape[:-1]
    real = jnp.ones(lead, bool) if token_mask is None else token_mask
    ids = even_experts(real.reshape(-1), K, ep.num_experts, ep.ep_size)
    return ids.reshape(experts.shape).astype(jnp.int32)
