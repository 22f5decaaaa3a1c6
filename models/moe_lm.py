"""A small decoder-only MoE transformer language model (Flax NNX) built from `uep.MoE`.

Pre-norm blocks of dense causal self-attention and a balanced expert-parallel MoE feed-forward
layer; byte-level vocabulary by default; learned positions; untied output head.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import ultraep_jax as uep


def check_positive_ints(config, names, prefix: str) -> None:
    """Raises ValueError, one line ``<prefix><name> must be a positive int, got <value>``, for the
    first of ``names`` whose value on ``config`` is not an int >= 1 (a bool is not one here)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{prefix}{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of the model.

    Attributes:
      vocab_size: tokens (256 for bytes).
      d_model: residual width.
      num_layers: transformer blocks, each with one MoE layer.
      num_heads: attention heads; must divide ``d_model``.
      d_ff: hidden width of each expert.
      num_experts: experts per MoE layer.
      top_k: experts per token.
      max_seq_len: longest sequence the learned positions cover.
    """

    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    d_ff: int = 128
    num_experts: int = 16
    top_k: int = 2
    max_seq_len: int = 128

    def __post_init__(self):
        check_positive_ints(self, [f.name for f in dataclasses.fields(self)], "ModelConfig.")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"ModelConfig: d_model={self.d_model} is not divisible by "
                f"num_heads={self.num_heads}"
            )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"ModelConfig: top_k={self.top_k} exceeds num_experts={self.num_experts}"
            )


class CausalSelfAttention(nnx.Module):
    """Dense multi-head causal self-attention: [B, T, D] -> [B, T, D]."""

    def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
        self.num_heads = num_heads
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        B, T, D = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(B, T, 3 * self.num_heads, -1), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(x.dtype)
        causal = jnp.tril(jnp.ones((T, T), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        attn = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(B, T, D))


class Block(nnx.Module):
    """Pre-norm transformer block: attention, then the balanced MoE feed-forward layer."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, balancer, capacity_factor, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.num_heads, rngs=rngs)
        self.moe_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.moe = uep.MoE(
            d_model=cfg.d_model,
            d_ff=cfg.d_ff,
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            mesh=mesh,
            balancer=balancer,
            capacity_factor=capacity_factor,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, uep.MoEStats]:
        x = x + self.attn(self.attn_norm(x))
        y, stats = self.moe(self.moe_norm(x))
        return x + y, stats


class MoELM(nnx.Module):
    """Decoder-only MoE language model: tokens [B, T] -> (logits [B, T, V], stats per layer).

    Args:
      cfg: the model's shape.
      mesh: the device mesh; its "expert" axis carries expert parallelism, and the batch is
        split over all of its axes.
      balancer: a `uep.BalancerConfig` for every MoE layer, or None for plain expert parallelism.
      capacity_factor: receive-buffer size of each MoE layer (see `uep.MoE`); None is dropless.
      rngs: initialisation randomness.
    """

    def __init__(
        self, cfg: ModelConfig, mesh: Mesh, balancer=None, capacity_factor=None, *, rngs: nnx.Rngs
    ):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.pos = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.max_seq_len, cfg.d_model)) * 0.02
        )
        self.blocks = nnx.List(
            [Block(cfg, mesh, balancer, capacity_factor, rngs=rngs) for _ in range(cfg.num_layers)]
        )
        self.norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, list[uep.MoEStats]]:
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(
                f"MoELM: sequence length {T} exceeds max_seq_len={self.cfg.max_seq_len}"
            )
        x = self.embed(tokens) + self.pos[...][:T]
        stats = []
        for block in self.blocks:
            x, layer_stats = block(x)
            stats.append(layer_stats)
        return self.head(self.norm(x)), stats


def next_token_loss(model: MoELM, batch: jax.Array) -> tuple[jax.Array, list[uep.MoEStats]]:
    """Mean next-token cross-entropy of ``batch`` int32 [B, T + 1], and the MoE stats."""
    logits, stats = model(batch[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1)[..., 0]
    return jnp.mean(nll), stats
