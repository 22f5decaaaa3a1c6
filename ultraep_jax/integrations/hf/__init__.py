"""Hugging Face MoE families through `uep.MoE`: the layer a config implies (`moe_kwargs`,
`moe_layers`; a config.json dict, a transformers config or a path: `as_config`), a block's
tensors to the layer's variables and back (`from_hf`, `to_hf`, exact both ways), a checkpoint
read straight onto the devices (`load_moe` with a `SafetensorsCheckpoint`) and a layer's block
written back into a copy of its checkpoint (`save_moe`). docs/integration.md has a section per
family."""

from ultraep_jax.integrations.hf.families import (
    FAMILIES,
    Family,
    as_config,
    family_of,
    moe_kwargs,
    moe_layers,
)
from ultraep_jax.integrations.hf.loading import SafetensorsCheckpoint, load_moe
from ultraep_jax.integrations.hf.mapping import LAYOUTS, block_prefix, from_hf, layer_shapes, to_hf
from ultraep_jax.integrations.hf.saving import save_moe

__all__ = [
    "FAMILIES",
    "LAYOUTS",
    "Family",
    "SafetensorsCheckpoint",
    "as_config",
    "block_prefix",
    "family_of",
    "from_hf",
    "layer_shapes",
    "load_moe",
    "moe_kwargs",
    "moe_layers",
    "save_moe",
    "to_hf",
]
