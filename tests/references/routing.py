"""The routers' reference, written independently of `ultraep_jax.routers`: which experts a token
picks (NumPy float64), and the differentiable parts on a fixed choice (plain jnp): the weights,
the normalised scores and the two router losses.

Softmax top-k picks the k largest logits (softmax is monotone) and weighs each choice by its
probability, renormalised over the k choices or not; top-k-then-softmax (gpt-oss) picks the same
and weighs each choice by the softmax of the k chosen logits. DeepSeek-V3 sigmoid routing picks on
sigmoid scores plus the bias, among the experts of the ``top_groups`` groups whose two best biased
scores sum highest (the other groups' experts keyed ``masked_group_score``: -inf, never chosen, as
DeepSeek's reference code; 0.0 as transformers), and weighs each choice by its unbiased score
normalised over the k, times ``scale``.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Router:
    """A router as the reference sees it."""

    kind: str  # "softmax", "topk_softmax" or "sigmoid"
    top_k: int
    renormalize: bool = True
    num_groups: int = 1
    top_groups: int = 1
    scale: float = 1.0
    masked_group_score: float = -math.inf  # the key of the dropped groups' experts


def _sigmoid64(z):
    return 1.0 / (1.0 + np.exp(-np.asarray(z, np.float64)))


def select_experts(logits, router: Router, bias=None):
    """(experts int [T, k] best first, margin): the choice from float64 logits [T, E], and the
    smallest gap at any decision it made (k-th vs (k+1)-th key, groups kept vs dropped; inf
    where there was no decision). Ties go to the smaller index (two experts of dropped groups
    tie at ``masked_group_score``: not counted as a decision)."""
    logits = np.asarray(logits, np.float64)
    T, n = logits.shape
    k = router.top_k
    margin = math.inf
    if router.kind in ("softmax", "topk_softmax"):
        key = logits  # softmax is monotone
    else:
        key = _sigmoid64(logits) + (0.0 if bias is None else np.asarray(bias, np.float64))
        G, TG = router.num_groups, router.top_groups
        if TG < G:
            grouped = key.reshape(T, G, n // G)
            best = -np.sort(-grouped, axis=-1)[..., :2]
            group_score = best.sum(-1)  # sum of the (up to) two best biased scores
            keep = np.argsort(-group_score, axis=-1, kind="stable")[:, :TG]
            allowed = np.zeros((T, G), bool)
            allowed[np.arange(T)[:, None], keep] = True
            key = np.where(np.repeat(allowed, n // G, axis=1), key, router.masked_group_score)
            srt = -np.sort(-group_score, axis=-1)
            margin = min(margin, float(np.min(srt[:, TG - 1] - srt[:, TG])))
    experts = np.argsort(-key, axis=-1, kind="stable")[:, :k]
    srt = -np.sort(-key, axis=-1)
    if k < n:
        last, next_ = srt[:, k - 1], srt[:, k]
        fill = router.masked_group_score
        decided = np.isfinite(next_) & ~((last == fill) & (next_ == fill))
        if decided.any():
            margin = min(margin, float(np.min((last - next_)[decided])))
    return experts, margin


def router_probs(logits, router: Router):
    """[T, E] the normalised scores the aux loss averages: softmax (of every logit, for both
    softmax routers), or sigmoid / row sum."""
    if router.kind in ("softmax", "topk_softmax"):
        ex = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
        return ex / jnp.sum(ex, axis=-1, keepdims=True)
    s = 1.0 / (1.0 + jnp.exp(-logits))
    return s / jnp.sum(s, axis=-1, keepdims=True)


def router_weights(logits, experts, router: Router):
    """[T, k] the weights of the fixed choices ``experts``: chosen softmax probabilities
    (renormalised or not), the softmax of the chosen logits alone ("topk_softmax"), or chosen
    unbiased sigmoid scores (normalised to 1 or not), times ``scale``."""
    if router.kind == "topk_softmax":
        chosen = jnp.take_along_axis(logits, experts, axis=-1)
        ex = jnp.exp(chosen - jnp.max(chosen, axis=-1, keepdims=True))
        return ex / jnp.sum(ex, axis=-1, keepdims=True)
    if router.kind == "softmax":
        w = jnp.take_along_axis(router_probs(logits, router), experts, axis=-1)
        return w / jnp.sum(w, axis=-1, keepdims=True) if router.renormalize else w
    s = jnp.take_along_axis(1.0 / (1.0 + jnp.exp(-logits)), experts, axis=-1)
    return router.scale * (s / jnp.sum(s, axis=-1, keepdims=True) if router.renormalize else s)


def router_losses(logits, experts, router: Router):
    """(aux, z): ``E/(K T) sum_e count_e mean_t p_te`` and ``mean_t logsumexp(logits_t)^2``."""
    T, n = logits.shape
    k = experts.shape[-1]
    count = jnp.zeros((n,), jnp.float32).at[experts.reshape(-1)].add(1.0)
    aux = n / (k * T) * jnp.sum(count * jnp.mean(router_probs(logits, router), axis=0))
    m = jnp.max(logits, axis=-1)
    lse = m + jnp.log(jnp.sum(jnp.exp(logits - m[:, None]), axis=-1))
    return aux, jnp.mean(lse**2)
