"""The gated experts' activations, by name (static and hashable, so they key compiled code)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

#: The gated activations, by name: ``(act(x @ w_gate) * (x @ w_up)) @ w_down``. "silu" is SwiGLU
#: (Llama, Mixtral, DeepSeek, Qwen); "gelu" is GeGLU with the exact (erf) GELU; "gelu_tanh" its
#: tanh approximation (PyTorch's ``approximate="tanh"``); "relu" is ReGLU.
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
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
