"""The dense one-device MoE the layer's tests compare against, and the precision of every
reference's matmuls."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ultraep_jax.base.activations import ACTIVATIONS

#: The matmul precision of every reference (exact float32 products on every backend).
HIGHEST = jax.lax.Precision.HIGHEST


def gated(activation, gate, up):
    """The gated unit, elementwise: ``act(gate) * up`` with the library's activation of that
    name (`ultraep_jax.base.activations.ACTIVATIONS`), or, for a `ClampedSwiGLU` (only its
    ``limit`` and ``alpha`` read), gpt-oss's unit as transformers' ``GptOssExperts._apply_gate``
    writes it: gate clamped above at the limit, up to [-limit, limit], then ``(up + 1) * gate *
    sigmoid(alpha * gate)``."""
    if isinstance(activation, str):
        return ACTIVATIONS[activation](gate) * up
    limit, alpha = activation.limit, activation.alpha
    gate, up = jnp.clip(gate, None, limit), jnp.clip(up, -limit, limit)
    return (up + 1) * gate / (1 + jnp.exp(-alpha * gate))


# Compiled: called op by op, each operation (and each of its gradient's) compiles on its own.
@functools.partial(jax.jit, static_argnames="activation")
def reference_moe(
    x, experts, weights, params, keep=None, *, mask=None, activation="silu", shared=None
):
    """float32 [..., D]: ``sum_j keep * weights[..., j] * glu_{experts[..., j]}(x)``, plus the
    shared expert's ``glu(x)`` when ``shared`` is given, and 0 at the tokens ``mask`` leaves out.

    ``x`` [..., D] and ``experts``, ``weights`` [..., k] (the same leading shape); ``params``
    (w_gate [E, D, F], w_up [E, D, F], w_down [E, F, D]), optionally followed by the experts'
    biases (b_gate [E, F], b_up [E, F], b_down [E, D]; zeros when left out); ``glu_e(x) =
    gated(x @ w_gate[e] + b_gate[e], x @ w_up[e] + b_up[e]) @ w_down[e] + b_down[e]`` with
    `gated` of ``activation``. Each pair runs on its own expert's weights
    (gathered, so an expert no pair chooses is never read); pairs with ``keep`` [..., k] False
    are selected out (ids outside [0, E) are clipped first, then unused). ``mask`` [...]: the
    real tokens; a masked token's pairs are selected out too. ``shared``: (gate [D, F_s], up
    [D, F_s], down [F_s, D]), the always-on expert with the same activation (no biases), and
    optionally its gate g [D, 1] (its output times ``sigmoid(x @ g)``). Everything in float32,
    every matmul at `HIGHEST`.
    """
    f32 = lambda a: jnp.asarray(a).astype(jnp.float32)  # noqa: E731
    x, weights = f32(x), f32(weights)
    w_gate, w_up, w_down = (f32(w) for w in params[:3])
    E, F, D = w_gate.shape[0], w_gate.shape[-1], x.shape[-1]
    zeros = (jnp.zeros((E, F)), jnp.zeros((E, F)), jnp.zeros((E, D)))
    b_gate, b_up, b_down = (f32(b) for b in params[3:]) if len(params) > 3 else zeros
    if keep is None:
        keep = jnp.ones(weights.shape, bool)
    if mask is not None:
        keep = jnp.logical_and(keep, jnp.asarray(mask)[..., None])
    e = jnp.clip(experts, 0, E - 1)
    gate = jnp.einsum("...d,...kdf->...kf", x, w_gate[e], precision=HIGHEST) + b_gate[e]
    up = jnp.einsum("...d,...kdf->...kf", x, w_up[e], precision=HIGHEST) + b_up[e]
    h = gated(activation, gate, up)
    out = jnp.einsum("...kf,...kfd->...kd", h, w_down[e], precision=HIGHEST) + b_down[e]
    y = jnp.sum(jnp.where(keep, weights, 0)[..., None] * out, axis=-2)
    if shared is not None:
        s_gate, s_up, s_down = (f32(w) for w in shared[:3])
        h = gated(
            activation, jnp.dot(x, s_gate, precision=HIGHEST), jnp.dot(x, s_up, precision=HIGHEST)
        )
        s = jnp.dot(h, s_down, precision=HIGHEST)
        if len(shared) == 4:
            g = jnp.dot(x, f32(shared[3]), precision=HIGHEST)
            s = s / (1.0 + jnp.exp(-g))
        y = y + s
    return y if mask is None else jnp.where(jnp.asarray(mask)[..., None], y, 0)
