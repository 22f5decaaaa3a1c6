"""Tests of the routers' reference (tests/references/routing.py) on cases worked by hand (the
library's routers are checked against it, and against more hand cases, in
tests/library/test_routing.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from tests.references import routing
from tests.references.routing import Router, select_experts

# Compiled, one program per case (op by op, each of their operations compiles alone).
router_weights = jax.jit(routing.router_weights, static_argnums=2)
router_losses = jax.jit(routing.router_losses, static_argnums=2)


def test_softmax_picks_the_largest_logits_best_first_ties_to_the_smaller_index():
    # keys [1, 3, 2, 3]: top-2 is experts 1 and 3 (a tie at 3, the smaller index first); the
    # decision k-th vs (k+1)-th is 3 vs 2: margin 1.
    experts, margin = select_experts([[1.0, 3.0, 2.0, 3.0]], Router("softmax", 2))
    np.testing.assert_array_equal(experts, [[1, 3]])
    assert margin == 1.0
    experts, margin = select_experts([[1.0, 3.0, 2.0, 3.0]], Router("softmax", 4))
    np.testing.assert_array_equal(experts, [[1, 3, 2, 0]])
    assert margin == math.inf  # every expert chosen: no decision


def test_sigmoid_groups_and_bias():
    # Scores s = [0.9, 0.8, 0.1, 0.85] (logits log(s / (1 - s))), groups of 2, one kept: group 0
    # (0.9 + 0.8 = 1.7) beats group 1 (0.1 + 0.85 = 0.95): experts 0, 1. The margin is the
    # groups' 0.75 (the dropped group's experts are out, so the experts' choice decides nothing).
    # A bias of +1 on expert 2 makes group 1 1.1 + 0.85 = 1.95: experts 2, 3.
    scores = np.array([[0.9, 0.8, 0.1, 0.85]])
    logits = np.log(scores / (1 - scores))
    router = Router("sigmoid", 2, num_groups=2, top_groups=1, scale=2.0)
    experts, margin = select_experts(logits, router)
    np.testing.assert_array_equal(experts, [[0, 1]])
    np.testing.assert_allclose(margin, 0.75)
    experts, _ = select_experts(logits, router, bias=[0.0, 0.0, 1.0, 0.0])
    np.testing.assert_array_equal(experts, [[2, 3]])
    # weights: the unbiased scores 0.1, 0.85 normalised, times the scale 2
    weights = router_weights(jnp.asarray(logits), jnp.asarray([[2, 3]]), router)
    np.testing.assert_allclose(np.asarray(weights), [[0.2 / 0.95, 1.7 / 0.95]], rtol=1e-6)


def test_softmax_weights_and_losses():
    # logits [log 3, 0] for two tokens: probabilities [3/4, 1/4]; top-1 picks expert 0 for both.
    logits = jnp.asarray([[math.log(3), 0.0], [math.log(3), 0.0]])
    experts = jnp.asarray([[0], [0]])
    np.testing.assert_allclose(router_weights(logits, experts, Router("softmax", 1)), [[1], [1]])
    raw = Router("softmax", 1, renormalize=False)
    np.testing.assert_allclose(router_weights(logits, experts, raw), [[0.75], [0.75]], rtol=1e-6)
    # aux = E / (k T) * sum_e count_e * mean_t p_te = 2 / 2 * (2 * 3/4) = 3/2; z = (log 4)^2
    aux, z = router_losses(logits, experts, raw)
    np.testing.assert_allclose(float(aux), 1.5, rtol=1e-6)
    np.testing.assert_allclose(float(z), math.log(4) ** 2, rtol=1e-6)
