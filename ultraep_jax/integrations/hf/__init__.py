"""Hugging Face MoE families through `uep.MoE`: the layer a config.json implies
(`moe_kwargs`, `moe_layers`), a block's tensors to the layer's variables and back (`from_hf`,
`to_hf`, exact both ways), and a checkpoint read straight onto the devices (`load_moe` with a
`SafetensorsCheckpoint`). docs/integration.md has a section per family."""

from ultraep_jax.integrations.hf.families import FAMILIES, Family, family_of, moe_kwargs, moe_layers
from ultraep_jax.integrations.hf.loading import SafetensorsCheckpoint, load_moe
from ultraep_jax.integrations.hf.mapping import LAYOUTS, block_prefix, from_hf, layer_shapes, to_hf

__all__ = [
    "FAMILIES",
    "LAYOUTS",
    "Family",
    "SafetensorsCheckpoint",
    "block_prefix",
    "family_of",
    "from_hf",
    "layer_shapes",
    "load_moe",
    "moe_kwargs",
    "moe_layers",
    "to_hf",
]
