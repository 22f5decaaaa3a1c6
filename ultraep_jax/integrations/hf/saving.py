"""`load_moe`'s inverse: a layer's MoE block written into a copy of a safetensors checkpoint
folder, each tensor in the checkpoint's dtype, every other byte of every file kept.

The block's tensors have the same shapes and dtypes as those they replace, so each file keeps
its header (its ``{"format": "pt"}`` metadata, every other tensor and their offsets): the files
are copied, then the block's bytes are written over their place in the files that hold them
(``model.safetensors.index.json``'s ``weight_map`` says which, for a sharded checkpoint).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import struct
import sys

import ml_dtypes
import numpy as np

from ultraep_jax.integrations.hf.families import as_config
from ultraep_jax.integrations.hf.loading import SafetensorsCheckpoint
from ultraep_jax.integrations.hf.mapping import (
    ROOT,
    block_prefix,
    block_tensors,
    check_shapes,
    detect_layout,
    layer_shapes,
    pieces,
    to_hf,
)

#: safetensors' dtype names -> the dtypes a block is written in (a float8 checkpoint's block
#: has scales beside it: refused).
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


def tensor_spans(file: pathlib.Path) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """Each tensor of a safetensors file, from its header: (dtype name, shape, first byte, end
    byte), the bytes counted from the file's start."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    start = 8 + size
    spans = {}
    for name, entry in header.items():
        begin, end = (start + offset for offset in entry["data_offsets"])
        spans[name] = (entry["dtype"], tuple(entry["shape"]), begin, end)
    return spans


def encoded(name: str, value: np.ndarray, span: tuple) -> bytes:
    """``value`` as the bytes of the tensor ``name`` whose header entry is ``span``
    (`tensor_spans`): cast to its dtype, little-endian; raises one line for another shape or a
    dtype not in `DTYPES`."""
    dtype, shape, begin, end = span
    if dtype not in DTYPES:
        raise ValueError(
            f"hf: {name} is {dtype} in the checkpoint; a block is written in "
            f"{', '.join(DTYPES)} only (dequantize the checkpoint first)"
        )
    if value.shape != shape:
        raise ValueError(f"hf: {name} is {shape} in the checkpoint, the layer gives {value.shape}")
    data = np.ascontiguousarray(value.astype(DTYPES[dtype]))
    data = data.byteswap() if sys.byteorder == "big" else data  # safetensors is little-endian
    if data.nbytes != end - begin:
        raise ValueError(
            f"hf: {name} takes {end - begin} bytes in the checkpoint, not {data.nbytes}"
        )
    return data.tobytes()


def _copy_folder(source: pathlib.Path, out: pathlib.Path) -> None:
    """``source``'s files (their contents: a symlinked cache's too) into ``out``, which must be
    new or empty; nothing when ``out`` is ``source`` (written in place)."""
    if out.resolve() == source.resolve():
        return
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(
            f"hf: {out} exists and is not an empty folder; give a new one (or the checkpoint "
            "itself, to write in place)"
        )
    shutil.copytree(source, out, dirs_exist_ok=True)


def _block(layer, config, ckpt, layer_index, root, family) -> dict[str, np.ndarray]:
    """The layer's block tensors in the checkpoint's layout, each one the checkpoint holds;
    raises one line when the checkpoint's block is not the config's, or the layer lacks one."""
    layout = detect_layout(config, ckpt.keys(), layer_index, root, family)
    prefix = block_prefix(config, layer_index, layout, root, family)
    got, shapes = pieces(config, layout, family), layer_shapes(config, family)
    check_shapes(got, shapes, prefix, ckpt.shape, ckpt.keys())
    tensors = to_hf(config, layer, layer_index, layout=layout, root=root, family=family)
    if missing := [n for n in block_tensors(got, shapes, prefix) if n not in tensors]:
        raise ValueError(
            f"hf: the variables give no {', '.join(missing)}: pass the layer itself (its "
            "router_bias is a uep.RouterBias, no nnx.Param)"
        )
    return tensors


def save_moe(
    layer,
    config,
    checkpoint,
    out,
    layer_index: int,
    *,
    root: str = ROOT,
    family: str | None = None,
) -> list[pathlib.Path]:
    """Writes ``layer``'s MoE block as decoder layer ``layer_index``'s into a copy of the
    checkpoint folder ``checkpoint`` at ``out``: `load_moe`'s inverse.

    Args:
      layer: a `uep.MoE` (its variables, `RouterBias` included), or its variables by name
        (`mapping.to_hf`'s ``params``); gathered whole on this host.
      config: see `families.as_config`.
      checkpoint: a folder of safetensors files (sharded with ``model.safetensors.index.json``,
        or not), in either layout of `mapping`.
      out: a new or empty folder that receives a copy of every file of ``checkpoint``, the
        block's tensors replaced, each in the checkpoint's dtype (bfloat16 rounded to nearest
        even); ``out`` = ``checkpoint`` writes in place (the next layer into the same copy).

    Returns the files whose bytes changed. Every other tensor, each file's metadata and every
    other file are copied unchanged. Raises one line when the checkpoint's block is not the
    config's (every tensor missing or misshaped listed) or is quantized (float8).
    """
    config, source, out = as_config(config), pathlib.Path(checkpoint), pathlib.Path(out)
    if not source.is_dir():
        raise NotADirectoryError(f"hf: save_moe writes into a copy of a folder; {source} is none")
    ckpt = SafetensorsCheckpoint(source)
    tensors = _block(layer, config, ckpt, layer_index, root, family)
    by_file: dict[pathlib.Path, list[str]] = {}
    for name in tensors:
        by_file.setdefault(ckpt.file(name).relative_to(source), []).append(name)
    _copy_folder(source, out)
    for relative, names in by_file.items():
        spans = tensor_spans(out / relative)
        with open(out / relative, "r+b") as f:
            for name in names:
                f.seek(spans[name][2])
                f.write(encoded(name, tensors[name], spans[name]))
    return [out / relative for relative in by_file]
