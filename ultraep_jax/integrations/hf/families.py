"""The Hugging Face MoE families `uep.MoE` reproduces, and the layer each config.json implies.

A family is a transformers model type whose MoE block `uep.MoE` computes exactly (the routing
rules: docs/integration.md, as of transformers 5.24): `FAMILIES` says which keys of
the config set what, `moe_kwargs` turns a config.json into `uep.MoE`'s arguments, and
`moe_layers` says which decoder layers hold a MoE block. Every call takes the config as a dict,
as an object with ``to_dict()`` (a transformers config) or as a path to a config.json or to the
folder holding one (`as_config`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
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


def as_config(config) -> Mapping:
    """config.json as a dict, from a dict (returned as is), an object with ``to_dict()`` (a
    transformers ``PretrainedConfig``) or a path (str or PathLike) to a config.json or to a
    folder holding one; raises one line for anything else."""
    if isinstance(config, Mapping):
        return config
    if isinstance(config, str | os.PathLike):
        path = pathlib.Path(config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"hf: no config.json at {path}")
        try:
            loaded = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"hf: {path} is not a JSON config: {err}") from None
    else:
        to_dict = getattr(config, "to_dict", None)
        loaded = to_dict() if callable(to_dict) else None
    if not isinstance(loaded, Mapping):
        raise TypeError(
            "hf: config must be a dict, an object with to_dict() (a transformers config) or a "
            f"path to a config.json, got {type(config).__name__}"
        )
    return loaded


def family_of(config, family: str | None = None) -> Family:
    """The `Family` of a config (`as_config`: its ``model_type``), or the one named ``family``
    (a model type whose block is a family's under another name, such as Kimi-K2's
    ``"deepseek_v3"``); raises one line for an unknown one."""
    name = family if family is not None else as_config(config).get("model_type")
    if name not in FAMILIES:
        raise ValueError(
            f"hf: model_type {name!r} is not a supported MoE family; expected one of "
            f"{sorted(FAMILIES)} (or pass family=...)"
        )
    return FAMILIES[name]


#: What a null in config.json means where transformers reads it as a value: its Qwen configs
#: turn a null ``mlp_only_layers`` into [], and a null ``norm_topk_prob`` stays None, falsy
#: where the blocks test it. Any other key read here refuses null: transformers 5's config
#: classes refuse it for the fields typed int (``n_shared_experts``, ``decoder_sparse_step``,
#: ...: "expected int, got NoneType"), and its blocks fail on the others.
_NULL_MEANS = {"mlp_only_layers": [], "norm_topk_prob": False}
#: What to write instead of a null, where a number says "none".
_NULL_HINTS = {"n_shared_experts": " (0: no shared expert)"}


def value(config: Mapping, fam: Family, *keys: str):
    """The first of ``keys`` that config.json holds, else the family's default of the first;
    raises one line when neither has it, or when the key it has is null where transformers
    takes no null (`_NULL_MEANS`)."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    for key in keys:
        if key in config:  # present, and null
            if key in _NULL_MEANS:
                return _NULL_MEANS[key]
            raise ValueError(
                f"hf: the {fam.model_type} config's {key} is null, which transformers refuses: "
                f"give a number{_NULL_HINTS.get(key, '')}"
            )
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
    # transformers' DeepSeek-V3 and GLM-4.5 routers fill the dropped groups' experts with 0.0
    # before the top-k (DeepSeek's own reference code, the layer's default, with -inf).
    return SigmoidTopK(
        top_k,
        num_groups=value(config, fam, "n_group"),
        top_groups=value(config, fam, "topk_group"),
        scale=value(config, fam, "routed_scaling_factor"),
        renormalize=renormalize,
        masked_group_score=0.0,
    )


def _num_experts(config: Mapping, fam: Family) -> int:
    """E; raises one line for 0 (no MoE block: the Qwen families then build dense MLPs, as
    `moe_layers` says; the others' blocks cannot run without experts)."""
    E = value(config, fam, *fam.num_experts_keys)
    if E == 0:
        key = next(k for k in fam.num_experts_keys if config.get(k) is not None)
        if fam.moe_layers == "sparse_step":
            raise ValueError(
                f"hf: the {fam.model_type} config has {key}=0: no decoder layer holds a MoE "
                "block (transformers builds dense MLPs; moe_layers is empty)"
            )
        raise ValueError(
            f"hf: the {fam.model_type} config has {key}=0; its MoE block needs experts"
        )
    return E


def moe_kwargs(config, family: str | None = None) -> dict:
    """`uep.MoE`'s arguments that a Hugging Face config (`as_config`) implies: ``d_model``,
    ``d_ff``, ``num_experts``, ``top_k``, ``router``, ``shared_d_ff``, ``shared_expert_gate``,
    ``activation`` (gpt-oss: a `uep.ClampedSwiGLU`), ``router_logit_bias`` and ``expert_bias``.
    Add the mesh, balancer, capacity and ``rngs``:
    ``uep.MoE(mesh=mesh, balancer=..., rngs=nnx.Rngs(0), **moe_kwargs(config))``.
    ``family``: see `family_of`. A shared expert of width 0 (``n_shared_experts: 0``,
    ``shared_expert_intermediate_size: 0``) is none, as its zero-width matmuls are in
    transformers."""
    config = as_config(config)
    fam = family_of(config, family)
    top_k = value(config, fam, "num_experts_per_tok")
    kwargs = dict(
        d_model=value(config, fam, "hidden_size"),
        d_ff=value(config, fam, fam.d_ff_key),
        num_experts=_num_experts(config, fam),
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
        kwargs["shared_expert_gate"] = kwargs["shared_d_ff"] > 0  # gates a zero: nothing
    elif fam.shared == "deepseek":
        kwargs["shared_d_ff"] = value(config, fam, "n_shared_experts") * kwargs["d_ff"]
    return kwargs


def moe_layers(config, family: str | None = None) -> tuple[int, ...]:
    """The decoder layers (indices) whose feed-forward block is the family's MoE block (none for
    a Qwen config with 0 experts, as transformers builds them)."""
    config = as_config(config)
    fam = family_of(config, family)
    layers = range(value(config, fam, "num_hidden_layers"))
    if fam.moe_layers == "sparse_step":
        if any(config.get(key) == 0 for key in fam.num_experts_keys):
            return ()  # transformers: a MoE block where num_experts > 0 only
        step = value(config, fam, "decoder_sparse_step")
        if step == 0:
            raise ValueError(
                f"hf: the {fam.model_type} config has decoder_sparse_step=0; a MoE layer is "
                "every step-th (transformers divides by it): give 1 or more"
            )
        dense = set(value(config, fam, "mlp_only_layers"))
        return tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
    if fam.moe_layers == "after_dense":
        return tuple(i for i in layers if i >= value(config, fam, "first_k_dense_replace"))
    return tuple(layers)
