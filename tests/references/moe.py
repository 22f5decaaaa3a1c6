"""The dense one-device MoE the layer's tests compare against, and the precision of every
reference's matmuls."""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: The matmul precision of every reference (exact float32 products on every backend).
HIGHEST = jax.lax.Precision.HIGHEST


def reference_moe(x, experts, weights, params, keep):
    """[B, L, D]: ``sum_j keep * weights[..., j] * swiglu_{experts[..., j]}(x)``, each pair on its
    own expert's weights (gathered, so an expert no pair chooses is never read); pairs with
    ``keep`` False are selected out (ids outside [0, E) are clipped first, then unused)."""
    w_gate, w_up, w_down = params
    E = w_gate.shape[0]
    e = jnp.clip(experts, 0, E - 1)
    gate = jnp.einsum("bld,blkdf->blkf", x, w_gate[e], precision=HIGHEST)
    up = jnp.einsum("bld,blkdf->blkf", x, w_up[e], precision=HIGHEST)
    out = jnp.einsum("blkf,blkfd->blkd", jax.nn.silu(gate) * up, w_down[e], precision=HIGHEST)
    return jnp.sum(jnp.where(keep, weights, 0)[..., None] * out, axis=2)
