"""The gated experts' activations (static and hashable, so they key compiled code): a name of
`ACTIVATIONS`, ``act(gate) * up``, or `ClampedSwiGLU`, gpt-oss's clamped gated unit; `glu` and
`glu_with_grads` compute either from a row's gate and up projections."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from ultraep_jax.base.arguments import check_finite


@jax.custom_jvp
def gelu_exact(x: jax.Array) -> jax.Array:
    """The exact (erf) GELU, ``x * Phi(x)``: `jax.nn.gelu(approximate=False)`'s values, with a
    derivative of elementwise operations only. JAX 0.12 differentiates ``erf`` through a
    `polynomial` primitive whose constant coefficients fail `jax.shard_map`'s varying-axes check
    on a per-device input; this derivative, ``Phi(x) + x * phi(x)``, has no such constants."""
    return jax.nn.gelu(x, approximate=False)


@gelu_exact.defjvp
def _gelu_exact_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    cdf = 0.5 * jax.lax.erfc(-x * (1 / math.sqrt(2)))
    pdf = jnp.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
    return gelu_exact(x), t * (cdf + x * pdf)


#: The gated activations, by name: ``(act(x @ w_gate) * (x @ w_up)) @ w_down``. "silu" is SwiGLU
#: (Llama, Mixtral, DeepSeek, Qwen); "gelu" is GeGLU with the exact (erf) GELU; "gelu_tanh" its
#: tanh approximation (PyTorch's ``approximate="tanh"``); "relu" is ReGLU.
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": gelu_exact,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's gated unit: with ``g = min(gate, limit)`` and ``u = clip(up, -limit, limit)``,
    ``(u + 1) * g * sigmoid(alpha * g)`` (transformers' ``GptOssExperts``, whose config calls
    the two ``swiglu_limit`` and ``swiglu_alpha``). A clamped input passes no gradient (one at
    the bound itself does, as PyTorch's ``clamp``), and a NaN gate or up stays NaN (as through
    PyTorch's ``clamp``), so the output is NaN there.

    Attributes:
      limit: the clamp bound, finite > 0 (7.0 in the released gpt-oss models).
      alpha: the sigmoid's slope, finite > 0 (1.702).
    """

    limit: float = 7.0
    alpha: float = 1.702

    def __post_init__(self):
        for name in ("limit", "alpha"):
            value = check_finite("ClampedSwiGLU", name, getattr(self, name), positive=True)
            object.__setattr__(self, name, value)

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """The unit, elementwise, on gate and up of one shape."""
        # Selects, not jnp.clip: the gradient passes where the input is inside the bounds, the
        # bounds included (jnp.minimum would split it at a tie). Each replaces only an input past
        # a bound, so a NaN (past none) passes through, as PyTorch's clamp keeps it.
        g = jnp.where(gate > self.limit, self.limit, gate)
        u = jnp.where(up > self.limit, self.limit, jnp.where(up < -self.limit, -self.limit, up))
        return (u + 1) * g * jax.nn.sigmoid(self.alpha * g)


def check_activation(activation, caller: str = "MoE") -> None:
    """Raises ValueError (one line prefixed by ``caller``) unless ``activation`` is a name of
    `ACTIVATIONS` or a `ClampedSwiGLU`."""
    if isinstance(activation, ClampedSwiGLU):
        return
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(
            f"{caller}: activation must be one of {tuple(ACTIVATIONS)} or a ClampedSwiGLU, "
            f"got {activation!r}"
        )


def glu(activation, gate: jax.Array, up: jax.Array) -> jax.Array:
    """The gated unit's output, elementwise: ``act(gate) * up`` for a name of `ACTIVATIONS`, the
    clamped unit for a `ClampedSwiGLU`."""
    if isinstance(activation, ClampedSwiGLU):
        return activation(gate, up)
    return ACTIVATIONS[activation](gate) * up


def glu_with_grads(
    activation, gate: jax.Array, up: jax.Array, dh: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(h, d_gate, d_up), elementwise: `glu` and its gradients w.r.t. gate and up for the output
    cotangent ``dh`` (a hand-written backward pass's)."""
    if isinstance(activation, ClampedSwiGLU):
        h, vjp = jax.vjp(activation, gate, up)
        return (h, *vjp(dh.astype(h.dtype)))
    act, d_act = jax.jvp(ACTIVATIONS[activation], (gate,), (jnp.ones_like(gate),))
    return act * up, dh * up * d_act, dh * act
