"""Routers: from router logits to each token's experts and weights, plus opt-in router losses.

A router is a small frozen dataclass called as ``router(logits_TE, bias_E, mask_T)`` that
returns a `Routing` (``mask_T``: bool [T], True for a real token, or None; padding tokens count
in neither loss). Three are provided:

- `SoftmaxTopK`: softmax over the experts, the top k, weights optionally renormalised to sum 1
  (Mixtral, Qwen-MoE, Switch).
- `TopKSoftmax`: the top k logits, then a softmax over those k (gpt-oss). The same experts and,
  up to rounding, the same weights as ``SoftmaxTopK(renormalize=True)``, computed in gpt-oss's
  order (the logits not chosen get no gradient at all).
- `SigmoidTopK`: DeepSeek-V3. Sigmoid scores; the choice is made on scores plus a per-expert
  bias (aux-loss-free balancing: `update_bias` nudges the bias from the exact loads the layer
  reports), optionally limited to the best groups of experts; the weights are the chosen scores
  without the bias, normalised to sum 1 (or not: ``renormalize=False``) and scaled.

Router math is float32 whatever the parameters' dtype.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from ultraep_jax.base.arguments import check_finite, check_positive_int
from ultraep_jax.planning.loads import pair_experts


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """A router's decision for T tokens.

    Attributes:
      experts: int32 [T, K], the chosen experts, best first.
      weights: float32 [T, K], each choice's weight in the combined output.
      aux_loss: float32 [], the load-balancing loss ``E / (K T) * sum_e count_e * p_e`` (count_e:
        pairs routed to e, p_e: e's mean normalised score); 1 when perfectly balanced. Add it to
        the training loss with a small coefficient to use it.
      z_loss: float32 [], mean over tokens of ``logsumexp(logits)^2`` (router z-loss).
    """

    experts: jax.Array
    weights: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array


def _losses(logits_TE, probs_TE, experts_TK, mask_T=None):
    """(aux_loss, z_loss) of one routing over the real tokens (``mask_T`` True; all when None);
    ``probs_TE`` rows sum to 1."""
    T, E = logits_TE.shape
    K = experts_TK.shape[-1]
    real_T = jnp.ones((T,), bool) if mask_T is None else mask_T
    # Masked tokens choose no expert and weigh 0 in the means. The count is a one-hot sum, not a
    # scatter-add (`planning.loads.expert_loads`): in the layer's program XLA splits these [T, ...]
    # arrays over the token devices, padded when T does not divide them, and its scatter-add over
    # such a split counted the padding rows (for expert 0; seen with one expert per token beside
    # a tensor axis), where a reduction leaves them out.
    pair_E = jax.nn.one_hot(pair_experts(experts_TK, E, mask_T), E, dtype=jnp.int32)
    count_E = jax.lax.stop_gradient(jnp.sum(pair_E, axis=0)).astype(jnp.float32)
    n = jnp.maximum(jnp.sum(real_T, dtype=jnp.float32), 1.0)
    mean_probs_E = jnp.sum(jnp.where(real_T[:, None], probs_TE, 0), axis=0) / n
    aux = E / (K * n) * jnp.sum(count_E * mean_probs_E)
    z = jnp.sum(jnp.where(real_T, jax.nn.logsumexp(logits_TE, axis=-1) ** 2, 0)) / n
    return aux, z


def _check_top_k(router: str, top_k: int, num_experts: int) -> None:
    """Raises ValueError (one line naming ``router``) when ``top_k`` exceeds ``num_experts``."""
    if top_k > num_experts:
        raise ValueError(f"{router}: top_k={top_k} exceeds num_experts={num_experts}")


@dataclasses.dataclass(frozen=True)
class _SoftmaxRouter:
    """What `SoftmaxTopK` and `TopKSoftmax` share: K, no bias, float32 logits in and `Routing`
    out with `_losses` over the softmax of every expert's logit; a subclass chooses the experts
    and their weights (`_choose`)."""

    top_k: int

    uses_bias = False

    def __post_init__(self):
        name = type(self).__name__
        object.__setattr__(self, "top_k", check_positive_int(name, "top_k", self.top_k))

    def check_experts(self, num_experts: int) -> None:
        """Raises ValueError (one line) unless this router can choose among ``num_experts``."""
        _check_top_k(type(self).__name__, self.top_k, num_experts)

    def __call__(
        self, logits_TE: jax.Array, bias_E: jax.Array | None = None, mask_T: jax.Array | None = None
    ) -> Routing:
        del bias_E
        self.check_experts(logits_TE.shape[-1])
        logits_TE = logits_TE.astype(jnp.float32)
        probs_TE = jax.nn.softmax(logits_TE, axis=-1)
        weights_TK, experts_TK = self._choose(logits_TE, probs_TE)
        experts_TK = experts_TK.astype(jnp.int32)
        return Routing(experts_TK, weights_TK, *_losses(logits_TE, probs_TE, experts_TK, mask_T))

    def _choose(self, logits_TE: jax.Array, probs_TE: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(weights float32 [T, K], experts [T, K]) from float32 logits and their softmax."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class SoftmaxTopK(_SoftmaxRouter):
    """Softmax top-k routing.

    Attributes:
      top_k: K, experts per token (an int >= 1; NumPy integers accepted).
      renormalize: weights are the chosen probabilities divided by their sum (True) or the
        probabilities themselves (False); a bool.
    """

    renormalize: bool = True

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.renormalize, (bool, np.bool_)):
            raise TypeError(f"SoftmaxTopK: renormalize must be a bool, got {self.renormalize!r}")
        object.__setattr__(self, "renormalize", bool(self.renormalize))

    def _choose(self, logits_TE, probs_TE):
        weights_TK, experts_TK = jax.lax.top_k(probs_TE, self.top_k)
        if self.renormalize:
            weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
        return weights_TK, experts_TK


@dataclasses.dataclass(frozen=True)
class TopKSoftmax(_SoftmaxRouter):
    """Top-k-then-softmax routing (gpt-oss): the k largest logits, their weights a softmax over
    those k (so they sum to 1). The losses are `SoftmaxTopK`'s: the aux loss's scores are the
    softmax over all the experts.

    Attributes:
      top_k: K, experts per token (an int >= 1; NumPy integers accepted).
    """

    def _choose(self, logits_TE, probs_TE):
        chosen_TK, experts_TK = jax.lax.top_k(logits_TE, self.top_k)
        return jax.nn.softmax(chosen_TK, axis=-1), experts_TK


@dataclasses.dataclass(frozen=True)
class SigmoidTopK:
    """DeepSeek-V3 routing: sigmoid scores, bias-adjusted and group-limited choice.

    Attributes:
      top_k: K, experts per token.
      num_groups: the experts split into this many equal groups (1: no group limit).
      top_groups: a token may only choose experts in its best ``top_groups`` groups, a group's
        worth being the sum of its two best biased scores (its best one with one expert per group).
      scale: the weights are multiplied by this (DeepSeek-V3's routed scaling factor), finite > 0.
      bias_rate: how far `update_bias` moves each expert's bias per step (0: a fixed bias).
      renormalize: the chosen scores divided by their sum before the scale (True, DeepSeek-V3's
        ``norm_topk_prob=True``) or taken as they are (False); a bool.
      masked_group_score: the biased score the experts of a token's other groups (those not
        among its best ``top_groups``) compete with in the top-k: ``-inf`` (the default) never
        chooses them, as DeepSeek's own reference does (DeepSeek-V3's ``inference/model.py``
        fills them with ``float("-inf")``); ``0.0`` is transformers' rule (its DeepSeek-V3 and
        GLM-4.5 routers fill them with 0.0), under which such an expert is chosen over a kept
        one whose biased score is negative (a strongly negative ``e_score_correction_bias``).
        The two choose alike while every kept expert's biased score is >= 0. A real number
        other than NaN and +inf.

    Integers may be NumPy integers and the floats any real scalars; they are stored as Python
    ``int`` / ``float``.
    """

    top_k: int
    num_groups: int = 1
    top_groups: int = 1
    scale: float = 1.0
    bias_rate: float = 1e-3
    renormalize: bool = True
    masked_group_score: float = -math.inf

    uses_bias = True

    def __post_init__(self):
        for name in ("top_k", "num_groups", "top_groups"):
            object.__setattr__(
                self, name, check_positive_int("SigmoidTopK", name, getattr(self, name))
            )
        if self.top_groups > self.num_groups:
            raise ValueError(
                f"SigmoidTopK: top_groups={self.top_groups} exceeds num_groups={self.num_groups}"
            )
        object.__setattr__(
            self, "scale", check_finite("SigmoidTopK", "scale", self.scale, positive=True)
        )
        object.__setattr__(
            self,
            "bias_rate",
            check_finite("SigmoidTopK", "bias_rate", self.bias_rate, positive=False),
        )
        if not isinstance(self.renormalize, (bool, np.bool_)):
            raise TypeError(f"SigmoidTopK: renormalize must be a bool, got {self.renormalize!r}")
        object.__setattr__(self, "renormalize", bool(self.renormalize))
        fill = self.masked_group_score
        if isinstance(fill, (bool, np.bool_)) or not isinstance(fill, numbers.Real):
            raise TypeError(
                f"SigmoidTopK: masked_group_score must be a real number (-inf or 0.0), got "
                f"{type(fill).__name__} {fill!r}"
            )
        if math.isnan(fill) or fill == math.inf:
            raise ValueError(
                f"SigmoidTopK: masked_group_score must be a number or -inf (-inf: DeepSeek's "
                f"reference, 0.0: transformers'), got {fill!r}"
            )
        object.__setattr__(self, "masked_group_score", float(fill))

    def check_experts(self, num_experts: int) -> None:
        """Raises ValueError (one line) unless this router can choose among ``num_experts``: the
        groups must split them evenly and the best groups must hold ``top_k`` experts."""
        E = num_experts
        if E % self.num_groups:
            raise ValueError(
                f"SigmoidTopK: {E} experts do not split into num_groups={self.num_groups}"
            )
        if self.top_k > E // self.num_groups * self.top_groups:
            raise ValueError(
                f"SigmoidTopK: top_k={self.top_k} exceeds the experts of {self.top_groups} "
                f"groups of {E // self.num_groups}"
            )

    def __call__(
        self, logits_TE: jax.Array, bias_E: jax.Array | None = None, mask_T: jax.Array | None = None
    ) -> Routing:
        T, E = logits_TE.shape
        self.check_experts(E)
        logits_TE = logits_TE.astype(jnp.float32)
        scores_TE = jax.nn.sigmoid(logits_TE)
        bias_E = jnp.zeros((E,), jnp.float32) if bias_E is None else bias_E.astype(jnp.float32)
        choice_TE = jax.lax.stop_gradient(scores_TE) + bias_E
        if self.top_groups < self.num_groups:
            grouped = choice_TE.reshape(T, self.num_groups, -1)
            best = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0]
            _, keep_groups = jax.lax.top_k(jnp.sum(best, axis=-1), self.top_groups)
            allowed = (
                jnp.zeros((T, self.num_groups), bool)
                .at[jnp.arange(T)[:, None], keep_groups]
                .set(True)
            )
            allowed_TE = jnp.repeat(allowed, E // self.num_groups, axis=1)
            choice_TE = jnp.where(allowed_TE, choice_TE, self.masked_group_score)
        _, experts_TK = jax.lax.top_k(choice_TE, self.top_k)
        chosen_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=-1)
        if self.renormalize:
            chosen_TK = chosen_TK / jnp.sum(chosen_TK, axis=-1, keepdims=True)
        weights_TK = self.scale * chosen_TK
        experts_TK = experts_TK.astype(jnp.int32)
        probs_TE = scores_TE / jnp.sum(scores_TE, axis=-1, keepdims=True)
        return Routing(experts_TK, weights_TK, *_losses(logits_TE, probs_TE, experts_TK, mask_T))


def update_bias(bias_E: jax.Array, expert_load_E: jax.Array, rate: float) -> jax.Array:
    """float32 [..., E]: DeepSeek-V3's aux-loss-free bias step: up by ``rate`` for experts below
    the mean load, down for those above (``expert_load_E`` [..., E], the layer's exact loads;
    leading axes, such as stacked layers, are independent)."""
    load = jax.lax.stop_gradient(expert_load_E).astype(jnp.float32)
    return bias_E + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


def router_logits(
    x_TD: jax.Array, router_kernel_DE: jax.Array, logit_bias_E: jax.Array | None = None
) -> jax.Array:
    """float32 [T, E]: the router's logits ``x @ kernel (+ logit_bias)``, computed in float32
    (``logit_bias_E`` [E]: a trained bias, such as gpt-oss's router's; None: none)."""
    logits_TE = jnp.dot(x_TD.astype(jnp.float32), router_kernel_DE.astype(jnp.float32))
    return logits_TE if logit_bias_E is None else logits_TE + logit_bias_E.astype(jnp.float32)
