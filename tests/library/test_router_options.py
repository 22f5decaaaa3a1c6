"""Options the Hugging Face families need, against the independent references:
`SigmoidTopK(renormalize=False)` (DeepSeek-V3 configurations with ``norm_topk_prob=False``),
`SigmoidTopK(masked_group_score=0.0)` (transformers' group masking) and
`MoE(shared_expert_gate=True)` (Qwen2-MoE's shared expert times ``sigmoid(x @ g)``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ultraep_jax as uep
from tests.helpers import (
    assert_raises_one_line,
    build_layer,
    draw_routed_inputs,
    layer_value_and_grads,
    make_mesh,
    place_batch,
)
from tests.references.layer import EXPERT_NAMES, SHARED_NAMES, reference_layer
from tests.references.routing import Router, router_weights, select_experts


@pytest.mark.parametrize("renormalize", [False, True])
def test_sigmoid_topk_weights_equal_reference(renormalize):
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)
    bias = jnp.asarray(0.1 * rng.normal(size=8), jnp.float32)
    options = dict(num_groups=4, top_groups=2, scale=2.5, renormalize=renormalize)
    router = uep.SigmoidTopK(2, **options)
    ref = Router("sigmoid", 2, **options)
    experts, margin = select_experts(logits, ref, bias)
    assert margin > 1e-6  # no near-tie decides the choice
    routing = jax.jit(router)(logits, bias)
    np.testing.assert_array_equal(np.asarray(routing.experts), experts)
    cot = jnp.asarray(rng.normal(size=(32, 2)), jnp.float32)
    # Each side one program, not op by op.
    got, g_got = jax.jit(jax.value_and_grad(lambda l: jnp.sum(router(l, bias).weights * cot)))(
        logits
    )
    want, g_want = jax.jit(
        jax.value_and_grad(lambda l: jnp.sum(router_weights(l, experts, ref) * cot))
    )(logits)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-6)
    sums = np.asarray(jnp.sum(routing.weights, axis=-1))
    if renormalize:
        np.testing.assert_allclose(sums, 2.5, rtol=1e-6)
    else:  # the raw scores: each weight 2.5 x a sigmoid, so their sums spread below 2 x 2.5
        assert sums.max() < 5.0 and np.ptp(sums) > 0.1


def test_gated_shared_expert_equals_dense_reference_balanced_or_not():
    D, F, E, K = 8, 8, 8, 2
    mesh = make_mesh("dp2ep4")
    rng = np.random.default_rng(5)
    x, params = draw_routed_inputs(rng, 8, 8, D, F, E, skew=True)
    params |= {
        n: (rng.normal(size=s) / np.sqrt(s[0])).astype(np.float32)
        for n, s in (
            ("shared_gate", (D, F)),
            ("shared_up", (D, F)),
            ("shared_down", (F, D)),
            ("shared_expert_gate", (D, 1)),
        )
    }
    names = ("router_kernel", *EXPERT_NAMES, *SHARED_NAMES, "shared_expert_gate")
    cot = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    ref = Router("softmax", K)
    experts, margin = select_experts(x.reshape(-1, D) @ params["router_kernel"], ref)
    assert margin > 1e-6

    def reference(x, params):
        return jnp.sum(reference_layer(x, params, experts, ref, shared=True) * cot)

    grad = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))  # one program, not op by op
    want, (g_x, g_p) = grad(jnp.asarray(x), params)
    results = []
    for balancer in (
        uep.BalancerConfig(slots_per_rank=1, min_tokens_per_replica=1, min_tokens_per_rank=1),
        None,
    ):
        layer = build_layer(
            mesh,
            params,
            d_model=D,
            d_ff=F,
            num_experts=E,
            top_k=K,
            balancer=balancer,
            capacity_factor=None,
            shared_d_ff=F,
            shared_expert_gate=True,
        )
        y, stats, gx, grads = layer_value_and_grads(layer, place_batch(mesh, x), cot, names)
        assert int(stats.dropped.sum()) == 0
        np.testing.assert_allclose(np.sum(y * np.asarray(cot)), want, rtol=1e-5)
        np.testing.assert_allclose(gx, g_x, rtol=1e-4, atol=1e-5)
        for name in names:
            np.testing.assert_allclose(grads[name], g_p[name], rtol=1e-4, atol=1e-5, err_msg=name)
        results.append((y, int(stats.replicas.sum())))
    (y_bal, replicas), (y_plain, _) = results
    assert replicas > 0  # the skewed batch made replicas
    np.testing.assert_allclose(y_bal, y_plain, rtol=1e-6, atol=1e-6)


def test_shared_expert_gate_needs_a_shared_expert():
    with pytest.raises(ValueError, match="shared_expert_gate=True gates a shared expert"):
        uep.MoE(
            8,
            8,
            8,
            2,
            make_mesh("ep8"),
            shared_expert_gate=True,
            rngs=nnx.Rngs(0),
        )


def _negative_bias_case(seed=11):
    """Logits [64, 8] and a bias around -0.6 (DeepSeek-V3's ``e_score_correction_bias`` pushed
    far down): many biased scores are negative, some positive."""
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)
    bias = jnp.asarray(-0.6 + 0.3 * rng.normal(size=8), jnp.float32)
    return logits, bias


@pytest.mark.parametrize("fill", [-np.inf, 0.0], ids=["deepseek_reference", "transformers"])
def test_sigmoid_topk_masked_group_score_equals_reference(fill):
    """`SigmoidTopK(masked_group_score=...)`: the dropped groups' experts keyed -inf (never
    chosen: DeepSeek's reference) or 0.0 (transformers: chosen over a kept expert whose biased
    score is negative), each against the NumPy reference of its rule, on a bias where the two
    rules choose differently."""
    logits, bias = _negative_bias_case()
    options = dict(num_groups=4, top_groups=2, scale=2.5)
    router = uep.SigmoidTopK(2, masked_group_score=fill, **options)
    ref = Router("sigmoid", 2, masked_group_score=fill, **options)
    experts, margin = select_experts(logits, ref, bias)
    assert margin > 1e-6  # no near-tie decides the choice
    other_rule = Router("sigmoid", 2, masked_group_score=0.0 if fill < 0 else -np.inf, **options)
    other, _ = select_experts(logits, other_rule, bias)
    assert (np.sort(experts, -1) != np.sort(other, -1)).any(), "the two rules chose alike"
    routing = jax.jit(router)(logits, bias)
    np.testing.assert_array_equal(np.asarray(routing.experts), experts)
    np.testing.assert_allclose(
        np.asarray(routing.weights), np.asarray(router_weights(logits, experts, ref)), rtol=1e-6
    )
    assert router.masked_group_score == fill
    assert uep.SigmoidTopK(2, **options).masked_group_score == -np.inf  # the default


def test_sigmoid_topk_masked_group_score_refuses_nan_inf_and_non_numbers():
    assert_raises_one_line(
        TypeError, r"SigmoidTopK: masked_group_score must be a real number", uep.SigmoidTopK, 2,
        masked_group_score="0",
    )  # fmt: skip
    for bad in (np.nan, np.inf):
        assert_raises_one_line(
            ValueError, r"SigmoidTopK: masked_group_score must be a number or -inf",
            uep.SigmoidTopK, 2, masked_group_score=bad,
        )  # fmt: skip
