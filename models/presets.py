"""Model presets: small configurations shaped like well-known MoE models, sized to train on 8
simulated CPU devices (EP8). Only the MoE shape follows the original (experts, top-k, router,
shared expert); widths and depth are scaled down. The two large-expert presets scan their blocks,
as their full-size originals would."""

from __future__ import annotations

import dataclasses

from models.moe_lm import ModelConfig


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model shape and the spare slots per rank its balancing wants at EP8.

    Attributes:
      model: the model's configuration.
      slots_per_rank: spare slots per rank that keep every layer-step within 1.05 of the mean
        from the first step (many experts per rank spread a rank's excess over many experts,
        each replica taking a slot).
    """

    model: ModelConfig
    slots_per_rank: int = 2


_MODELS: dict[str, ModelConfig] = {
    # The default: 16 experts, top-2, softmax router.
    "tiny": ModelConfig(),
    # MoE-heavy (the routed experts ~77 % of the step's FLOPs): the default of
    # `python -m experiments.bench.step`, which times it as EP2 on two pinned ranks.
    "moe_heavy": ModelConfig(d_model=128, d_ff=512, num_experts=8, top_k=2),
    # Mixtral 8x7B: 8 experts, top-2, softmax then renormalised over the two, no shared expert.
    "mixtral": ModelConfig(d_model=64, d_ff=128, num_experts=8, top_k=2),
    # Qwen3-MoE (30B-A3B / 235B-A22B): 128 experts, top-8, renormalised, no shared expert.
    "qwen3_moe": ModelConfig(d_model=64, d_ff=32, num_experts=128, top_k=8, scan_layers=True),
    # DeepSeek-V3: 256 routed experts + 1 shared, top-8 over sigmoid scores with the
    # aux-loss-free bias, within the best 4 of 8 groups, routed weights scaled by 2.5.
    "deepseek_v3": ModelConfig(
        d_model=64,
        d_ff=32,
        num_experts=256,
        top_k=8,
        router="sigmoid",
        num_groups=8,
        top_groups=4,
        routed_scale=2.5,
        shared_d_ff=64,
        scan_layers=True,
    ),
}

PRESETS: dict[str, Preset] = {name: Preset(model) for name, model in _MODELS.items()}
PRESETS["qwen3_moe"] = Preset(_MODELS["qwen3_moe"], slots_per_rank=4)
PRESETS["deepseek_v3"] = Preset(_MODELS["deepseek_v3"], slots_per_rank=4)


def preset(name: str) -> Preset:
    """The `Preset` named ``name`` (one of `PRESETS`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name]
