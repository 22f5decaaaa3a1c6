"""The gated experts' activations, by name (static and hashable, so they key compiled code)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


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


def activation_fn(name: str):
    """The elementwise function of the activation ``name``; raises one line for an unknown name."""
    if not isinstance(name, str) or name not in ACTIVATIONS:
        raise ValueError(f"MoE: activation must be one of {tuple(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


def value_and_slope(name: str, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(act(x), act'(x)), elementwise, for the activation ``name``."""
    return jax.jvp(ACTIVATIONS[name], (x,), (jnp.ones_like(x),))
