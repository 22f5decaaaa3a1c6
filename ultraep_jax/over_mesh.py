"""`routed_experts`: the balanced expert-parallel MoE over a whole mesh, from global arrays.

It runs one `jax.shard_map` over the mesh (tokens split over the token axes, experts over the EP
axis, their hidden width over the tensor axis if any) around the per-device core,
`core.routed_experts_local`, which a codebase that already runs its own `shard_map` calls
directly.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ultraep_jax.checks import check_call_inputs
from ultraep_jax.config import ExpertParallel
from ultraep_jax.core import routed_experts_local
from ultraep_jax.sharding import place, with_auto_axes
from ultraep_jax.stats import MoEStats


def routed_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    params: tuple[jax.Array, ...],
    ep: ExpertParallel,
    token_mask: jax.Array | None = None,
) -> tuple[jax.Array, MoEStats]:
    """Routed gated experts over the mesh, balanced by the plan of this call's exact loads.

    Args:
      x: [..., D] tokens (e.g. [batch, seq, D]); the T tokens are split over ``ep.token_axes``
        (padded with masked tokens when T is not a multiple of their device count).
      experts: int [..., K], each token's experts, in [0, E). Concrete ids of real tokens (an
        eager call) are checked (under `jax.distributed`, each process checks those on its own
        devices); traced ids (under `jit`) cannot be without a trip to the host,
        so there a pair whose id is outside [0, E) is skipped: it contributes nothing to y (nor
        gradients), is in no expert's load, and is counted in ``MoEStats.invalid``.
      weights: [..., K], each choice's weight (float32 recommended; any router's output). The
        weight of a pair that reaches no expert is selected out, never multiplied by zero: NaN
        or inf there reaches neither y nor a gradient.
      params: (w_gate [E, D, F], w_up [E, D, F], w_down [E, F, D]), of one dtype (placed by
        ``ep.weight_specs``; F divisible by the tensor axis's size with a ``tensor_axis``),
        optionally followed by the experts' biases (b_gate [E, F], b_up [E, F], b_down [E, D],
        of the same dtype, placed by ``ep.bias_specs``): expert e then computes
        ``glu(x @ w_gate[e] + b_gate[e], x @ w_up[e] + b_up[e]) @ w_down[e] + b_down[e]``
        (gpt-oss's experts), and a replica carries its expert's biases with its weights.
      ep: where and how the experts run.
      token_mask: bool [...] (x's leading shape), True for a real token; None: all real. Masked
        tokens (padding) are routed nowhere: in no load, plan or capacity, 0 in y and in every
        gradient, counted in ``MoEStats.masked``.

    Returns:
      y [..., D] in x's dtype and sharding, ``sum_j weights[..., j] * expert_{experts[..., j]}(x)``
      (0 for masked tokens), and the call's `MoEStats`. Differentiable in x, weights and params.
    """
    check_call_inputs(x, experts, weights, params, ep, token_mask)
    return with_auto_axes(_moe_call, (ep,), x, experts, weights, token_mask, *params)


def _padded(a, pad: int, value):
    """``a`` [T, ...] with ``pad`` more rows of ``value``."""
    if not pad:
        return a
    return jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=value)


def routed_over_mesh(ep: ExpertParallel, x, experts, weights, token_mask, *params):
    """`routed_experts` without its entry wrapper (the input checks, the Explicit-axes typing,
    the `jit`): the tokens padded to the token devices, placed, and one `shard_map` over the mesh
    around `routed_experts_local`. For a caller that has that wrapper already (`layer.MoE`)."""
    lead, D, K = x.shape[:-1], x.shape[-1], experts.shape[-1]
    T = math.prod(lead)
    pad = -T % ep.token_devices
    mask = token_mask
    if mask is None and pad:
        mask = jnp.ones(lead, bool)
    tokens = (
        _padded(x.reshape(T, D), pad, 0),
        _padded(experts.reshape(T, K), pad, 0),
        _padded(weights.reshape(T, K), pad, 0),
    )
    mask = None if mask is None else _padded(mask.reshape(T), pad, False)
    token, n = ep.token_spec, len(params)
    param_specs = ep.weight_specs + (ep.bias_specs if n > 3 else ())
    args = [place(a, NamedSharding(ep.mesh, token)) for a in tokens]
    args += [place(w, NamedSharding(ep.mesh, s)) for w, s in zip(params, param_specs, strict=True)]
    if mask is not None:
        args.append(place(mask, NamedSharding(ep.mesh, token)))

    def shard(x, experts, weights, *rest):
        params, mask = tuple(rest[:n]), (rest[n] if len(rest) > n else None)
        return routed_experts_local(x, experts, weights, params, ep, mask)

    in_specs = (token,) * 3 + param_specs + ((token,) if mask is not None else ())
    # The stats are typed invariant over the token axes (`core`), so they leave as they are.
    y, stats = jax.shard_map(shard, mesh=ep.mesh, in_specs=in_specs, out_specs=(token, P()))(*args)
    if pad:
        stats = dataclasses.replace(stats, masked=stats.masked - pad)
    return y[:T].reshape(*lead, D), stats


# Jitted so that a call outside `jax.jit` compiles once per shape, not op by op on every call;
# inside a jitted step it is inlined.
_moe_call = jax.jit(routed_over_mesh, static_argnums=0)
