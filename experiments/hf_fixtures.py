"""Writes the Hugging Face MoE fixtures of tests/integrations/test_hf_families.py: each family's
MoE block as transformers builds it, with tiny random weights, on a small skewed input.

        python -m experiments.hf_fixtures                  # every family, into tests/fixtures/hf
        python -m experiments.hf_fixtures --families=mixtral,gpt_oss --out=/tmp/hf

Needs torch, transformers, safetensors and absl-py, which the tests do not (an environment of
its own: ``python3.11 -m venv /work/venvs/torch && /work/venvs/torch/bin/pip install torch
transformers safetensors numpy absl-py``). For each family (`FAMILIES`) it builds a CausalLM of
two decoder layers with a MoE block in the last one (eval mode, float32, eager attention and
experts), draws the block's weights (the router skewed towards experts 0 and 1, so that a
4-rank EP mesh makes replicas; the weights far from the initialiser's 0.02 so that no choice is
a near-tie), runs it on a [8, 8, D] input and takes the gradients of ``sum(y * cotangent)``.
Into ``<out>/<family>/`` it writes:

- ``config.json``: the model's config as ``save_pretrained`` writes it;
- ``model.safetensors``: the MoE block's tensors as ``save_pretrained`` writes them (the
  checkpoint's names and layout: per-expert tensors where transformers reverts its fusion);
- ``reference.npz``: ``x``, ``cotangent``, ``y``, ``grad_x``, ``grad:<name>`` (the gradient of
  each block parameter, named as in the module: fused experts), ``experts`` [T, K] and
  ``weights`` [T, K] (the router's choice, each row sorted by expert), ``layer`` (the block's
  decoder layer) and ``margin`` (the smallest gap at a top-k or group boundary of the choice);

and ``<out>/versions.json`` (torch, transformers, safetensors and numpy versions).
"""

from __future__ import annotations

import json
import pathlib
import tempfile

from absl import flags

from experiments.lab.program import run_main

_D, _E, _K, _F = 16, 8, 2, 8  # the block's width, experts, top-k, expert width
_BATCH, _SEQ = 8, 8  # 64 tokens: the batch splits over 8 devices
_HOT = (0, 1)  # experts the router favours (both on EP rank 0 of 4)

#: The tiny configuration of each family: (transformers config class, keyword arguments). The
#: flags with a choice (norm_topk_prob, groups, scale, shared experts, the GLU's constants) take
#: non-default values, so that reading them from config.json is checked.
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=_E, intermediate_size=_F)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=_E,
            moe_intermediate_size=_F,
            shared_expert_intermediate_size=12,
            intermediate_size=16,
            mlp_only_layers=[0],
            norm_topk_prob=False,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=_E, moe_intermediate_size=_F, intermediate_size=16, norm_topk_prob=True),
    ),
    "olmoe": ("OlmoeConfig", dict(num_experts=_E, intermediate_size=_F, norm_topk_prob=False)),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            n_routed_experts=_E,
            moe_intermediate_size=_F,
            intermediate_size=16,
            n_shared_experts=2,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            q_lora_rank=8,
            kv_lora_rank=8,
            qk_nope_head_dim=4,
            qk_rope_head_dim=4,
            v_head_dim=4,
        ),
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(
            n_routed_experts=_E,
            moe_intermediate_size=_F,
            intermediate_size=16,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            head_dim=8,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        # limit 1.5 (7 in the released models): at this width some gates and ups are clamped.
        dict(num_local_experts=_E, intermediate_size=_F, head_dim=8, swiglu_limit=1.5),
    ),
}
# DeepSeek-V3 with norm_topk_prob=False (DeepSeek-V2-style configurations).
FAMILIES["deepseek_v3_unnormalized"] = (
    FAMILIES["deepseek_v3"][0],
    FAMILIES["deepseek_v3"][1] | dict(norm_topk_prob=False),
)

_OUT = flags.DEFINE_string("out", "tests/fixtures/hf", "Folder the fixtures are written to.")
_FAMILIES = flags.DEFINE_list("families", sorted(FAMILIES), "Families to write.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights and inputs.")


def _config(name: str):
    """The family's tiny transformers config: two decoder layers, the last one a MoE block."""
    import transformers

    cls, options = FAMILIES[name]
    common = dict(
        hidden_size=_D,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=32,
        bos_token_id=None,  # the families' defaults are ids of their real vocabularies
        eos_token_id=None,
        pad_token_id=None,
        num_experts_per_tok=_K,
        attn_implementation="eager",
        experts_implementation="eager",
    )
    return getattr(transformers, cls)(**(common | options))


def _draw_block(block, rng, name: str) -> None:
    """Overwrites the block's parameters (and DeepSeek's choice bias) with draws from ``rng``:
    weights of scale 1/sqrt(fan-in), biases 0.1 (gpt-oss: 0.5, so that its top-k softmax is
    not flat), the router's columns of the hot experts along the input's shared direction."""
    import numpy as np
    import torch

    u = np.zeros(_D)
    u[: _D // 2] = 1.0 / np.sqrt(_D // 2)  # the direction the input leans along (see `_input`)
    with torch.no_grad():
        for pname, p in list(block.named_parameters()) + list(block.named_buffers()):
            if pname.endswith("bias"):
                scale = 0.5 if name == "gpt_oss" else 0.1
                value = scale * rng.normal(size=p.shape)
            else:
                fan_in = p.shape[-2] if pname.startswith("experts.") and name == "gpt_oss" else None
                fan_in = fan_in or p.shape[-1]
                value = rng.normal(size=p.shape) / np.sqrt(fan_in)
            if pname in ("gate.weight", "router.weight"):  # [E, D]
                value = 0.7 * rng.normal(size=p.shape)
                value[list(_HOT)] += 2.0 * u
            p.copy_(torch.as_tensor(value, dtype=torch.float32))


def _input(rng):
    """x [8, 8, D], leaning along the hot experts' router direction, and the cotangent."""
    import numpy as np

    u = np.zeros(_D)
    u[: _D // 2] = 1.0 / np.sqrt(_D // 2)
    x = rng.normal(size=(_BATCH, _SEQ, _D)) + 1.5 * u
    return x.astype(np.float32), rng.normal(size=x.shape).astype(np.float32)


def _routing(block, x_TD, config):
    """The block's router on x: (experts [T, K], weights [T, K], each row sorted by expert,
    margin: the smallest gap at a top-k or group boundary of the scores it chooses on)."""
    import torch

    router = block.router if hasattr(block, "router") else block.gate
    with torch.no_grad():
        _, weights, experts = router(x_TD)
        logits = x_TD @ router.weight.T
        if hasattr(router, "bias") and isinstance(router.bias, torch.Tensor):
            logits = logits + router.bias
        if hasattr(router, "e_score_correction_bias"):  # DeepSeek-V3 / GLM-4.5
            choice = logits.sigmoid() + router.e_score_correction_bias
            groups = choice.view(len(choice), config.n_group, -1)
            group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1)[0].sum(-1)
            margins = []
            if config.topk_group < config.n_group:
                margins.append(_gap(group_scores, config.topk_group))
            kept = group_scores.topk(config.topk_group, dim=-1)[1]
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = choice.masked_fill(~mask.repeat_interleave(groups.shape[-1], 1), -1e9)
            margins.append(_gap(choice, _K))
            margin = min(margins)
        else:
            margin = _gap(logits, _K)
    order = experts.argsort(dim=-1)
    return experts.gather(1, order), weights.gather(1, order), margin


def _gap(scores_TN, k: int) -> float:
    """The smallest gap between the k-th and (k+1)-th best of each row."""
    top = scores_TN.topk(k + 1, dim=-1)[0]
    return float((top[:, k - 1] - top[:, k]).min())


def write_family(name: str, out: pathlib.Path, seed: int) -> dict:
    """Writes ``out/<name>/`` (see the module doc); returns a summary line's fields."""
    import numpy as np
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    config = _config(name)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().float()
    layer = config.num_hidden_layers - 1
    block = model.model.layers[layer].mlp
    _draw_block(block, rng, name)
    x_np, cot_np = _input(rng)
    x = torch.tensor(x_np, requires_grad=True)
    y = block(x)
    y = y[0] if isinstance(y, tuple) else y  # gpt-oss returns (y, router scores)
    (y * torch.as_tensor(cot_np)).sum().backward()
    experts, weights, margin = _routing(block, x.detach().reshape(-1, _D), config)
    arrays = {
        "x": x_np,
        "cotangent": cot_np,
        "y": y.detach().numpy(),
        "grad_x": x.grad.numpy(),
        "experts": experts.numpy().astype(np.int32),
        "weights": weights.numpy(),
        "layer": np.int32(layer),
        "margin": np.float32(margin),
    }
    arrays |= {f"grad:{n}": p.grad.numpy() for n, p in block.named_parameters()}
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)  # the checkpoint's names and layout, as transformers saves
        saved = load_file(str(pathlib.Path(tmp) / "model.safetensors"))
        (folder / "config.json").write_text((pathlib.Path(tmp) / "config.json").read_text())
    prefix = f"model.layers.{layer}."
    # The block's tensors: "mlp." in the module, Mixtral's "block_sparse_moe." in checkpoints.
    moe = {k: v for k, v in saved.items() if k.startswith((prefix + "mlp.", prefix + "block_"))}
    save_file(
        {k: v.contiguous() for k, v in sorted(moe.items())}, str(folder / "model.safetensors")
    )
    np.savez_compressed(folder / "reference.npz", **arrays)
    return dict(family=name, tensors=len(moe), margin=margin)


def versions() -> dict:
    """The versions of the packages that made the fixtures."""
    import numpy
    import safetensors
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": numpy.__version__,
    }


def main(argv):
    del argv
    unknown = sorted(set(_FAMILIES.value) - set(FAMILIES))
    if unknown:
        raise SystemExit(
            f"error: unknown --families {unknown}; expected some of {sorted(FAMILIES)}"
        )
    out = pathlib.Path(_OUT.value)
    for name in _FAMILIES.value:
        summary = write_family(name, out, _SEED.value)
        print(f"{summary['family']}: {summary['tensors']} tensors, margin {summary['margin']:.2e}")
    (out / "versions.json").write_text(json.dumps(versions(), indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    run_main(main)
