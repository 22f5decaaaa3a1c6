"""What the integration covers of MaxText: the release it was tested with, and every setting of
MaxText's config that its sparse path reads, each either covered or refused.

An allow-list: every config field that MaxText's sparse path (`RoutedMoE.sparse_matmul` and what
it calls, in MaxText 0.2.5's ``maxtext/layers/moe.py``) reads is in `COVERED` (the balanced block
computes it as MaxText does, or ultraep_jax's own setting takes its role, at any value) or in
`REFUSED` (refused when set away from MaxText's default); the tests check the two against the
installed source. `check_config` applies them, and the rules of the whole block, to a MaxText
config before a model is built (the command, right after MaxText's config is read); the block
checks its own module again when it is built and when it is called.
"""

from __future__ import annotations

import enum
import importlib.metadata

from ultraep_jax.base.activations import ClampedSwiGLU

#: The MaxText release the integration was tested with; `check_version` refuses any other.
TESTED_MAXTEXT = "0.2.5"
#: The keyword of `enable` (and the command's ``ultraep_`` key) that runs another release anyway.
OVERRIDE = "allow_untested_maxtext"

_ROUTER = "MaxText's router (get_topk), run as it is"
_BIAS = "the loss-free bias update, from the exact loads of every EP group"
_KERNEL = "MaxText's expert kernel: ultraep_expert_kernel picks ultraep_jax's"
_PLACEMENT = "placement inside MaxText's shard_map: ultraep_jax's shard_map in its place"
_QUANTIZED = "acts only with quantization, which is refused"
_AUX = "MaxText's aux loss (its functions) on the block's global arrays"
#: The sparse path's settings the balanced block covers, with how: at any value but those the
#: refusals of `config_refusal` name.
COVERED = {
    "num_experts": "E, from MaxText's config",
    "num_experts_per_tok": "K, from MaxText's config",
    "decoder_block": f"{_ROUTER}, and the experts' gated unit (llama4 refused)",
    "model_name": _ROUTER,
    "fuse_expert_scales": _ROUTER,
    "model_call_mode": _ROUTER,
    "n_routing_groups": _ROUTER,
    "topk_routing_group": _ROUTER,
    "norm_topk_prob": _ROUTER,
    "routed_scaling_factor": _ROUTER,
    "routed_score_func": _ROUTER,
    "router_topk_matmul_vjp": _ROUTER,
    "routed_bias": _BIAS,
    "routed_bias_update_rate": _BIAS,
    "gradient_accumulation_steps": f"{_BIAS} (the raw loads under accumulation, as MaxText)",
    "load_balance_loss_weight": _AUX,
    "moe_use_megatron_seq_aux_loss": _AUX,
    "te_moe_block": "refused when True: it hands the block to TransformerEngine",
    "mlp_bias": "the experts' biases, carried by replicas",
    "prefuse_moe_weights": "the fused wi, split by MaxText before the block",
    "mlp_activations_limit": "gpt-oss's clamped unit; refused for DeepSeek's",
    "attention": "any but the fused vllm_rpa and vllm_batched_rpa blocks (refused)",
    "megablox": _KERNEL,
    "use_tokamax_gmm": _KERNEL,
    "use_gmm_v2": _KERNEL,
    "use_gmm_v2_heuristic_tiling": _KERNEL,
    **{
        f"{w}_tile_{pass_}_{dim}": _KERNEL
        for w in ("wi", "wo")
        for pass_ in ("dlhs", "drhs")
        for dim in ("batch_seq", "embed_dim", "mlp_dim")
    },
    "check_vma": _PLACEMENT,
    "debug_sharding": _PLACEMENT,
    "use_qwix_quantization": _QUANTIZED,
    "act_quantization_calibration_method": _QUANTIZED,
}

_BUFFER = "MaxText's capped ragged buffer: ultraep_capacity_factor sizes ultraep_jax's"
_PROBE = "a probe of MaxText's ragged buffer: ultraep/... metrics instead"
_RING = "MaxText's ring-of-experts pipeline"
_OVERLAP = "MaxText's overlap of its weight all-gathers with its kernel"
_PINNED = "SparseCore pinning of MaxText's all-gathers"
_SORT = "MaxText's token sort and gather kernels"
_COMBINE = "the combine's precision: ultraep_jax sums in float32 at the default precision"
_LAYOUT = "a MaxText expert-weight layout over FSDP that the tests do not cover"
#: The sparse path's settings the balanced block does not apply: refused when set away from
#: MaxText's default, with why.
REFUSED = {
    "quantization": "quantized expert weights",
    "use_random_routing": "routing that is not the router's top-k",
    "use_ring_of_experts": "MaxText's own EP strategy",
    "shard_mode": "explicit sharding (only auto is covered)",
    "moe_quantize_token_all_gather": "quantized token all-gather",
    "moe_quantize_combine_bwd_method": "quantized combine in the backward pass",
    "moe_dropless_fallback": f"a fallback of {_BUFFER}",
    "ragged_buffer_factor": _BUFFER,
    "eval_ragged_buffer_factor": _BUFFER,
    "log_required_ragged_buffer_factor": _PROBE,
    "moe_log_max_load_ratio": _PROBE,
    "num_moe_token_chunks": _RING,
    "moe_chunk_barrier": _RING,
    "moe_topk_before_ep_all_gather": _RING,
    "defer_small_all_reduces": _RING,
    "num_moe_emb_chunks": _OVERLAP,
    "moe_fsdp_use_two_stage_all_gather": _OVERLAP,
    "moe_pin_sparse_core_all_gathers": _PINNED,
    "moe_pin_sparse_core_ep_all_gathers": _PINNED,
    "moe_pin_sparse_core_fsdp_all_gathers": _PINNED,
    "moe_pin_sparse_core_fsdp_all_gathers_fwd_only": _PINNED,
    "moe_ep_all_gather_sparse_core_id": _PINNED,
    "moe_fsdp_all_gather_sparse_core_id": _PINNED,
    "moe_routing_maps": "remat of MaxText's routing maps: ultraep_remat names the block's stages",
    "use_custom_sort_vjp": _SORT,
    "use_ragged_sort": _SORT,
    "ragged_sort_use_single_sparsecore": _SORT,
    "moe_use_direct_token_gather": _SORT,
    "ragged_gather_fallback": _SORT,
    "ragged_gather_reduce_fallback": _SORT,
    "ragged_gather_cost_estimate_flops": _SORT,
    "ragged_gather_cost_estimate_bytes_accessed": _SORT,
    "ragged_gather_reduce_cost_estimate_flops": _SORT,
    "ragged_gather_reduce_cost_estimate_bytes_accessed": _SORT,
    "float32_weight_sum": _COMBINE,
    "matmul_precision": _COMBINE,
    "shard_exp_on_fsdp": _LAYOUT,
    "shard_embed_moe_on_fsdp": _LAYOUT,
    "use_2d_fsdp_sharding": _LAYOUT,
}


class NotCovered(ValueError):
    """A MaxText setting or release the integration does not cover (one line naming it)."""


def installed_version() -> str | None:
    """The installed maxtext wheel's version, or None when there is none."""
    try:
        return importlib.metadata.version("maxtext")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version(allow_untested: bool = False) -> None:
    """Raises one line unless the installed MaxText is `TESTED_MAXTEXT` or ``allow_untested``."""
    found = installed_version()
    if found != TESTED_MAXTEXT and not allow_untested:
        raise NotCovered(
            f"ultraep_jax.integrations.maxtext: tested with MaxText {TESTED_MAXTEXT}, found "
            f"{found}; to run it anyway: enable(..., {OVERRIDE}=True) (the command: "
            f"ultraep_{OVERRIDE}=true)"
        )


def defaults() -> dict:
    """MaxText's default of every setting in `REFUSED` its config has (its config class's, which
    its base.yml repeats)."""
    from maxtext.configs import types  # noqa: PLC0415 (MaxText's, imported on use)

    fields = types.MaxTextConfig.model_fields
    return {name: _plain(fields[name].default) for name in REFUSED if name in fields}


def config_refusal(cfg) -> str | None:
    """Why a MaxText config's routed MoE blocks cannot run balanced, in one line naming the
    setting; None when they can, or when the model has no routed experts (``num_experts`` 1)."""
    if cfg.num_experts <= 1:
        return None
    block = _block_name(cfg)
    rules = (
        (cfg.te_moe_block, "te_moe_block=True hands the block to TransformerEngine"),
        (not cfg.sparse_matmul, "sparse_matmul=False runs MaxText's dense (capacity) block"),
        (
            cfg.attention in ("vllm_rpa", "vllm_batched_rpa"),
            f"attention={cfg.attention} runs the fused inference block",
        ),
        (
            block == "llama4",
            f"decoder_block=llama4 (model_name={cfg.model_name}): its router's scores scale the "
            "block's inputs, which ultraep_jax does not compute",
        ),
        (
            block == "deepseek4" and getattr(cfg, "first_num_hash_layers", 0) > 0,
            f"first_num_hash_layers={getattr(cfg, 'first_num_hash_layers', 0)} (DeepSeek V4's "
            "hash-routed layers) is not covered",
        ),
        (
            _plain(getattr(cfg, "custom_mesh_and_rule", "")) == "cp-as-ep",
            "custom_mesh_and_rule=cp-as-ep (an EP axis other than 'expert') is not covered",
        ),
    )
    for refused, reason in rules:
        if refused:
            return reason
    for name, default in defaults().items():
        value = _plain(getattr(cfg, name, default))
        if value != default:
            return (
                f"{name}={value} is not covered: {REFUSED[name]} (MaxText's default: {default!r})"
            )
    try:
        activation(cfg)
    except ValueError as e:
        return str(e).removeprefix("maxtext: ")
    return None


def check_config(cfg) -> None:
    """Raises `NotCovered` (one line, `config_refusal`) unless a MaxText config's routed MoE
    blocks can run balanced."""
    reason = config_refusal(cfg)
    if reason is not None:
        raise NotCovered(refused_message(reason))


def refused_message(reason: str) -> str:
    """The one line of a refusal: the reason and what to do."""
    return (
        f"ultraep_jax.integrations.maxtext: {reason}; change the setting, or run MaxText's own "
        "block with ultraep_jax.integrations.maxtext.disable() (the command: leave it out)"
    )


def activation(cfg):
    """The experts' gated unit for MaxText's ``mlp_activations`` (an `Execution.activation`);
    raises one line for one that ultraep_jax does not compute as MaxText does."""
    names = tuple(cfg.mlp_activations)
    block = _block_name(cfg)
    if block == "gpt_oss":
        if names != ("sigmoid", "linear"):
            raise ValueError(f"maxtext: gpt-oss with mlp_activations={list(names)} is not covered")
        return ClampedSwiGLU(limit=cfg.mlp_activations_limit, alpha=1.702)
    if block in ("deepseek", "deepseek4") and cfg.mlp_activations_limit > 0:
        raise ValueError(
            f"maxtext: mlp_activations_limit={cfg.mlp_activations_limit} (DeepSeek's clipped "
            "SwiGLU) is not covered"
        )
    units = {("silu", "linear"): "silu", ("gelu", "linear"): "gelu", ("relu", "linear"): "relu"}
    if names not in units:
        raise ValueError(f"maxtext: mlp_activations={list(names)} is not covered")
    return units[names]


def _block_name(cfg) -> str:
    return getattr(cfg.decoder_block, "name", str(cfg.decoder_block)).lower()


def _plain(value):
    """An enum setting as its value (MaxText keeps some settings as enums)."""
    return value.value if isinstance(value, enum.Enum) else value
