"""Routers (`ultraep_jax.routers`), the layer with each router, and `uep.routed_experts` called
directly, against the references of tests/references: the routers (routing.py) and the dense
one-device MoE (moe.py).

The reference never calls the library's routing code: routing decisions are made in NumPy
float64 (softmax top-k is top-k of the logits; DeepSeek-V3 sigmoid routing picks on sigmoid
scores plus the bias, within the ``top_groups`` groups whose two best biased scores sum highest),
and the differentiable parts (weights, losses, experts) are plain jnp on those fixed choices.
Inputs are drawn with a clear margin at every decision (k-th vs (k+1)-th key, last kept vs first
dropped group), so that the library's float32 and the reference's float64 pick the same experts.

Everything runs on the 8 simulated CPU devices forced by conftest.py; shapes are kept small.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ultraep_jax as uep
from tests.helpers import (
    build_layer,
    draw_routed_inputs,
    layer_value_and_grads,
    make_mesh,
    place_batch,
    routed_value_and_grads,
)
from tests.references.layer import EXPERT_NAMES, SHARED_NAMES, reference_layer
from tests.references.moe import HIGHEST, reference_moe
from tests.references.routing import Router, router_losses, router_weights, select_experts
from ultraep_jax.routers import SigmoidTopK, SoftmaxTopK, update_bias

D, F, FS = 8, 8, 8  # model width, expert hidden width, shared expert hidden width
E = 8

RTOL, ATOL = 1e-4, 1e-5


def assert_close(got, want, what, rtol=RTOL, atol=ATOL):
    """Comparison with the absolute tolerance scaled to the reference's magnitude."""
    want = np.asarray(want, np.float64)
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    np.testing.assert_allclose(
        np.asarray(got, np.float64), want, rtol=rtol, atol=atol * scale, err_msg=what
    )


# -- the reference router ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec(Router):
    """A router as the reference sees it (`Router`); `library` builds the library's router from
    it."""

    def library(self, bias_rate: float = 1e-3):
        if self.kind == "softmax":
            return SoftmaxTopK(self.top_k, renormalize=self.renormalize)
        return SigmoidTopK(
            self.top_k, self.num_groups, self.top_groups, scale=self.scale, bias_rate=bias_rate
        )

    @property
    def id(self) -> str:
        if self.kind == "softmax":
            return f"softmax-k{self.top_k}-{'renorm' if self.renormalize else 'raw'}"
        return f"sigmoid-k{self.top_k}-g{self.top_groups}of{self.num_groups}-s{self.scale}"


def logit(p):
    """float64 log(p / (1 - p)): the logit whose sigmoid is p."""
    p = np.asarray(p, np.float64)
    return np.log(p / (1.0 - p))


# -- 1. router math ------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _route_jit(spec, logits, bias):
    # One compiled program per router and shape: op by op, each of the router's ops compiles on
    # its own (seconds per test on 2 cores); the layer runs the router under jit anyway.
    return spec.library()(logits, bias)


def _route(spec, logits, bias=None):
    r = _route_jit(
        spec, jnp.asarray(logits, jnp.float32), None if bias is None else jnp.asarray(bias)
    )
    return r, np.asarray(r.experts), np.asarray(r.weights)


@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
def test_softmax_topk_hand_example(renormalize):
    """Two tokens, two experts, top-1, logits [log 3, 0]: probabilities [3/4, 1/4]; both pick
    expert 0; counts [2, 0], mean probabilities [3/4, 1/4]: aux = 2/(1*2) * 2 * 3/4 = 3/2;
    logsumexp = log 4 for both tokens: z = (log 4)^2."""
    spec = Spec("softmax", 1, renormalize=renormalize)
    r, experts, weights = _route(spec, [[math.log(3), 0.0], [math.log(3), 0.0]])
    assert r.experts.dtype == jnp.int32 and r.weights.dtype == jnp.float32
    np.testing.assert_array_equal(experts, [[0], [0]])
    np.testing.assert_allclose(weights, [[1.0], [1.0]] if renormalize else [[0.75], [0.75]], 1e-6)
    np.testing.assert_allclose(float(r.aux_loss), 1.5, rtol=1e-6)
    np.testing.assert_allclose(float(r.z_loss), math.log(4) ** 2, rtol=1e-6)


def test_losses_are_one_and_log_e_squared_at_zero_logits():
    """All-zero logits: every router's normalised scores are uniform, so aux = E/(K T) * (K T) *
    1/E = 1 whatever the choice; z = log(E)^2."""
    logits = np.zeros((3, 4))
    for spec in (Spec("softmax", 2), Spec("softmax", 2, renormalize=False), Spec("sigmoid", 2)):
        r, _, _ = _route(spec, logits)
        np.testing.assert_allclose(float(r.aux_loss), 1.0, rtol=1e-6, err_msg=spec.id)
        np.testing.assert_allclose(float(r.z_loss), math.log(4) ** 2, rtol=1e-6, err_msg=spec.id)


def test_sigmoid_hand_example_losses():
    """Two tokens, scores [3/4, 1/2] (logits [log 3, 0]), top-1: both pick expert 0; per-token
    normalised scores [0.6, 0.4]: aux = 2/2 * 2 * 0.6 = 1.2; weight = scale * 1; z = (log 4)^2."""
    spec = Spec("sigmoid", 1, scale=2.5)
    r, experts, weights = _route(spec, [[math.log(3), 0.0], [math.log(3), 0.0]])
    np.testing.assert_array_equal(experts, [[0], [0]])
    np.testing.assert_allclose(weights, [[2.5], [2.5]], rtol=1e-6)
    np.testing.assert_allclose(float(r.aux_loss), 1.2, rtol=1e-6)
    np.testing.assert_allclose(float(r.z_loss), math.log(4) ** 2, rtol=1e-6)


# Sigmoid cases by their scores (logit = log(s / (1 - s))): scores, bias, spec, the experts to
# pick (written by hand), and what would be picked without the bias / the group limit.
SCORES_C = [0.95, 0.05, 0.60, 0.55, 0.90, 0.20, 0.30, 0.30]
SIGMOID_HAND = {
    # no groups, no bias: the two best scores
    "plain": ([0.9, 0.2, 0.7, 0.4], None, Spec("sigmoid", 2), [0, 2]),
    # bias +0.8 on expert 1 lifts 0.2 to 1.0 > 0.9: expert 1 first, weights from 0.2 and 0.9
    "bias": ([0.9, 0.2, 0.7, 0.4], [0, 0.8, 0, 0], Spec("sigmoid", 2, scale=2.0), [1, 0]),
    # groups of 2, best 2 groups: sums 1.00, 1.15, 1.10, 0.60 keep groups 1 and 2 -> experts 4, 2
    # (without the limit: 0 and 4; ranking groups by their best score would keep 0 and 2)
    "groups2": (SCORES_C, None, Spec("sigmoid", 2, num_groups=4, top_groups=2), [4, 2]),
    # groups of 4, best group: top-two sums 1.70 vs 1.55 keep group 0 -> experts 0, 1 (summing a
    # whole group would keep group 1: 1.9 vs 2.8)
    "groups4": (
        [0.9, 0.8, 0.1, 0.1, 0.85, 0.7, 0.65, 0.6],
        None,
        Spec("sigmoid", 2, num_groups=2, top_groups=1),
        [0, 1],
    ),
    # the bias moves the group choice: biased group 3 = 0.8 + 0.75 = 1.55 beats group 2 (1.10),
    # so groups 3 and 1 are kept and experts 6, 7 are picked; their weights are their unbiased
    # scores 0.3, 0.3 normalised: 0.5 each (times scale 3)
    "bias_groups": (
        SCORES_C,
        [0, 0, 0, 0, 0, 0, 0.5, 0.45],
        Spec("sigmoid", 2, num_groups=4, top_groups=2, scale=3.0),
        [6, 7],
    ),
}


@pytest.mark.parametrize("name", list(SIGMOID_HAND))
def test_sigmoid_topk_hand_examples(name):
    scores, bias, spec, want = SIGMOID_HAND[name]
    logits = logit([scores])
    ref, margin = select_experts(logits, spec, None if bias is None else np.asarray(bias))
    np.testing.assert_array_equal(ref, [want], err_msg="the reference disagrees with the hand")
    assert margin > 1e-3
    bias_arr = None if bias is None else np.asarray(bias, np.float32)
    _, experts, weights = _route(spec, logits, bias_arr)
    np.testing.assert_array_equal(experts, [want])
    chosen = np.asarray(scores, np.float64)[want]
    np.testing.assert_allclose(weights, [spec.scale * chosen / chosen.sum()], rtol=1e-6)
    np.testing.assert_allclose(weights.sum(), spec.scale, rtol=1e-6)
    if name == "bias_groups":
        np.testing.assert_allclose(weights, [[1.5, 1.5]], rtol=1e-6)
    if bias is not None:
        # the same scores without the bias pick differently
        _, unbiased, _ = _route(spec, logits)
        assert not np.array_equal(unbiased, experts)


RANDOM_SPECS = [
    Spec("softmax", 2, renormalize=True),
    Spec("softmax", 3, renormalize=False),
    Spec("sigmoid", 2, scale=1.0),
    Spec("sigmoid", 3, num_groups=4, top_groups=2, scale=2.5),
]


def _random_logits(spec, seed, T=6):
    """[T, E] logits and a bias (sigmoid only) with a clear margin at every decision, the bias
    changing at least one choice."""
    rng = np.random.default_rng(seed)
    for _ in range(500):
        logits = rng.normal(size=(T, E)).astype(np.float32)
        bias = None
        if spec.kind == "sigmoid":
            bias = (0.3 * rng.normal(size=E)).astype(np.float32)
        experts, margin = select_experts(logits, spec, bias)
        if margin < 1e-3:
            continue
        if bias is not None and np.array_equal(experts, select_experts(logits, spec)[0]):
            continue
        return logits, bias, experts
    raise AssertionError("could not draw logits with a clear routing margin")


@functools.partial(jax.jit, static_argnums=0)
def _router_and_reference(spec, logits, bias, idx, cot):
    """The library router's routing on ``logits`` and the reference's weights and losses on the
    fixed choice ``idx``, and the gradients w.r.t. the logits of each (weights against ``cot``,
    aux, z) by the library and by the reference, and the weights' gradient w.r.t. the bias (None
    without one): one compiled program instead of a dozen op-by-op gradients."""
    router = spec.library()
    lib_fns = {
        "weights": lambda l: jnp.sum(router(l, bias).weights * cot),
        "aux": lambda l: router(l, bias).aux_loss,
        "z": lambda l: router(l, bias).z_loss,
    }
    ref_fns = {
        "weights": lambda l: jnp.sum(router_weights(l, idx, spec) * cot),
        "aux": lambda l: router_losses(l, idx, spec)[0],
        "z": lambda l: router_losses(l, idx, spec)[1],
    }
    grads = {
        what: (jax.grad(lib_fns[what])(logits), jax.grad(ref_fns[what])(logits)) for what in lib_fns
    }
    g_bias = None
    if bias is not None:
        g_bias = jax.grad(lambda b: jnp.sum(router(logits, b).weights * cot))(bias)
    ref = (router_weights(logits, idx, spec), *router_losses(logits, idx, spec))
    return router(logits, bias), ref, grads, g_bias


@pytest.mark.parametrize(
    "seed, spec", list(enumerate(RANDOM_SPECS)), ids=[s.id for s in RANDOM_SPECS]
)
def test_router_values_and_gradients_match_reference(seed, spec):
    """Random logits: experts, weights, aux and z losses equal the reference, and so do the
    gradients w.r.t. the logits of the weights (against a random cotangent) and of each loss."""
    logits, bias, want_experts = _random_logits(spec, seed)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=want_experts.shape), jnp.float32)
    r, (ref_weights, ref_aux, ref_z), grads, g_bias = _router_and_reference(
        spec,
        jnp.asarray(logits),
        None if bias is None else jnp.asarray(bias),
        jnp.asarray(want_experts),
        cot,
    )
    np.testing.assert_array_equal(np.asarray(r.experts), want_experts)
    assert_close(r.weights, ref_weights, "weights", 1e-5, 1e-6)
    assert_close(r.aux_loss, ref_aux, "aux_loss", 1e-5, 1e-6)
    assert_close(r.z_loss, ref_z, "z_loss", 1e-5, 1e-6)
    for what, (got, want) in grads.items():
        assert np.abs(np.asarray(want)).max() > 0, what
        assert_close(got, want, f"d {what} / d logits", 1e-4, 1e-6)
    if bias is not None:
        # the bias is a selection device only: no gradient flows into it
        np.testing.assert_array_equal(np.asarray(g_bias), 0)


def test_update_bias_hand_example():
    """Loads [10, 2, 4, 0] have mean 4: the overloaded expert 0 goes down by the rate, the
    underloaded 1 and 3 go up, expert 2 (exactly at the mean) stays."""
    bias = jnp.asarray([0.0, 0.5, -0.5, 0.0], jnp.float32)
    new = update_bias(bias, jnp.asarray([10, 2, 4, 0], jnp.int32), 0.1)
    assert new.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(new), [-0.1, 0.6, -0.5, 0.1], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(update_bias(bias, jnp.ones(4, jnp.int32), 0.1)), bias)


# -- the layer ------------------------------------------------------------------------------


def balancer_for(mesh) -> uep.BalancerConfig:
    return uep.BalancerConfig(
        num_experts=E,
        ep_size=mesh.shape["expert"],
        slots_per_rank=1,
        min_tokens_per_replica=1,
        min_tokens_per_rank=0,
    )


def param_names(shared: bool) -> tuple[str, ...]:
    return ("router_kernel", *EXPERT_NAMES, *(SHARED_NAMES if shared else ()))


def draw_layer_inputs(rng, spec: Spec, batch, seq, skew=True, bias_scale=0.0):
    """x [batch, seq, D], parameter values (with the shared expert's) and a bias (zeros unless
    ``bias_scale``): experts 0 and 1 are hot when ``skew`` (a shared direction of x that their
    router columns align with). Every decision has a clear margin and a nonzero bias changes at
    least one token's choice."""
    for _ in range(200):
        x, params = draw_routed_inputs(rng, batch, seq, D, F, E, skew)
        shared = {
            "shared_gate": rng.normal(size=(D, FS)) / math.sqrt(D),
            "shared_up": rng.normal(size=(D, FS)) / math.sqrt(D),
            "shared_down": rng.normal(size=(FS, D)) / math.sqrt(FS),
        }
        params |= {k: v.astype(np.float32) for k, v in shared.items()}
        bias = (bias_scale * rng.normal(size=E)).astype(np.float32)
        logits = x.reshape(-1, D).astype(np.float64) @ params["router_kernel"].astype(np.float64)
        experts, margin = select_experts(logits, spec, bias)
        threshold = 1e-3 if spec.kind == "softmax" else 1e-4
        if margin < threshold:
            continue
        if bias_scale and np.array_equal(experts, select_experts(logits, spec)[0]):
            continue
        return x, params, bias, experts
    raise AssertionError("could not draw inputs with a clear routing margin")


@functools.partial(jax.jit, static_argnames=("spec", "shared"))
def reference_value_and_grads(x, params, experts, cotangent, spec: Spec, shared: bool):
    """(y, aux, z) and the gradients of sum(y * cotangent) w.r.t. x and the parameters, for the
    reference's fixed choice ``experts`` [T, k] (`reference_layer`)."""

    def loss(x, params):
        y = reference_layer(x, params, experts, spec, shared=shared)
        logits = jnp.dot(x.reshape(-1, D), params["router_kernel"], precision=HIGHEST)
        return jnp.sum(y * cotangent), (y, *router_losses(logits, experts, spec))

    (_, aux), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
    return aux, grads


def build_routed_layer(mesh, spec, balanced, shared, params, bias=None, bias_rate=1e-3, dtype=None):
    kwargs = {} if dtype is None else {"param_dtype": dtype}
    values = {name: params[name] for name in param_names(shared)}
    if bias is not None:
        values["router_bias"] = bias
    return build_layer(
        mesh,
        values,
        d_model=D,
        d_ff=F,
        num_experts=E,
        top_k=spec.top_k,
        balancer=balancer_for(mesh) if balanced else None,
        capacity_factor=None,
        router=spec.library(bias_rate),
        shared_d_ff=FS if shared else 0,
        **kwargs,
    )


@dataclasses.dataclass(frozen=True)
class LayerCase:
    spec: Spec
    mesh: str
    balanced: bool
    shared: bool
    bias_scale: float
    seed: int

    @property
    def id(self) -> str:
        bal = "balanced" if self.balanced else "plain"
        return f"{self.spec.id}-{self.mesh}-{bal}{'-shared' if self.shared else ''}"


GROUPED = Spec("sigmoid", 2, num_groups=4, top_groups=2, scale=2.5)
# Each router, balanced and not (for softmax, across its two weightings: how the weights are made
# and how the experts run do not interact), with and without the shared expert, on both meshes.
LAYER_CASES = [
    LayerCase(Spec("softmax", 2), "ep8", balanced=True, shared=False, bias_scale=0, seed=0),
    LayerCase(
        Spec("softmax", 2, False), "dp2ep4", balanced=False, shared=True, bias_scale=0, seed=1
    ),
    LayerCase(GROUPED, "dp2ep4", balanced=True, shared=True, bias_scale=0.3, seed=4),
    LayerCase(GROUPED, "ep8", balanced=False, shared=False, bias_scale=0.3, seed=5),
]


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: c.id)
def test_layer_equals_dense_reference(case):
    """uep.MoE with each router (the sigmoid one with groups and a nonzero bias), with and
    without shared experts, balanced and not, dropless: output, gradients w.r.t. x and every
    parameter, the routed loads and the router losses equal the dense reference."""
    rng = np.random.default_rng(case.seed)
    mesh = make_mesh(case.mesh)
    x, params, bias, experts = draw_layer_inputs(rng, case.spec, 8, 4, bias_scale=case.bias_scale)
    cotangent = rng.normal(size=x.shape).astype(np.float32)
    (ref_y, ref_aux, ref_z), (ref_gx, ref_gp) = reference_value_and_grads(
        jnp.asarray(x),
        {k: jnp.asarray(v) for k, v in params.items()},
        jnp.asarray(experts),
        jnp.asarray(cotangent),
        case.spec,
        case.shared,
    )
    uses_bias = case.spec.kind == "sigmoid"
    layer = build_routed_layer(
        mesh, case.spec, case.balanced, case.shared, params, bias if uses_bias else None
    )
    names = param_names(case.shared)
    y, stats, gx, gp = layer_value_and_grads(
        layer, place_batch(mesh, x), jnp.asarray(cotangent), names
    )
    np.testing.assert_array_equal(stats.expert_load, np.bincount(experts.ravel(), minlength=E))
    assert int(stats.dropped) == 0
    if case.balanced:
        assert int(stats.replicas) > 0, "the inputs were not skewed enough to replicate"
    else:
        assert int(stats.replicas) == 0
    assert_close(stats.aux_loss, ref_aux, "aux_loss")
    assert_close(stats.z_loss, ref_z, "z_loss")
    assert y.shape == x.shape and y.dtype == np.float32
    assert_close(y, ref_y, "y")
    assert_close(gx, ref_gx, "d/dx")
    for name in names:
        assert gp[name].shape == params[name].shape, name
        assert np.abs(ref_gp[name]).max() > 0, name
        assert_close(gp[name], ref_gp[name], f"d/d{name}")
    if uses_bias:
        # the bias is state, not a parameter: the layer's bias is untouched by the call
        np.testing.assert_array_equal(np.asarray(layer.router_bias[...]), bias)


# -- routed_experts called directly ---------------------------------------------------------


def hand_routing(batch, seq, k):
    """A fixed pattern: every token's first choice is expert 0 (hot), the others walk the
    experts by token index (so some tokens pick expert 0 twice); arbitrary positive weights."""
    t = np.arange(batch * seq).reshape(batch, seq)
    experts = np.stack([np.zeros_like(t)] + [(3 * t + j - 1) % E for j in range(1, k)], -1)
    weights = np.random.default_rng(7).uniform(0.2, 1.5, size=experts.shape)
    return experts.astype(np.int32), weights.astype(np.float32)


@jax.jit
def reference_routed(x, weights, params, experts):
    """[B, L, D]: the dense experts of the fixed routing ``experts``, ``weights`` [B, L, k]."""
    return reference_moe(x, experts, weights, tuple(params[n] for n in EXPERT_NAMES))


def test_routed_experts_with_hand_routing_equals_reference(dp2ep4_mesh):
    """`uep.routed_experts` outside any layer, balanced, with a hand-made routing (NumPy expert
    ids, some tokens choosing one expert twice): the eager call's output equals the dense
    reference and its loads are the bincount of the ids. (Its gradients are those of the layer
    tests, which run it under the routers' weights.)"""
    rng = np.random.default_rng(11)
    batch, seq, k = 8, 4, 2
    x = rng.normal(size=(batch, seq, D)).astype(np.float32)
    experts, weights = hand_routing(batch, seq, k)
    assert (experts[..., 0] == experts[..., 1]).any(), "the pattern has no repeated choice"
    params = {
        "w_gate": rng.normal(size=(E, D, F)).astype(np.float32) / math.sqrt(D),
        "w_up": rng.normal(size=(E, D, F)).astype(np.float32) / math.sqrt(D),
        "w_down": rng.normal(size=(E, F, D)).astype(np.float32) / math.sqrt(F),
    }
    ep = uep.ExpertParallel(dp2ep4_mesh, E, balancer_for(dp2ep4_mesh), capacity_factor=None)
    wparams = tuple(jnp.asarray(params[n]) for n in EXPERT_NAMES)
    ref_y = reference_routed(jnp.asarray(x), jnp.asarray(weights), params, jnp.asarray(experts))

    y, stats = uep.routed_experts(jnp.asarray(x), experts, jnp.asarray(weights), wparams, ep)
    np.testing.assert_array_equal(
        np.asarray(stats.expert_load), np.bincount(experts.ravel(), minlength=E)
    )
    assert int(stats.replicas) > 0 and int(stats.dropped) == 0
    assert float(stats.aux_loss) == 0 and float(stats.z_loss) == 0
    assert_close(y, ref_y, "routed_experts y (eager)")


def _routed_args(batch=8, seq=4, k=2):
    mesh = make_mesh("ep8")
    ep = uep.ExpertParallel(mesh, E, None, capacity_factor=None)
    x = jnp.ones((batch, seq, D), jnp.float32)
    experts, weights = hand_routing(batch, seq, k)
    params = (
        jnp.zeros((E, D, F)),
        jnp.zeros((E, D, F)),
        jnp.zeros((E, F, D)),
    )
    return x, experts, jnp.asarray(weights), params, ep


@pytest.mark.parametrize("bad", [E, -1])
def test_routed_experts_rejects_concrete_experts_out_of_range(bad):
    x, experts, weights, params, ep = _routed_args()
    experts = experts.copy()
    experts[3, 1, 1] = bad
    with pytest.raises(ValueError, match=rf"experts must be in \[0, {E}\)"):
        uep.routed_experts(x, experts, weights, params, ep)


@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "plain"])
def test_routed_experts_under_jit_skips_experts_out_of_range(balanced, dp2ep4_mesh):
    """Under `jit` expert ids cannot be checked: a pair whose id is outside [0, E) (-1, E, a large
    value, a large negative one) contributes nothing. Every output and gradient equals the dense
    reference of the routing without those pairs (the other tokens on the same devices are
    unaffected), the loads are the bincount of the valid ids, and the bad pairs are counted in
    ``invalid`` only (not in ``dropped``)."""
    rng = np.random.default_rng(12)
    batch, seq, k = 8, 4, 2
    x = rng.normal(size=(batch, seq, D)).astype(np.float32)
    cotangent = rng.normal(size=x.shape).astype(np.float32)
    params = {
        "w_gate": rng.normal(size=(E, D, F)).astype(np.float32) / math.sqrt(D),
        "w_up": rng.normal(size=(E, D, F)).astype(np.float32) / math.sqrt(D),
        "w_down": rng.normal(size=(E, F, D)).astype(np.float32) / math.sqrt(F),
    }
    experts, weights = hand_routing(batch, seq, k)
    bad = np.zeros(experts.shape, bool)
    # batch rows 0, 3, 5 sit on devices with other, valid, tokens; row 5 token 2 has no expert
    bad_ids = {
        (0, 0, 0): -1,
        (3, 1, 1): E,
        (5, 2, 0): 2**31 - 1,
        (5, 2, 1): -(2**31),
        (6, 3, 1): E + 3,
    }
    for index, value in bad_ids.items():
        experts[index], bad[index] = value, True
    ep = uep.ExpertParallel(
        dp2ep4_mesh, E, balancer_for(dp2ep4_mesh) if balanced else None, capacity_factor=None
    )
    wparams = tuple(jnp.asarray(params[n]) for n in EXPERT_NAMES)

    def layer(x, weights, params, experts):
        return uep.routed_experts(x, experts, weights, params, ep)

    def ref(x, weights, params, experts):
        return reference_routed(x, weights, params, experts), None

    y, stats, gx, gw, gp = routed_value_and_grads(
        layer, jnp.asarray(x), jnp.asarray(weights), wparams, jnp.asarray(experts), cotangent
    )
    valid_weights = np.where(bad, 0, weights).astype(np.float32)
    valid_experts = np.where(bad, 0, experts)
    ref_y, _, ref_gx, ref_gw, ref_gp = routed_value_and_grads(
        ref, jnp.asarray(x), jnp.asarray(valid_weights), params, valid_experts, cotangent
    )
    assert_close(y, ref_y, "y")
    assert_close(gx, ref_gx, "d/dx")
    assert_close(np.where(bad, 0, gw), np.where(bad, 0, ref_gw), "d/dweights of valid pairs")
    np.testing.assert_array_equal(np.asarray(gw)[bad], 0)
    for i, name in enumerate(EXPERT_NAMES):
        assert_close(gp[i], ref_gp[name], f"d/d{name}")
    np.testing.assert_array_equal(
        np.asarray(stats.expert_load), np.bincount(experts[~bad], minlength=E)
    )
    assert int(stats.invalid) == bad.sum() and int(stats.dropped) == 0
    assert int(stats.over_capacity) == 0 and (int(stats.replicas) > 0) == balanced


def test_routed_experts_rejects_mismatched_shapes():
    x, experts, weights, params, ep = _routed_args()
    both = r"experts .* and weights .* must both be \[\.\.\., top_k\] with x's leading shape"
    with pytest.raises(ValueError, match=both):
        uep.routed_experts(x, experts, weights[..., :1], params, ep)
    with pytest.raises(ValueError, match=both):
        uep.routed_experts(x, experts[:, :2], weights[:, :2], params, ep)
    with pytest.raises(ValueError, match=both):
        uep.routed_experts(x, experts.reshape(-1, 2), weights.reshape(-1, 2), params, ep)
    with pytest.raises(ValueError, match=both):  # x [T, D] is fine, with ids [T, k]
        uep.routed_experts(x.reshape(-1, D), experts, weights, params, ep)
    bad_params = (params[0], params[1], jnp.zeros((E, F + 1, D)))
    with pytest.raises(ValueError, match="expert weights must be"):
        uep.routed_experts(x, experts, weights, bad_params, ep)
    with pytest.raises(ValueError, match=r"expert weights must be .*E=8"):
        uep.routed_experts(x, experts, weights, tuple(p[:4] for p in params), ep)


def _bad_routed_args(kind):
    """`routed_experts` arguments with one thing wrong (``kind``)."""
    x, experts, weights, params, ep = _routed_args()
    if kind == "top_k0":
        experts, weights = experts[..., :0], weights[..., :0]
    elif kind == "batch0":
        x, experts, weights = x[:0], experts[:0], weights[:0]
    elif kind == "seq0":
        x, experts, weights = x[:, :0], experts[:, :0], weights[:, :0]
    elif kind == "params2":
        params = params[:2]
    elif kind == "params_array":
        params = params[0]
    elif kind == "experts_list":
        experts = experts.tolist()
    elif kind == "ep_none":
        ep = None
    elif kind == "x_int":
        x = x.astype(jnp.int32)
    elif kind == "x_complex":
        x = x.astype(jnp.complex64)
    elif kind == "experts_float":
        experts = experts.astype(np.float32)
    elif kind == "weights_int":
        weights = weights.astype(jnp.int32)
    elif kind == "w_down_int":
        params = (*params[:2], params[2].astype(jnp.int32))
    return x, experts, weights, params, ep


@pytest.mark.parametrize(
    "kind, error, match",
    [
        ("top_k0", ValueError, r"top_k must be >= 1, got x \(8, 4, 8\) and experts \(8, 4, 0\)"),
        ("batch0", ValueError, r"tokens, d_model and top_k must be >= 1, got x \(0, 4, 8\)"),
        ("seq0", ValueError, r"tokens, d_model and top_k must be >= 1, got x \(8, 0, 8\)"),
        ("params2", ValueError, r"params must be \(w_gate, w_up, w_down\), got tuple of 2"),
        ("params_array", ValueError, r"params must be \(w_gate, w_up, w_down\), got ArrayImpl"),
        ("experts_list", TypeError, "experts must be an array, got list"),
        ("ep_none", TypeError, "ep must be an ExpertParallel, got NoneType"),
        ("x_int", TypeError, "x must have a real floating-point dtype, got int32"),
        ("x_complex", TypeError, "x must have a real floating-point dtype, got complex64"),
        ("experts_float", TypeError, "experts must have an integer dtype, got float32"),
        ("weights_int", TypeError, "weights must have a real floating-point dtype, got int32"),
        ("w_down_int", TypeError, "w_down must have a real floating-point dtype, got int32"),
    ],
)
def test_routed_experts_rejects_bad_arguments_in_one_line(kind, error, match):
    """Each used to crash (ZeroDivisionError, unpack or AttributeError) or be silently accepted
    (integer x gave truncated integer outputs); now one line naming the value."""
    with pytest.raises(error, match=match) as info:
        uep.routed_experts(*_bad_routed_args(kind))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: SoftmaxTopK(2, "no"), TypeError, "renormalize must be a bool, got 'no'"),
        (lambda: SoftmaxTopK(2, 1), TypeError, "renormalize must be a bool, got 1"),
        (lambda: SigmoidTopK(2, scale=math.inf), ValueError, "scale must be a finite number > 0"),
        (lambda: SigmoidTopK(2, scale=math.nan), ValueError, "scale must be a finite number > 0"),
        (lambda: SigmoidTopK(2, bias_rate=math.inf), ValueError, "bias_rate must be a finite"),
        (lambda: SigmoidTopK(2, scale="2"), TypeError, "scale must be a finite number > 0"),
    ],
    ids=["renorm_str", "renorm_int", "scale_inf", "scale_nan", "rate_inf", "scale_str"],
)
def test_router_rejects_bad_values(make, error, match):
    """Silently accepted before: a truthy string renormalised, an infinite scale gave NaN."""
    with pytest.raises(error, match=match):
        make()


def test_routers_accept_numpy_scalars_and_check_the_experts():
    """NumPy scalars are stored as Python numbers (equal routers compare equal); a router checks
    the experts it will choose among with one line."""
    assert SoftmaxTopK(np.int64(2), np.bool_(False)) == SoftmaxTopK(2, False)
    sig = SigmoidTopK(np.int32(2), np.int64(4), np.int64(2), np.float32(2.5), np.float64(0.01))
    assert sig == SigmoidTopK(2, 4, 2, 2.5, 0.01)
    assert type(sig.top_k) is int and type(sig.scale) is float
    sig.check_experts(8)
    with pytest.raises(ValueError, match="6 experts do not split into num_groups=4"):
        sig.check_experts(6)
    with pytest.raises(ValueError, match="top_k=3 exceeds the experts of 2 groups of 1"):
        SigmoidTopK(3, 4, 2).check_experts(4)
    with pytest.raises(ValueError, match="top_k=2 exceeds num_experts=1"):
        SoftmaxTopK(2).check_experts(1)


# -- the router bias -------------------------------------------------------------------------


def test_update_router_bias_moves_toward_balance(ep8_mesh):
    """From a call's stats, the bias goes down by the rate for experts above the mean load and up
    for those below; the next call routes by the new bias (a large rate changes choices). Eager
    and in a jitted step, with x placed on the user's `jax.make_mesh` mesh (Explicit axes)."""
    rng = np.random.default_rng(21)
    spec, rate = GROUPED, 0.2
    x, params, bias, experts = draw_layer_inputs(rng, spec, 8, 4, bias_scale=0.3)
    logits = x.reshape(-1, D).astype(np.float64) @ params["router_kernel"].astype(np.float64)
    load = np.bincount(experts.ravel(), minlength=E)
    assert (load != load.mean()).all(), "an expert sits at the mean load: pick another seed"
    want_bias = (bias + rate * np.sign(load.mean() - load)).astype(np.float32)
    experts2, margin2 = select_experts(logits, spec, want_bias)
    assert margin2 > 1e-4, "the updated bias leaves a near tie: pick another seed"
    load2 = np.bincount(experts2.ravel(), minlength=E)
    assert not np.array_equal(load2, load), "the bias step changes nothing: pick another seed"

    layer = build_routed_layer(ep8_mesh, spec, False, False, params, bias, bias_rate=rate)
    xs = place_batch(ep8_mesh, x)
    _, stats = layer(xs)
    np.testing.assert_array_equal(np.asarray(stats.expert_load), load)
    layer.update_router_bias(stats)
    new = np.asarray(layer.router_bias[...])
    np.testing.assert_array_less(new[load > load.mean()], bias[load > load.mean()])
    np.testing.assert_array_less(bias[load < load.mean()], new[load < load.mean()])
    np.testing.assert_allclose(new, want_bias, rtol=1e-6, atol=1e-7)

    # a jitted step (call, then update) routes by the updated bias and moves it again
    graphdef, state = nnx.split(layer)

    @jax.jit
    def step(state, x):
        model = nnx.merge(graphdef, state)
        _, stats = model(x)
        model.update_router_bias(stats)
        return nnx.split(model)[1], stats.expert_load

    state, got_load2 = step(state, xs)
    np.testing.assert_array_equal(np.asarray(got_load2), load2)
    nnx.update(layer, state)
    want_bias2 = want_bias + rate * np.sign(load2.mean() - load2)
    np.testing.assert_allclose(np.asarray(layer.router_bias[...]), want_bias2, rtol=1e-6, atol=1e-6)


def test_update_router_bias_on_softmax_layer_raises(ep8_mesh):
    layer = uep.MoE(D, F, E, 2, ep8_mesh, rngs=nnx.Rngs(0))
    assert not hasattr(layer, "router_bias")
    zeros = {f.name: jnp.int32(0) for f in dataclasses.fields(uep.MoEStats)}
    stats = uep.MoEStats(**(zeros | {"expert_load": jnp.zeros((E,), jnp.int32)}))
    with pytest.raises(ValueError, match="no bias"):
        layer.update_router_bias(stats)


# -- bfloat16 --------------------------------------------------------------------------------


def test_bf16_layer_close_to_float32_reference_with_float32_routing(ep8_mesh):
    """bf16 parameters and input under jit: the output is close to the float32 reference of the
    same (upcast) weights, and the routed loads are those of float32 logits of the upcast values,
    on an input where logits rounded to bfloat16 would route differently."""
    spec = Spec("softmax", 2)
    rng = np.random.default_rng(31)
    bf16 = jnp.bfloat16
    for _ in range(200):
        x, params, _, _ = draw_layer_inputs(rng, spec, 8, 4)
        x = np.asarray(jnp.asarray(x, bf16).astype(jnp.float32))
        params = {
            k: np.asarray(jnp.asarray(v, bf16).astype(jnp.float32)) for k, v in params.items()
        }
        logits = x.reshape(-1, D).astype(np.float64) @ params["router_kernel"].astype(np.float64)
        experts, margin = select_experts(logits, spec)
        rounded = np.asarray(jnp.asarray(logits, bf16).astype(jnp.float32), np.float64)
        experts_bf16, _ = select_experts(rounded, spec)
        load = np.bincount(experts.ravel(), minlength=E)
        if margin > 1e-3 and not np.array_equal(
            load, np.bincount(experts_bf16.ravel(), minlength=E)
        ):
            break
    else:
        raise AssertionError("no input separates float32 from bfloat16 routing")

    layer = build_routed_layer(ep8_mesh, spec, True, True, params, dtype=bf16)
    assert layer.w_gate[...].dtype == bf16 and layer.router_kernel[...].dtype == bf16
    graphdef, state, rest = nnx.split(layer, nnx.Param, ...)
    fwd = jax.jit(lambda s, r, x: nnx.merge(graphdef, s, r)(x))
    y, stats = fwd(state, rest, place_batch(ep8_mesh, jnp.asarray(x, bf16)))
    assert y.dtype == bf16 and y.shape == x.shape
    assert int(stats.replicas) > 0 and int(stats.dropped) == 0
    np.testing.assert_array_equal(np.asarray(stats.expert_load), load)
    (ref_y, _, _), _ = reference_value_and_grads(
        jnp.asarray(x),
        {k: jnp.asarray(v) for k, v in params.items()},
        jnp.asarray(experts),
        jnp.zeros(x.shape, jnp.float32),
        spec,
        True,
    )
    assert_close(np.asarray(y.astype(jnp.float32)), ref_y, "bf16 y", rtol=5e-2, atol=5e-2)
