"""A small decoder-only MoE transformer language model (Flax NNX) built from `uep.MoE`.

Pre-norm blocks of dense causal self-attention and a balanced expert-parallel MoE feed-forward
layer; byte-level vocabulary by default; learned positions; untied output head.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import ultraep_jax as uep
from ultraep_jax.tools import check_int


def check_positive_ints(config, names, prefix: str) -> None:
    """Raises, one line naming ``<prefix><name>`` (`check_int`: TypeError for a non-integer,
    ValueError below 1), for the first of ``names`` whose value on the frozen dataclass
    ``config`` is not an integer >= 1 (Python or NumPy; a bool is not one); stores the others as
    Python ints."""
    for name in names:
        object.__setattr__(config, name, check_int(f"{prefix}{name}", getattr(config, name)))


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
      router: which router, "softmax" (`uep.SoftmaxTopK`) or "sigmoid" (`uep.SigmoidTopK`,
        DeepSeek-V3).
      renormalize: softmax router only: the top-k weights renormalised to sum 1.
      num_groups: sigmoid router only: the experts split into this many equal groups.
      top_groups: sigmoid router only: a token chooses within its best ``top_groups`` groups.
      routed_scale: sigmoid router only: the routed weights' scale.
      bias_rate: sigmoid router only: the per-step move of the aux-loss-free bias.
      shared_d_ff: hidden width of a shared expert beside the routed ones (0: none).
      aux_loss_coef: weight of the router's load-balancing loss in `next_token_loss` (0: off).
      z_loss_coef: weight of the router's z-loss in `next_token_loss` (0: off).
      scan_layers: build the blocks stacked and run them with `nnx.scan`: compile time flat in
        depth, at some step time (on XLA:CPU 2 layers step 1.6x slower scanned); else unrolled.
      remat: recompute each block's activations in the backward pass (`nnx.remat`), all but the
        MoE layer's stage results (`uep.remat.NAMES`: plan, dispatch, exchanged rows, replicas).
      param_dtype: the parameters' dtype, "float32" or "bfloat16" (activations follow; router
        math stays float32).
    """

    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    d_ff: int = 128
    num_experts: int = 16
    top_k: int = 2
    max_seq_len: int = 128
    router: str = "softmax"
    renormalize: bool = True
    num_groups: int = 1
    top_groups: int = 1
    routed_scale: float = 1.0
    bias_rate: float = 1e-3
    shared_d_ff: int = 0
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    scan_layers: bool = False
    remat: bool = False
    param_dtype: str = "float32"

    _POSITIVE = (
        "vocab_size",
        "d_model",
        "num_layers",
        "num_heads",
        "d_ff",
        "num_experts",
        "top_k",
        "max_seq_len",
        "num_groups",
        "top_groups",
    )

    def __post_init__(self):
        check_positive_ints(self, self._POSITIVE, "ModelConfig.")
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"ModelConfig.router must be softmax or sigmoid, got {self.router!r}")
        if self.param_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"ModelConfig.param_dtype must be float32 or bfloat16, got {self.param_dtype!r}"
            )
        object.__setattr__(
            self, "shared_d_ff", check_int("ModelConfig.shared_d_ff", self.shared_d_ff, 0)
        )
        for name in ("routed_scale", "bias_rate", "aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if not (isinstance(value, numbers.Real) and math.isfinite(value) and value >= 0):
                raise ValueError(f"ModelConfig.{name} must be finite and >= 0, got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"ModelConfig: d_model={self.d_model} is not divisible by "
                f"num_heads={self.num_heads}"
            )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"ModelConfig: top_k={self.top_k} exceeds num_experts={self.num_experts}"
            )
        # The router's own checks (scale, groups dividing the experts, top_k within the groups).
        self.make_router().check_experts(self.num_experts)

    def make_router(self):
        """The `uep` router this configuration names."""
        if self.router == "softmax":
            return uep.SoftmaxTopK(self.top_k, renormalize=self.renormalize)
        return uep.SigmoidTopK(
            self.top_k, self.num_groups, self.top_groups, self.routed_scale, self.bias_rate
        )

    @property
    def dtype(self):
        """The parameters' and activations' dtype."""
        return jnp.dtype(self.param_dtype)


@dataclasses.dataclass(frozen=True)
class MoESettings:
    """How every MoE layer of the model runs: all that `uep.MoE` takes beside the model's shape,
    in one object, so that a program's choices reach each layer as they are and a new one needs
    no new argument on the way.

    Attributes:
      balancer: a `uep.BalancerConfig` for every MoE layer (the planner's choices: spare slots,
        floor, tolerance, ``max_fanout``, ``ranks_per_domain``, the fallback threshold; its
        sizes read from the layer), or None for plain expert parallelism.
      capacity_factor: receive-buffer size of each MoE layer (see `uep.MoE`); None is dropless.
      force_balanced: every MoE layer runs the force-balanced ideal (`uep.MoE`'s
        ``force_balanced``: a timing reference that changes the model's math).
      tensor_axis: the mesh axis splitting every expert's hidden width (`uep.MoE`'s
        ``tensor_axis``: expert tensor parallelism), or None.
      execution: how the routed experts run, a `uep.Execution` (planner, expert kernel,
        communication backend, transfer chunks, activation).
    """

    balancer: uep.BalancerConfig | None = None
    capacity_factor: float | None = None
    force_balanced: bool = False
    tensor_axis: str | None = None
    execution: uep.Execution = uep.Execution()

    def __post_init__(self):
        if self.balancer is not None and not isinstance(self.balancer, uep.BalancerConfig):
            raise TypeError(
                "MoESettings.balancer must be a uep.BalancerConfig or None, got "
                f"{type(self.balancer).__name__}"
            )
        if not isinstance(self.execution, uep.Execution):
            kind = type(self.execution).__name__
            raise TypeError(f"MoESettings.execution must be a uep.Execution, got {kind}")

    def layer_options(self) -> dict:
        """The keywords of `uep.MoE` these settings give."""
        return {
            "balancer": self.balancer,
            "capacity_factor": self.capacity_factor,
            "force_balanced": self.force_balanced,
            "tensor_axis": self.tensor_axis,
            "execution": self.execution,
        }


class CausalSelfAttention(nnx.Module):
    """Dense multi-head causal self-attention: [B, T, D] -> [B, T, D]."""

    def __init__(self, d_model: int, num_heads: int, dtype, *, rngs: nnx.Rngs):
        self.num_heads = num_heads
        kw = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.qkv = nnx.Linear(d_model, 3 * d_model, **kw)
        self.out = nnx.Linear(d_model, d_model, **kw)

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

    def __init__(self, cfg: ModelConfig, mesh: Mesh, settings: MoESettings, *, rngs: nnx.Rngs):
        dtype = cfg.dtype
        self.attn_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.num_heads, dtype, rngs=rngs)
        self.moe_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.moe = uep.MoE(
            d_model=cfg.d_model,
            d_ff=cfg.d_ff,
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            mesh=mesh,
            router=cfg.make_router(),
            shared_d_ff=cfg.shared_d_ff,
            param_dtype=dtype,
            rngs=rngs,
            **settings.layer_options(),
        )

    def __call__(
        self, x: jax.Array, token_mask: jax.Array | None = None
    ) -> tuple[jax.Array, uep.MoEStats]:
        x = x + self.attn(self.attn_norm(x))
        y, stats = self.moe(self.moe_norm(x), token_mask)
        return x + y, stats


class MoELM(nnx.Module):
    """Decoder-only MoE language model: tokens [B, T] -> (logits [B, T, V], stats).

    The blocks are stacked and scanned (``cfg.scan_layers``; their parameters carry a leading
    layer axis) or a list run in order. Either way the stats are one `uep.MoEStats` whose fields
    have a leading layer axis [num_layers, ...].

    Args:
      cfg: the model's shape.
      mesh: the device mesh; its "expert" axis carries expert parallelism, and the batch is
        split over all of its axes but the settings' ``tensor_axis``.
      settings: how every MoE layer runs (`MoESettings`; default: plain expert parallelism,
        dropless, the library's default execution).
      rngs: initialisation randomness.
    """

    def __init__(
        self, cfg: ModelConfig, mesh: Mesh, settings: MoESettings = MoESettings(), *, rngs: nnx.Rngs
    ):
        if not isinstance(settings, MoESettings):
            raise TypeError(f"MoELM: settings must be a MoESettings, got {type(settings).__name__}")
        self.cfg = cfg
        dtype = cfg.dtype
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.pos = nnx.Param(
            (jax.random.normal(rngs.params(), (cfg.max_seq_len, cfg.d_model)) * 0.02).astype(dtype)
        )

        def block(rngs):
            return Block(cfg, mesh, settings, rngs=rngs)

        if cfg.scan_layers:
            make = nnx.split_rngs(splits=cfg.num_layers)(nnx.vmap(block, in_axes=0, out_axes=0))
            self.blocks = make(rngs)
        else:
            self.blocks = nnx.List([block(rngs) for _ in range(cfg.num_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(
            cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs
        )

    def __call__(
        self, tokens: jax.Array, token_mask: jax.Array | None = None
    ) -> tuple[jax.Array, uep.MoEStats]:
        """Logits [B, T, V] and the stats of ``tokens`` [B, T]; ``token_mask`` bool [B, T] (True
        for a real token) keeps padding out of every MoE layer's routing, loads and stats (the
        attention is causal, so right padding never reaches a real token)."""
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(
                f"MoELM: sequence length {T} exceeds max_seq_len={self.cfg.max_seq_len}"
            )
        x = self.embed(tokens) + self.pos[...][:T]

        def run_block(block, x):
            return block(x, token_mask)

        if self.cfg.remat:
            # The MoE layers' plan, dispatch and exchanged rows are kept, so the backward pass
            # neither re-plans nor redoes the token all-to-alls (`uep.remat`).
            policy = jax.checkpoint_policies.save_only_these_names(*uep.remat.NAMES)
            run_block = nnx.remat(run_block, policy=policy)
        if self.cfg.scan_layers:
            scan = nnx.scan(run_block, in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0))
            x, stats = scan(self.blocks, x)
        else:
            per_layer = []
            for block in self.blocks:
                x, layer_stats = run_block(block, x)
                per_layer.append(layer_stats)
            stats = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
        return self.head(self.norm(x)), stats

    def update_router_biases(self, stats: uep.MoEStats) -> None:
        """Moves every layer's `uep.SigmoidTopK` bias from its exact loads (``stats`` from a
        call of the model); nothing for a softmax router. Call once per training step."""
        if self.cfg.router != "sigmoid":
            return
        if self.cfg.scan_layers:
            self.blocks.moe.update_router_bias(stats)  # stacked: [L, E] biases and loads
        else:
            for i, block in enumerate(self.blocks):
                block.moe.update_router_bias(jax.tree.map(lambda a, i=i: a[i], stats))


def next_token_loss(model: MoELM, batch: jax.Array) -> tuple[jax.Array, uep.MoEStats]:
    """Mean next-token cross-entropy of ``batch`` int32 [B, T + 1], plus the router losses the
    config weighs in, and the MoE stats (leading layer axis)."""
    logits, stats = model(batch[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1)[..., 0]
    cfg = model.cfg
    loss = jnp.mean(nll)
    if cfg.aux_loss_coef:
        loss = loss + cfg.aux_loss_coef * jnp.sum(stats.aux_loss)
    if cfg.z_loss_coef:
        loss = loss + cfg.z_loss_coef * jnp.sum(stats.z_loss)
    return loss, stats
