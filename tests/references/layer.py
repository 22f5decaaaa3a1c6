"""The dense one-device MoE layer the layer's tests compare against: the router's weights
(`routing.router_weights`) of a given choice of experts, then the dense MoE
(`moe.reference_moe`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tests.references.moe import HIGHEST, reference_moe
from tests.references.routing import Router, router_weights

#: The parameters of the routed experts and of the shared expert, in `reference_moe`'s order.
EXPERT_NAMES = ("w_gate", "w_up", "w_down")
BIAS_NAMES = ("b_gate", "b_up", "b_down")
SHARED_NAMES = ("shared_gate", "shared_up", "shared_down")


# Compiled (see `reference_moe`); the router's settings, `shared` and the activation decide the
# program.
@functools.partial(jax.jit, static_argnames=("router", "shared", "activation"))
def reference_layer(
    x, params, experts, router: Router, *, keep=None, shared: bool = False, activation="silu"
):
    """float32 [B, L, D]: the dense MoE of ``x`` [B, L, D] for the choice ``experts`` [T, k]
    (T = B x L) with ``router``'s weights from the logits ``x @ params["router_kernel"]``
    (`HIGHEST`), plus ``params["router_logit_bias"]`` [E] when it is there; the experts' biases
    when ``params`` holds `BIAS_NAMES`, and ``activation`` (`moe.gated`); ``keep`` (optional,
    [T, k] of 0/1) drops (token, choice) pairs; ``shared`` adds the shared expert (``params``
    then holds `SHARED_NAMES`, and ``shared_expert_gate`` [D, 1] when it is gated)."""
    xt = x.reshape(-1, x.shape[-1])
    logits = jnp.dot(xt, params["router_kernel"], precision=HIGHEST)
    if "router_logit_bias" in params:
        logits = logits + params["router_logit_bias"]
    weights = router_weights(logits, experts, router)
    names = EXPERT_NAMES + (BIAS_NAMES if BIAS_NAMES[0] in params else ())
    y = reference_moe(
        xt,
        experts,
        weights,
        tuple(params[n] for n in names),
        keep,
        activation=activation,
        shared=tuple(params[n] for n in (*SHARED_NAMES, "shared_expert_gate") if n in params)
        if shared
        else None,
    )
    return y.reshape(x.shape)
