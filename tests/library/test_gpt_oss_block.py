"""gpt-oss's MoE block (transformers' ``GptOssMLP``) through `uep.MoE` alone: a router with a
trained logit bias (``router_logit_bias=True``), top-k-then-softmax routing (`uep.TopKSoftmax`),
experts with biases (``expert_bias=True``) and the clamped gated unit (`uep.ClampedSwiGLU`),
against the independent dense references (tests/references), balanced and not.

Each mesh case is one layer program balanced and one plain (value and gradient each), chosen so
that together they take every path a replica's biases travel: ep8 the tiled kernel with masters
and slots in one loop (the padded transfer); dp2ep4 `ragged_dot`, the transfer streamed in two
chunks of F (the down bias with the first only) through the ragged exchange with relays
(``max_fanout=1``); (data 2, expert 2, tensor 2) the gate and up biases split over F, the down
bias added once over the tensor ranks, two chunks, the tiled kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from tests.helpers import (
    assert_raises_one_line,
    build_layer,
    draw_routed_inputs,
    layer_value_and_grads,
    make_mesh,
    padded_exchange,
    place_batch,
)
from tests.references.layer import BIAS_NAMES, EXPERT_NAMES, reference_layer
from tests.references.routing import Router, router_weights, select_experts

D, F, E, K = 8, 8, 8, 2
#: The released models clamp at 7; at these widths 1.5 clamps some gates and ups of every sign.
ACTIVATION = uep.ClampedSwiGLU(limit=1.5, alpha=1.702)
NAMES = ("router_kernel", "router_logit_bias", *EXPERT_NAMES, *BIAS_NAMES)

#: Mesh case -> the layer's options beyond the block's (and whether its transfer is ragged).
CASES = {
    "ep8": {},
    "dp2ep4": {"expert_kernel": "ragged_dot", "transfer_chunks": 2, "comm_backend": "ragged"},
    "dp2ep2tp2": {"tensor_axis": "tensor", "transfer_chunks": 2},
}


def _mesh(kind: str):
    if kind == "dp2ep2tp2":
        return jax.make_mesh(
            (2, 2, 2), ("data", "expert", "tensor"), axis_types=(AxisType.Explicit,) * 3
        )
    return make_mesh(kind)


@functools.cache
def _inputs():
    """x [8, 8, D], the block's parameter values, a cotangent, the reference's choice, y and
    gradients (x and every parameter)."""
    rng = np.random.default_rng(7)
    x, params = draw_routed_inputs(rng, 8, 8, D, F, E, skew=True)
    params |= {
        "router_logit_bias": 0.5 * rng.normal(size=E),
        "b_gate": 0.5 * rng.normal(size=(E, F)),
        "b_up": 0.5 * rng.normal(size=(E, F)),
        "b_down": rng.normal(size=(E, D)),
    }
    params = {n: np.asarray(v, np.float32) for n, v in params.items()}
    cot = rng.normal(size=x.shape).astype(np.float32)
    logits = x.reshape(-1, D).astype(np.float64) @ params["router_kernel"]
    experts, margin = select_experts(
        logits + params["router_logit_bias"], Router("topk_softmax", K)
    )
    assert margin > 1e-6  # no near-tie decides the choice
    # The clamp bites on both sides of the chosen experts' units (so its gradient rule is tested).
    xt = x.reshape(-1, D)
    gate = np.einsum("td,tkdf->tkf", xt, params["w_gate"][experts]) + params["b_gate"][experts]
    up = np.einsum("td,tkdf->tkf", xt, params["w_up"][experts]) + params["b_up"][experts]
    assert (gate > ACTIVATION.limit).any() and (np.abs(up) > ACTIVATION.limit).any()

    def loss(x, params):
        y = reference_layer(x, params, experts, Router("topk_softmax", K), activation=ACTIVATION)
        return jnp.sum(y * cot)

    want, (g_x, g_p) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(jnp.asarray(x), params)
    return x, params, cot, experts, want, np.asarray(g_x), jax.tree.map(np.asarray, g_p)


def _assert_close(got, want, what):
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale, err_msg=what)


@pytest.mark.parametrize("mesh_kind", list(CASES))
def test_block_equals_dense_reference_balanced_or_not(mesh_kind, monkeypatch):
    """y and the gradients w.r.t. x and every parameter (router kernel and logit bias, expert
    weights and biases) equal the dense reference, balanced (replicas made) and, on ep8, not, and
    there the balanced y equals the plain one."""
    options = CASES[mesh_kind]
    if options.get("comm_backend") == "ragged":
        padded_exchange(monkeypatch)
    mesh = _mesh(mesh_kind)
    x, params, cot, _, want, g_x, g_p = _inputs()
    results = []
    balancers = [
        uep.BalancerConfig(
            slots_per_rank=2, min_tokens_per_replica=1, min_tokens_per_rank=1, max_fanout=1
        )
    ]
    # Plain EP (no balancer) on ep8 only, each run a compile of the block's value and gradients:
    # without a balancer the other meshes' options run the masters' calls and the token exchange
    # that their balanced run holds too (no planner, no slots, and no transfer for the chunks), on
    # groups or tensor ranks that the balanced run splits the same way. (Here before on all three.)
    if mesh_kind == "ep8":
        balancers.append(None)
    for balancer in balancers:
        layer = build_layer(
            mesh,
            params,
            d_model=D,
            d_ff=F,
            num_experts=E,
            top_k=K,
            balancer=balancer,
            capacity_factor=None,
            router=uep.TopKSoftmax(K),
            router_logit_bias=True,
            expert_bias=True,
            activation=ACTIVATION,
            **options,
        )
        y, stats, gx, grads = layer_value_and_grads(layer, place_batch(mesh, x), cot, NAMES)
        assert int(stats.dropped.sum()) == 0
        _assert_close(np.sum(y * cot), want, "y . cot")
        _assert_close(gx, g_x, "d/dx")
        for name in NAMES:
            _assert_close(grads[name], g_p[name], f"d/d{name}")
        results.append((y, int(stats.replicas.sum())))
    (y_bal, replicas), *plain = results
    assert replicas > 0  # the skewed batch made replicas
    for y_plain, _ in plain:
        np.testing.assert_allclose(y_bal, y_plain, rtol=1e-6, atol=1e-6)


def test_topk_softmax_weights_equal_reference():
    """The top k logits' softmax, with its gradient; the same experts as `SoftmaxTopK` and,
    up to rounding, its renormalised weights."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(2 * rng.normal(size=(32, 8)), jnp.float32)
    router, ref = uep.TopKSoftmax(2), Router("topk_softmax", 2)
    experts, margin = select_experts(logits, ref)
    assert margin > 1e-6
    routing = jax.jit(router)(logits)
    np.testing.assert_array_equal(np.asarray(routing.experts), experts)
    cot = jnp.asarray(rng.normal(size=(32, 2)), jnp.float32)
    got, g_got = jax.jit(jax.value_and_grad(lambda l: jnp.sum(router(l).weights * cot)))(logits)
    want, g_want = jax.jit(
        jax.value_and_grad(lambda l: jnp.sum(router_weights(l, experts, ref) * cot))
    )(logits)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-6)
    chosen = np.zeros(logits.shape, bool)
    np.put_along_axis(chosen, experts, True, axis=-1)
    assert np.all(np.asarray(g_got)[~chosen] == 0)  # the logits not chosen get no gradient
    softmax_first = jax.jit(uep.SoftmaxTopK(2))(logits)
    np.testing.assert_array_equal(np.asarray(softmax_first.experts), experts)
    np.testing.assert_allclose(softmax_first.weights, routing.weights, rtol=1e-6)


def test_parameters_by_option():
    """The options off leave the parameter tree as it was; on, the block's parameters have their
    shapes and placements (nothing compiled)."""
    mesh = _mesh("dp2ep2tp2")

    def layer(**options):
        return uep.MoE(D, F, E, K, mesh, tensor_axis="tensor", rngs=nnx.Rngs(0), **options)

    plain = nnx.state(layer(), nnx.Param)
    assert set(plain) == {"router_kernel", *EXPERT_NAMES}
    block = layer(router_logit_bias=True, expert_bias=True)
    specs = {
        "router_logit_bias": ((E,), P()),
        "b_gate": ((E, F), P("expert", "tensor")),
        "b_up": ((E, F), P("expert", "tensor")),
        "b_down": ((E, D), P("expert")),
    }
    assert set(nnx.state(block, nnx.Param)) == set(plain) | set(specs)
    for name, (shape, spec) in specs.items():
        value = getattr(block, name)[...]
        assert value.shape == shape and value.sharding.spec == spec, name
        assert not np.any(np.asarray(value)), name  # initialised to 0


def test_bad_settings_raise_one_line():
    assert_raises_one_line(
        ValueError, r"ClampedSwiGLU: limit must be a finite number > 0", uep.ClampedSwiGLU, 0.0
    )
    assert_raises_one_line(
        ValueError,
        r"Execution: activation must be one of .* or a ClampedSwiGLU, got 'clamped'",
        uep.Execution,
        activation="clamped",
    )
    mesh = make_mesh("ep8")
    assert_raises_one_line(
        TypeError, r"MoE: expert_bias must be a bool", uep.MoE, D, F, E, K, mesh,
        expert_bias=1, rngs=nnx.Rngs(0),
    )  # fmt: skip
    ep = uep.ExpertParallel(mesh, E)
    x, ids, w = jnp.zeros((8, D)), jnp.zeros((8, K), jnp.int32), jnp.ones((8, K))
    params = (jnp.zeros((E, D, F)),) * 2 + (jnp.zeros((E, F, D)),)
    biases = (jnp.zeros((E, F)), jnp.zeros((E, F)), jnp.zeros((E, 1, D)))  # b_down: [E, D]
    assert_raises_one_line(
        ValueError,
        r"routed_experts: expert biases must be b_gate, b_up \[E=8, F=8\] and b_down \[E, D=8\]",
        uep.routed_experts,
        x, ids, w, params + biases, ep,
    )  # fmt: skip
