"""Tests of the dense MoE reference (tests/references/moe.py): a case worked by hand, and random
cases against a plain loop over tokens and choices in NumPy float64 with each activation, the
keep mask, the token mask and the shared expert."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.references.moe import reference_moe

#: The activations in float64, written from their definitions.
ACT64 = {
    "silu": lambda z: z / (1.0 + math.exp(-z)),
    "gelu": lambda z: 0.5 * z * (1.0 + math.erf(z / math.sqrt(2.0))),
    "gelu_tanh": lambda z: (
        0.5 * z * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))
    ),
    "relu": lambda z: max(z, 0.0),
}


def loop_moe(x, experts, weights, params, keep=None, mask=None, activation="silu", shared=None):
    """float64 [T, D]: token by token, choice by choice, the gated experts as sums of products."""
    act = ACT64[activation]
    x, weights = np.asarray(x, np.float64), np.asarray(weights, np.float64)
    T, D = x.shape
    k = experts.shape[1]

    def glu(xt, w_gate, w_up, w_down):
        F = w_gate.shape[1]
        h = [
            act(sum(xt[d] * w_gate[d, f] for d in range(D)))
            * sum(xt[d] * w_up[d, f] for d in range(D))
            for f in range(F)
        ]
        return np.array([sum(h[f] * w_down[f, o] for f in range(F)) for o in range(D)])

    y = np.zeros((T, D))
    for t in range(T):
        if mask is not None and not mask[t]:
            continue
        for j in range(k):
            if keep is None or keep[t, j]:
                e = experts[t, j]
                y[t] += weights[t, j] * glu(x[t], *(np.asarray(w, np.float64)[e] for w in params))
        if shared is not None:
            y[t] += glu(x[t], *(np.asarray(w, np.float64) for w in shared))
    return y


# A case by hand: D = 2, E = 2, F = 1, relu.
#   expert 0: gate picks x0, up picks x1, down [1, 1]:  glu_0(x) = relu(x0) * x1 * [1, 1]
#   expert 1: gate picks x1, up picks x0, down [2, 0]:  glu_1(x) = relu(x1) * x0 * [2, 0]
#   shared:   gate x0 + x1, up x0,        down [1, -1]: s(x) = relu(x0 + x1) * x0 * [1, -1]
# token 0, x = (1, 2):  glu_0 = [2, 2], glu_1 = [4, 0],  s = [3, -3]
# token 1, x = (3, -1): glu_0 = [-3, -3], glu_1 = [0, 0], s = [6, -6]
HAND_X = [[1.0, 2.0], [3.0, -1.0]]
HAND_EXPERTS = [[0, 1], [1, 0]]
HAND_WEIGHTS = [[0.5, 0.25], [1.0, 2.0]]
HAND_PARAMS = (
    [[[1.0], [0.0]], [[0.0], [1.0]]],  # w_gate [E, D, F]
    [[[0.0], [1.0]], [[1.0], [0.0]]],  # w_up [E, D, F]
    [[[1.0, 1.0]], [[2.0, 0.0]]],  # w_down [E, F, D]
)
HAND_SHARED = ([[1.0], [1.0]], [[1.0], [0.0]], [[1.0, -1.0]])


@pytest.mark.parametrize(
    "options, want",
    [
        # y0 = 0.5 [2, 2] + 0.25 [4, 0] = [2, 1];  y1 = 1.0 [0, 0] + 2.0 [-3, -3] = [-6, -6]
        ({}, [[2.0, 1.0], [-6.0, -6.0]]),
        # token 0's second pair dropped: y0 = [1, 1]
        ({"keep": np.array([[True, False], [True, True]])}, [[1.0, 1.0], [-6.0, -6.0]]),
        # token 1 masked: 0
        ({"mask": np.array([True, False])}, [[2.0, 1.0], [0.0, 0.0]]),
        # y0 = [2, 1] + [3, -3] = [5, -2];  y1 = [-6, -6] + [6, -6] = [0, -12]
        ({"shared": HAND_SHARED}, [[5.0, -2.0], [0.0, -12.0]]),
        # the shared expert is masked too
        ({"shared": HAND_SHARED, "mask": np.array([True, False])}, [[5.0, -2.0], [0.0, 0.0]]),
    ],
    ids=["plain", "keep", "mask", "shared", "shared-mask"],
)
def test_hand_case(options, want):
    args = (np.asarray(HAND_X), np.asarray(HAND_EXPERTS), np.asarray(HAND_WEIGHTS), HAND_PARAMS)
    got = np.asarray(reference_moe(*args, activation="relu", **options))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(loop_moe(*args, activation="relu", **options), want)


def _draw(seed, lead=(2, 3), D=4, F=3, E=3, k=2, FS=2):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(*lead, D)).astype(np.float32)
    experts = rng.integers(0, E, size=(*lead, k)).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, size=(*lead, k)).astype(np.float32)
    params = (
        rng.normal(size=(E, D, F)).astype(np.float32),
        rng.normal(size=(E, D, F)).astype(np.float32),
        rng.normal(size=(E, F, D)).astype(np.float32),
    )
    shared = (
        rng.normal(size=(D, FS)).astype(np.float32),
        rng.normal(size=(D, FS)).astype(np.float32),
        rng.normal(size=(FS, D)).astype(np.float32),
    )
    keep = rng.random(size=(*lead, k)) < 0.7
    mask = rng.random(size=lead) < 0.7
    return x, experts, weights, params, shared, keep, mask


@pytest.mark.parametrize("activation", sorted(ACT64))
@pytest.mark.parametrize("with_masks", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("with_shared", [False, True], ids=["routed", "shared"])
def test_random_cases_equal_the_loop(activation, with_masks, with_shared):
    """[2, 3] tokens (any leading shape), each activation, with and without the keep and token
    masks and the shared expert: float32 at HIGHEST within float32 rounding of the float64 loop."""
    x, experts, weights, params, shared, keep, mask = _draw(len(activation) + 2 * with_masks)
    options = {
        "keep": keep if with_masks else None,
        "mask": mask if with_masks else None,
        "shared": shared if with_shared else None,
    }
    got = reference_moe(x, experts, weights, params, activation=activation, **options)
    assert got.shape == x.shape and got.dtype == jnp.float32
    T = x.shape[0] * x.shape[1]
    flat = {
        "keep": None if options["keep"] is None else keep.reshape(T, -1),
        "mask": None if options["mask"] is None else mask.reshape(T),
        "shared": options["shared"],
    }
    want = loop_moe(
        x.reshape(T, -1),
        experts.reshape(T, -1),
        weights.reshape(T, -1),
        params,
        activation=activation,
        **flat,
    )
    np.testing.assert_allclose(np.asarray(got).reshape(T, -1), want, rtol=1e-5, atol=1e-5)
    if with_masks:
        np.testing.assert_array_equal(np.asarray(got)[~mask], 0)


def test_dropped_pairs_and_unchosen_experts_reach_nothing():
    """Ids outside [0, E) on dropped pairs, NaN weights on dropped pairs and inf in an expert no
    pair chooses: the output and its gradients equal those of the pairs kept alone, all finite."""
    x, experts, weights, params, _, keep, _ = _draw(7)
    E = params[0].shape[0]
    # expert E - 1 is chosen by no pair; the dropped pairs' id -3 is clipped to expert 0
    experts = np.where(keep, experts % (E - 1), -3)
    weights = np.where(keep, weights, np.nan).astype(np.float32)
    params = tuple(p.copy() for p in params)
    params[0][E - 1, 0, 0] = np.inf

    def loss(x, weights, params, experts, keep):
        return jnp.sum(reference_moe(x, experts, weights, params, keep) ** 2)

    # One jitted program for both calls: op by op, every op of the gradient compiles on its own.
    value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    value, grads = value_and_grad(x, weights, params, experts, keep)
    clean = np.where(keep, weights, 0).astype(np.float32)
    clean_experts = np.where(keep, experts, 0)
    want, _ = value_and_grad(x, clean, params, clean_experts, np.ones_like(keep))
    np.testing.assert_allclose(float(value), float(want), rtol=1e-6)
    for g in jax.tree.leaves(grads):
        assert np.isfinite(np.asarray(g)).all()
    assert (np.asarray(grads[1])[~keep] == 0).all()
