"""The Hugging Face MoE families `uep.MoE` reproduces, and the layer each config.json implies.

A family is a transformers model type whose MoE block `uep.MoE` computes exactly (the routing
rules: /work/shared/DESIGN.md section 11, as of transformers 5.24): `FAMILIES` says which keys of
the config set what, `moe_kwargs` turns a config.json (a plain dict) into `uep.MoE`'s arguments,
and `moe_layers` says which decoder layers hold a MoE block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ultraep_jax.base.activations import ClampedSwiGLU
from ultraep_jax.routers import SigmoidTopK, SoftmaxTopK, TopKSoftmax

#: transformers' ``hidden_act`` names -> the layer's activation (ACT2FN's "gelu" is the exact
#: GELU; "gelu_new" and "gelu_pytorch_tanh" its tanh approximation).
HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}


@dataclasses.dataclass(frozen=True)
class Family:
    """How one model type's MoE block maps onto `uep.MoE`.

    Attributes:
      model_type: config.json's ``model_type``.
      block: the transformers class of the block (for messages and docs).
      router: "softmax" (`uep.SoftmaxTopK`), "sigmoid" (`uep.SigmoidTopK`: DeepSeek-V3's
        groups, choice bias and scale) or "topk_softmax" (gpt-oss: the top k logits, then a
        softmax over them).
      num_experts_keys: the config keys that may hold E, the first present read (transformers
        5.24 writes ``num_local_experts`` where the released Qwen configs say ``num_experts``).
      d_ff_key: the key of each routed expert's hidden width.
      renormalize: the top-k weights always divided by their sum (Mixtral) or as
        ``norm_topk_prob`` says (None).
      shared: the shared expert: None, "gated" (Qwen2-MoE: ``shared_expert_intermediate_size``
        wide, times sigmoid(x @ g)) or "deepseek" (``n_shared_experts`` x
        ``moe_intermediate_size`` wide).
      moe_layers: which decoder layers hold the block: "all", "sparse_step" (Qwen:
        ``decoder_sparse_step``, ``mlp_only_layers``) or "after_dense" (DeepSeek, GLM: from
        ``first_k_dense_replace`` on).
      defaults: the transformers 5.24 config class's defaults of the optional keys read, used
        where config.json leaves a key out (as transformers does).
      checkpoint_block: the block's module name in checkpoints (Mixtral's "block_sparse_moe";
        transformers 5 renames it "mlp" in memory).
      router_module: the router's module name in the block.
      expert_names: the (gate, up, down) names of the per-expert tensors of checkpoints
        (``experts.<e>.<name>.weight``), or None where checkpoints hold the fused tensors.
      gpt_oss: gpt-oss's block: a router with a logit bias, experts with biases and the clamped
        gated unit (``swiglu_limit``, ``swiglu_alpha``), and its own fused layout (gate and up
        interleaved, ``experts.gate_up_proj`` [E, D, 2F] applied as ``x @ W``).
    """

    model_type: str
    block: str
    router: str
    num_experts_keys: tuple[str, ...]
    d_ff_key: str
    renormalize: bool | None = None
    shared: str | None = None
    moe_layers: str = "all"
    defaults: Mapping[str, object] = dataclasses.field(default_factory=dict)
    checkpoint_block: str = "mlp"
    router_module: str = "gate"
    expert_names: tuple[str, str, str] | None = ("gate_proj", "up_proj", "down_proj")
    gpt_oss: bool = False


_SPARSE_STEP = {"decoder_sparse_step": 1, "mlp_only_layers": []}
_DEEPSEEK_KEYS = ("n_routed_experts", "num_local_experts")
_EXPERT_KEYS = ("num_experts", "num_local_experts")

#: The families, by model type.
FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(
            "mixtral",
            "MixtralSparseMoeBlock",
            "softmax",
            ("num_local_experts", "num_experts"),
            "intermediate_size",
            renormalize=True,
            defaults={"hidden_act": "silu"},
            checkpoint_block="block_sparse_moe",
            expert_names=("w1", "w3", "w2"),
        ),
        Family(
            "qwen2_moe",
            "Qwen2MoeSparseMoeBlock",
            "softmax",
            _EXPERT_KEYS,
            "moe_intermediate_size",
            shared="gated",
            moe_layers="sparse_step",
            defaults={"hidden_act": "silu", "norm_topk_prob": False} | _SPARSE_STEP,
        ),
        Family(
            "qwen3_moe",
            "Qwen3MoeSparseMoeBlock",
            "softmax",
            _EXPERT_KEYS,
            "moe_intermediate_size",
            moe_layers="sparse_step",
            defaults={"hidden_act": "silu", "norm_topk_prob": False} | _SPARSE_STEP,
        ),
        Family(
            "olmoe",
            "OlmoeSparseMoeBlock",
            "softmax",
            _EXPERT_KEYS,
            "intermediate_size",
            defaults={"hidden_act": "silu", "norm_topk_prob": False},
        ),
        Family(
            "deepseek_v3",
            "DeepseekV3MoE",
            "sigmoid",
            _DEEPSEEK_KEYS,
            "moe_intermediate_size",
            shared="deepseek",
            moe_layers="after_dense",
            defaults={
                "hidden_act": "silu",
                "n_group": 8,
                "topk_group": 4,
                "routed_scaling_factor": 2.5,
                "norm_topk_prob": True,
                "n_shared_experts": 1,
                "first_k_dense_replace": 3,
            },
        ),
        Family(
            "glm4_moe",
            "Glm4MoeMoE",
            "sigmoid",
            _DEEPSEEK_KEYS,
            "moe_intermediate_size",
            shared="deepseek",
            moe_layers="after_dense",
            defaults={
                "hidden_act": "silu",
                "n_group": 1,
                "topk_group": 1,
                "routed_scaling_factor": 1.0,
                "norm_topk_prob": True,
                "n_shared_experts": 1,
                "first_k_dense_replace": 1,
            },
        ),
        Family(
            "gpt_oss",
            "GptOssMLP",
            "topk_softmax",
            ("num_local_experts",),
            "intermediate_size",
            defaults={"hidden_act": "silu", "swiglu_limit": 7.0, "swiglu_alpha": 1.702},
            router_module="router",
            expert_names=None,
            gpt_oss=True,
        ),
    )
}


def family_of(config: Mapping, family: str | None = None) -> Family:
    """The `Family` of a config.json dict (its ``model_type``), or the one named ``family`` (a
    model type whose block is a family's under another name, such as Kimi-K2's
    ``"deepseek_v3"``); raises one line for an unknown one."""
    name = family if family is not None else config.get("model_type")
    if name not in FAMILIES:
        raise ValueError(
            f"hf: model_type {name!r} is not a supported MoE family; expected one of "
            f"{sorted(FAMILIES)} (or pass family=...)"
        )
    return FAMILIES[name]


def value(config: Mapping, fam: Family, *keys: str):
    """The first of ``keys`` that config.json holds, else the family's default of the first;
    raises one line when neither has it."""
    for key in keys:
        if key in config and config[key] is not None:
            return config[key]
    if keys[0] in fam.defaults:
        return fam.defaults[keys[0]]
    raise ValueError(f"hf: the {fam.model_type} config has no {' or '.join(keys)}")


def _activation(config: Mapping, fam: Family) -> str:
    act = value(config, fam, "hidden_act")
    if act not in HF_ACTIVATIONS:
        raise ValueError(
            f"hf: hidden_act={act!r} has no layer activation; expected one of "
            f"{sorted(HF_ACTIVATIONS)}"
        )
    return HF_ACTIVATIONS[act]


def _router(config: Mapping, fam: Family, top_k: int):
    """The layer's router for the family's rule."""
    renormalize = fam.renormalize
    if renormalize is None and fam.router != "topk_softmax":
        renormalize = bool(value(config, fam, "norm_topk_prob"))
    if fam.router == "topk_softmax":
        return TopKSoftmax(top_k)
    if fam.router == "softmax":
        return SoftmaxTopK(top_k, renormalize=renormalize)
    return SigmoidTopK(
        top_k,
        num_groups=value(config, fam, "n_group"),
        top_groups=value(config, fam, "topk_group"),
        scale=value(config, fam, "routed_scaling_factor"),
        renormalize=renormalize,
    )


def moe_kwargs(config: Mapping, family: str | None = None) -> dict:
    """`uep.MoE`'s arguments that a Hugging Face config.json (a plain dict) implies: ``d_model``,
    ``d_ff``, ``num_experts``, ``top_k``, ``router``, ``shared_d_ff``, ``shared_expert_gate``,
    ``activation`` (gpt-oss: a `uep.ClampedSwiGLU`), ``router_logit_bias`` and ``expert_bias``.
    Add the mesh, balancer, capacity and ``rngs``:
    ``uep.MoE(mesh=mesh, balancer=..., rngs=nnx.Rngs(0), **moe_kwargs(config))``.
    ``family``: see `family_of`."""
    fam = family_of(config, family)
    top_k = value(config, fam, "num_experts_per_tok")
    kwargs = dict(
        d_model=value(config, fam, "hidden_size"),
        d_ff=value(config, fam, fam.d_ff_key),
        num_experts=value(config, fam, *fam.num_experts_keys),
        top_k=top_k,
        router=_router(config, fam, top_k),
        shared_d_ff=0,
        shared_expert_gate=False,
        activation=_activation(config, fam),
        router_logit_bias=fam.gpt_oss,
        expert_bias=fam.gpt_oss,
    )
    if fam.gpt_oss:  # hidden_act names no activation of its experts
        limit, alpha = value(config, fam, "swiglu_limit"), value(config, fam, "swiglu_alpha")
        kwargs["activation"] = ClampedSwiGLU(limit=limit, alpha=alpha)
    if fam.shared == "gated":
        kwargs["shared_d_ff"] = value(config, fam, "shared_expert_intermediate_size")
        kwargs["shared_expert_gate"] = True
    elif fam.shared == "deepseek":
        kwargs["shared_d_ff"] = value(config, fam, "n_shared_experts") * kwargs["d_ff"]
    return kwargs


def moe_layers(config: Mapping, family: str | None = None) -> tuple[int, ...]:
    """The decoder layers (indices) whose feed-forward block is the family's MoE block."""
    fam = family_of(config, family)
    layers = range(value(config, fam, "num_hidden_layers"))
    if fam.moe_layers == "sparse_step":
        step = value(config, fam, "decoder_sparse_step")
        dense = set(value(config, fam, "mlp_only_layers"))
        return tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
    if fam.moe_layers == "after_dense":
        return tuple(i for i in layers if i >= value(config, fam, "first_k_dense_replace"))
    return tuple(layers)
