"""`MoE`: the Flax NNX layer: a router, the routed experts over the mesh (`over_mesh`), shared
experts."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ultraep_jax.base.arguments import check_positive_int
from ultraep_jax.checks import check_call_inputs, check_chunks, check_dtype
from ultraep_jax.config import BalancerConfig, ExpertParallel
from ultraep_jax.experts.dense import dense_glu
from ultraep_jax.ideal import force_balanced
from ultraep_jax.over_mesh import routed_over_mesh
from ultraep_jax.routers import (
    Routing,
    SigmoidTopK,
    SoftmaxTopK,
    TopKSoftmax,
    router_logits,
    update_bias,
)
from ultraep_jax.sharding import explicit_sharding, place, with_auto_axes
from ultraep_jax.stats import MoEStats


class RouterBias(nnx.Variable):
    """A router's per-expert selection bias: state, not a trained parameter (`SigmoidTopK`)."""


def _checked_router(router, top_k: int, num_experts: int):
    """``router`` (``SoftmaxTopK(top_k)`` when None), checked against the layer's ``top_k`` and
    ``num_experts``; raises one line otherwise."""
    if top_k > num_experts:
        raise ValueError(f"MoE: top_k={top_k} exceeds num_experts={num_experts}")
    router = SoftmaxTopK(top_k) if router is None else router
    if not isinstance(router, (SoftmaxTopK, TopKSoftmax, SigmoidTopK)):
        raise TypeError(
            f"MoE: router must be SoftmaxTopK, TopKSoftmax or SigmoidTopK, got {router!r}"
        )
    if router.top_k != top_k:
        raise ValueError(f"MoE: router.top_k={router.top_k} differs from top_k={top_k}")
    router.check_experts(num_experts)
    return router


def _expert_parallel(*args, **options) -> ExpertParallel:
    """`ExpertParallel(*args, **options)`, its one-line errors naming `MoE`, the entry the user
    called, rather than the configuration it builds."""
    try:
        return ExpertParallel(*args, **options)
    except (ValueError, TypeError) as err:
        message = str(err)
        if not message.startswith("ExpertParallel:"):
            raise
        raise type(err)("MoE:" + message.removeprefix("ExpertParallel:")) from None


class MoE(nnx.Module):
    """A top-k MoE layer of gated experts (SwiGLU by default), expert-parallel over ``mesh``,
    optionally balanced.

    Args:
      d_model: D, the token width.
      d_ff: F, each expert's hidden width (divisible by the tensor axis's size with a
        ``tensor_axis``).
      num_experts: E; must be divisible by the size of the EP axis.
      top_k: experts per token, 1 <= top_k <= E.
      mesh, balancer, capacity_factor: see `ExpertParallel` (the layer keeps one as
        ``self.ep``).
      router: a router of `ultraep_jax.routers` with this ``top_k`` (default
        ``SoftmaxTopK(top_k)``; `TopKSoftmax` is gpt-oss's). With `SigmoidTopK` the layer keeps
        a `RouterBias` ``router_bias`` [E]; call `update_router_bias` with each step's stats to
        move it.
      router_logit_bias: the router's logits are ``x @ router_kernel + router_logit_bias``, a
        trained parameter [E] (replicated, initialised to 0) that moves both the choice and the
        weights (gpt-oss's router, a Linear with a bias; unlike `RouterBias`, which only steers
        `SigmoidTopK`'s choice and is no parameter). Default False.
      expert_bias: every routed expert has biases, ``b_gate``, ``b_up`` [E, F] and ``b_down``
        [E, D] (initialised to 0), and computes ``glu(x @ w_gate + b_gate, x @ w_up + b_up) @
        w_down + b_down`` (gpt-oss's experts; the down bias weighted by the routing weight as the
        rest of the expert's output). They are split as the weights are
        (`ExpertParallel.bias_specs`), and a replica carries its expert's biases as it carries
        the weights. Default False.
      shared_d_ff: hidden width of an always-on SwiGLU expert every token goes through beside
        the routed ones (DeepSeek's shared expert; 0: none). Its weights are replicated and it
        runs outside the expert exchange, so XLA may overlap the two.
      shared_expert_gate: the shared expert's output multiplied by ``sigmoid(x @ g)`` per token,
        with ``g`` the parameter ``shared_expert_gate`` [D, 1] (replicated; Qwen2-MoE's gated
        shared expert). Default False; needs ``shared_d_ff``.
      force_balanced: the force-balanced ideal, a timing reference that changes the model's
        math: the router's choices replaced by an even assignment (`ideal.force_balanced`), its
        weights kept; only with ``balancer=None``. Default False.
      param_dtype: dtype of the parameters (router math is float32 whatever it is).
      rngs: initialisation randomness.
      **ep_options: more `ExpertParallel` keywords, with its defaults: ``expert_axis``,
        ``token_axes``, ``tensor_axis`` (the axis splitting the experts' hidden width),
        ``execution`` (an `Execution`) or its fields as keywords:
        ``activation`` ("silu", "gelu", "gelu_tanh", "relu", or a `ClampedSwiGLU`: gpt-oss's
        clamped unit; the shared expert uses it too),
        ``comm_backend``, ``expert_kernel``, ``transfer_chunks`` (at most ``d_ff``) and
        ``planner`` ("auto", "native" or "portable").

    Parameters: ``router_kernel`` [D, E] (replicated); ``w_gate``, ``w_up`` [E, D, F] and
    ``w_down`` [E, F, D], split over the EP axis (and F over the ``tensor_axis``, if any:
    `ExpertParallel.weight_specs`); with shared experts ``shared_gate``,
    ``shared_up`` [D, F_s] and ``shared_down`` [F_s, D] (replicated); with the options above
    ``shared_expert_gate`` [D, 1] and ``router_logit_bias`` [E] (replicated), and ``b_gate``,
    ``b_up`` [E, F] and ``b_down`` [E, D] (`ExpertParallel.bias_specs`).

    Calling it on x [batch, seq, D] (optionally with ``token_mask`` bool [batch, seq], True for
    a real token) returns ``(y, stats)``: y [batch, seq, D] (0 at masked tokens, which are
    routed nowhere and count in no load, loss or gradient) and a `MoEStats` whose ``aux_loss``
    and ``z_loss`` are the router's over the real tokens (add them to the loss to use them).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        top_k: int,
        mesh,
        balancer: BalancerConfig | None = None,
        capacity_factor: float | None = 1.25,
        *,
        router: SoftmaxTopK | TopKSoftmax | SigmoidTopK | None = None,
        router_logit_bias: bool = False,
        expert_bias: bool = False,
        shared_d_ff: int = 0,
        shared_expert_gate: bool = False,
        force_balanced: bool = False,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
        **ep_options,
    ):
        d_model, d_ff, top_k = (
            check_positive_int("MoE", name, value)
            for name, value in (("d_model", d_model), ("d_ff", d_ff), ("top_k", top_k))
        )
        self.ep = _expert_parallel(mesh, num_experts, balancer, capacity_factor, **ep_options)
        check_chunks("MoE", self.ep, self.ep.local_d_ff(d_ff, "MoE"))
        num_experts = self.ep.num_experts
        router = _checked_router(router, top_k, num_experts)
        shared_d_ff = check_positive_int("MoE", "shared_d_ff", shared_d_ff, minimum=0)
        flags = dict(
            router_logit_bias=router_logit_bias,
            expert_bias=expert_bias,
            shared_expert_gate=shared_expert_gate,
        )
        for name, value in flags.items():
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"MoE: {name} must be a bool, got {value!r}")
        self.router_logit_biased, self.expert_biased = bool(router_logit_bias), bool(expert_bias)
        if shared_expert_gate and not shared_d_ff:
            raise ValueError("MoE: shared_expert_gate=True gates a shared expert: set shared_d_ff")
        self.shared_expert_gated = bool(shared_expert_gate)
        self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, num_experts, top_k
        self.router, self.shared_d_ff = router, shared_d_ff
        if not isinstance(force_balanced, bool):
            raise TypeError(f"MoE: force_balanced must be a bool, got {force_balanced!r}")
        if force_balanced and self.ep.active_balancer is not None:
            raise ValueError(
                "MoE: force_balanced=True is the ideal a balancer is measured against: pass "
                "balancer=None with it (no planner, no replica)"
            )
        self.force_balanced = force_balanced
        self._init_params(rngs, param_dtype)

    def _init_params(self, rngs: nnx.Rngs, param_dtype) -> None:
        """The router kernel, the experts (split over the EP and tensor axes), and when the
        configuration has them the router bias, the router's logit bias, the experts' biases and
        the shared expert's weights (see the class docstring)."""

        def param(scale, shape, sharding):
            init = jax.nn.initializers.normal(scale)
            # `place` also under `nnx.vmap` (stacked layers for `nnx.scan`): a sharding constraint
            # batches to the per-layer layout, where `device_put` would split the layer axis.
            return nnx.Param(place(init(rngs.params(), shape, param_dtype), sharding))

        E, D, F = self.num_experts, self.d_model, self.d_ff
        replicated = NamedSharding(self.ep.mesh, P())
        self.router_kernel = param(D**-0.5, (D, E), replicated)
        gate, up, down = self.ep.weight_shardings
        self.w_gate = param(D**-0.5, (E, D, F), gate)
        self.w_up = param(D**-0.5, (E, D, F), up)
        self.w_down = param(F**-0.5, (E, F, D), down)
        if self.router.uses_bias:
            self.router_bias = RouterBias(place(jnp.zeros((E,), jnp.float32), replicated))
        if self.router_logit_biased:
            self.router_logit_bias = nnx.Param(place(jnp.zeros((E,), param_dtype), replicated))
        if self.expert_biased:
            b_gate, b_up, b_down = self.ep.bias_shardings
            self.b_gate = nnx.Param(place(jnp.zeros((E, F), param_dtype), b_gate))
            self.b_up = nnx.Param(place(jnp.zeros((E, F), param_dtype), b_up))
            self.b_down = nnx.Param(place(jnp.zeros((E, D), param_dtype), b_down))
        if self.shared_d_ff:
            Fs = self.shared_d_ff
            self.shared_gate = param(D**-0.5, (D, Fs), replicated)
            self.shared_up = param(D**-0.5, (D, Fs), replicated)
            self.shared_down = param(Fs**-0.5, (Fs, D), replicated)
        if self.shared_expert_gated:
            self.shared_expert_gate = param(D**-0.5, (D, 1), replicated)

    @property
    def mesh(self):
        """The layer's mesh (every axis in Auto mode)."""
        return self.ep.mesh

    def capacity(self, tokens_per_device: int) -> int:
        """Receive-buffer rows per rank for ``tokens_per_device`` tokens on each device."""
        return self.ep.capacity(tokens_per_device, self.top_k)

    def __call__(
        self, x: jax.Array, token_mask: jax.Array | None = None
    ) -> tuple[jax.Array, MoEStats]:
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"MoE: x must be [batch, seq, d_model={self.d_model}], got shape {tuple(x.shape)}"
            )
        if 0 in x.shape:
            raise ValueError(f"MoE: batch and seq must be >= 1, got x of shape {tuple(x.shape)}")
        # Before the router casts x to float32: jax deprecates casting complex to real.
        check_dtype("MoE", "x", x)
        if token_mask is not None and (
            getattr(token_mask, "dtype", None) != jnp.bool_ or token_mask.shape != x.shape[:2]
        ):
            raise ValueError(
                f"MoE: token_mask must be bool [batch, seq] = {tuple(x.shape[:2])}, got "
                f"{getattr(token_mask, 'dtype', type(token_mask).__name__)} "
                f"{tuple(getattr(token_mask, 'shape', ()))}"
            )
        experts = (self.w_gate[...], self.w_up[...], self.w_down[...])
        if self.expert_biased:
            experts += (self.b_gate[...], self.b_up[...], self.b_down[...])
        kernel, bias = self._router_args()
        shared = None
        if self.shared_d_ff:
            shared = (self.shared_gate[...], self.shared_up[...], self.shared_down[...])
            if self.shared_expert_gated:
                shared += (self.shared_expert_gate[...],)
        statics = (self.ep, self.router, self.force_balanced)
        return with_auto_axes(_forward, statics, x, token_mask, kernel, bias, experts, shared)

    def _router_args(self) -> tuple[tuple, jax.Array | None]:
        """The router's inputs beside x: (``(router_kernel,)`` or ``(router_kernel,
        router_logit_bias)``, ``router_bias`` or None)."""
        kernel = (self.router_kernel[...],)
        if self.router_logit_biased:
            kernel += (self.router_logit_bias[...],)
        return kernel, (self.router_bias[...] if self.router.uses_bias else None)

    def route(self, x: jax.Array, token_mask: jax.Array | None = None) -> Routing:
        """Each token's experts and weights, as the layer's router chooses them in `__call__`
        (the same computation; the choice, before any balancing: a replica computes its
        expert's output, so the choice is the model's).

        Args:
          x: [..., D] tokens (any leading axes: [batch, seq, D] as `__call__` takes).
          token_mask: optional bool [...], True for a real token (as in `__call__`: a masked
            token counts in no loss; its choice is still returned).

        Returns a `Routing`: ``experts`` int32 [..., K] (best first), ``weights`` float32
        [..., K] (what each chosen expert's output is weighted by), and the router's
        ``aux_loss`` and ``z_loss`` []; on x's Explicit mesh, replicated, when x has one."""
        if x.ndim < 1 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"MoE: x must be [..., d_model={self.d_model}], got shape {tuple(x.shape)}"
            )
        kernel, bias = self._router_args()
        route = functools.partial(_route_jit, self.router)
        if (typed := explicit_sharding(x)) is not None:
            route = jax.sharding.auto_axes(route, out_sharding=NamedSharding(typed.mesh, P()))
        return route(x, token_mask, kernel, bias)

    def update_router_bias(self, stats: MoEStats) -> None:
        """Moves the `SigmoidTopK` bias by `routers.update_bias` from ``stats.expert_load`` (a
        call's stats; call it once per training step, outside the gradient)."""
        if not self.router.uses_bias:
            raise ValueError(f"MoE: the router {self.router!r} has no bias to update")
        rate = self.router.bias_rate
        # Stats of a call on x typed by the user's mesh (Explicit axes, as from `jax.make_mesh`)
        # carry that mesh; the bias lives on the layer's Auto-axes copy: put the load there.
        load = jax.device_put(stats.expert_load, NamedSharding(self.mesh, P()))
        self.router_bias[...] = update_bias(self.router_bias[...], load, rate)


def _route(router, x, token_mask, router_kernel, bias) -> Routing:
    """``router``'s decision for x [..., D] (``router_kernel``: (kernel,) or (kernel, logit
    bias)), its experts and weights [..., K]."""
    *lead, D = x.shape
    mask_T = None if token_mask is None else token_mask.reshape(-1)
    routing = router(router_logits(x.reshape(-1, D), *router_kernel), bias, mask_T)
    shape = (*lead, router.top_k)
    experts, weights = routing.experts.reshape(shape), routing.weights.reshape(shape)
    return dataclasses.replace(routing, experts=experts, weights=weights)


_route_jit = jax.jit(_route, static_argnums=0)


# Jitted so that the layer called outside `jax.jit` compiles once per shape; inlined in a step.
@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _forward(ep, router, ideal, x, token_mask, router_kernel, bias, experts, shared):
    with jax.named_scope("route"):
        routing = _route(router, x, token_mask, router_kernel, bias)
    ids, weights = routing.experts, routing.weights
    if ideal:
        with jax.named_scope("force_balanced"):
            ids = force_balanced(ids, ep, token_mask)
    # The layer's one entry wrapper is `__call__`'s (`with_auto_axes` and this jit): the routed
    # experts run here without `routed_experts`' own.
    check_call_inputs(x, ids, weights, experts, ep, token_mask)
    y, stats = routed_over_mesh(ep, x, ids, weights, token_mask, *experts)
    if shared is not None:
        with jax.named_scope("shared_experts"):
            s = dense_glu(x, *shared[:3], activation=ep.execution.activation)
            if len(shared) == 4:  # Qwen2-MoE's gate: sigmoid(x @ g) [B, L, 1] per token
                s = s * jax.nn.sigmoid(jnp.dot(x, shared[3].astype(x.dtype))).astype(s.dtype)
            y = y + (s if token_mask is None else jnp.where(token_mask[..., None], s, 0))
    return y, dataclasses.replace(stats, aux_loss=routing.aux_loss, z_loss=routing.z_loss)
