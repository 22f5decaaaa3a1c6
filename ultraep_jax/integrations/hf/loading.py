"""A checkpoint's MoE tensors read one block at a time, each block straight onto the devices
that hold it: a device's experts are read for that device only (and only by the host it is on),
so a 256-expert layer is never whole on one host.

`SafetensorsCheckpoint` reads blocks of tensors from safetensors files (the ``safetensors``
package's ``safe_open(...).get_slice``: only the bytes of the block are read); `load_moe` fills a
`uep.MoE` (built, or abstract from ``nnx.eval_shape``) with decoder layer ``layer``'s block,
through `jax.make_array_from_callback` with each variable's sharding.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ultraep_jax.integrations.hf.arrays import as_numpy
from ultraep_jax.integrations.hf.families import as_config
from ultraep_jax.integrations.hf.mapping import (
    ROOT,
    block_prefix,
    check_shapes,
    detect_layout,
    layer_shapes,
    pieces,
    read_block,
)

#: The expert variables, in the order of `uep.ExpertParallel.weight_shardings`.
EXPERT_VARIABLES = ("w_gate", "w_up", "w_down")
#: The expert biases, in the order of `uep.ExpertParallel.bias_shardings`.
EXPERT_BIASES = ("b_gate", "b_up", "b_down")


class SafetensorsCheckpoint:
    """The tensors of a safetensors checkpoint, read a block at a time.

    Args:
      path: a ``.safetensors`` file, or a folder of them (its ``model.safetensors.index.json``
        says which file holds which tensor; without one, every ``*.safetensors`` in it).

    Each file is opened (its header read) when first needed; `read` reads only a block's bytes.
    """

    def __init__(self, path):
        try:
            import safetensors  # noqa: F401
        except ModuleNotFoundError:
            raise ModuleNotFoundError(
                "hf: reading safetensors needs the safetensors package (from the checkout: "
                'pip install ".[hf]")'
            ) from None
        path = pathlib.Path(path)
        index = path / "model.safetensors.index.json"
        self._files: dict[pathlib.Path, object] = {}
        if path.is_dir() and index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._where = {name: path / file for name, file in weight_map.items()}
            return
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"hf: no safetensors file at {path}")
        self._where = {name: f for f in files for name in self._open(f).keys()}

    def _open(self, file: pathlib.Path):
        from safetensors import safe_open

        if file not in self._files:
            self._files[file] = safe_open(str(file), framework="numpy")
        return self._files[file]

    def _slice(self, name: str):
        if name not in self._where:
            raise KeyError(f"hf: the checkpoint has no tensor {name}")
        return self._open(self._where[name]).get_slice(name)

    def __contains__(self, name) -> bool:
        return name in self._where

    def keys(self):
        """The tensors' names."""
        return self._where.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape (from the file's header)."""
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The tensor's dtype as the file's header names it ("BF16", "F32", "F8_E4M3", ...)."""
        return self._slice(name).get_dtype()

    def file(self, name: str) -> pathlib.Path:
        """The file that holds the tensor."""
        self._slice(name)  # one line for a missing tensor
        return self._where[name]

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The block ``index`` (a slice per axis) of the tensor ``name``."""
        part = self._slice(name)
        if part.get_dtype().startswith("F8"):
            raise ValueError(
                f"hf: {name} is {part.get_dtype()} (a quantized checkpoint): dequantize it first"
            )
        # A strided block (gpt-oss's interleaved gate and up) is read whole, then strided.
        whole = tuple(slice(s.start, s.stop) for s in index)
        return part[whole][tuple(slice(None, None, s.step) for s in index)]


def _reader(source):
    """(shape of, read) of a `SafetensorsCheckpoint` or a mapping of names to arrays."""
    if isinstance(source, SafetensorsCheckpoint):
        return source.shape, source.read
    if isinstance(source, Mapping):
        host: dict[str, np.ndarray] = {}  # each tensor converted once (torch's bfloat16 too)

        def read(name, index):
            if name not in host:
                host[name] = as_numpy(source[name])
            return host[name][index]

        return (lambda n: np.shape(source[n])), read
    raise TypeError(
        f"hf: the tensors must be a SafetensorsCheckpoint or a mapping, got {type(source).__name__}"
    )


def variable_sharding(layer, name: str) -> jax.sharding.Sharding:
    """Where the layer keeps variable ``name``: the experts and their biases split as
    `uep.ExpertParallel.weight_shardings` and ``bias_shardings`` say, the rest replicated (a
    built layer's own sharding is used where it has one)."""
    value = getattr(layer, name).get_value()
    if isinstance(value, jax.Array):
        return value.sharding
    if name in EXPERT_VARIABLES:
        return layer.ep.weight_shardings[EXPERT_VARIABLES.index(name)]
    if name in EXPERT_BIASES:
        return layer.ep.bias_shardings[EXPERT_BIASES.index(name)]
    return NamedSharding(layer.mesh, P())


def load_moe(
    layer,
    config,
    source,
    layer_index: int,
    *,
    layout: str = "auto",
    root: str = ROOT,
    family: str | None = None,
) -> None:
    """Writes decoder layer ``layer_index``'s MoE block of ``source`` (a `SafetensorsCheckpoint`
    or a mapping of full tensor names to arrays, in either layout of `mapping`; "auto":
    `mapping.detect_layout`) into ``layer``, a `uep.MoE` built with `families.moe_kwargs`'s
    arguments for ``config``, or its abstract form (``nnx.eval_shape(lambda: uep.MoE(...))``,
    which allocates nothing). Each variable becomes an array of its sharding whose blocks are
    read for the devices that hold them (once per distinct block), cast to the layer's dtype.
    Raises one line listing every tensor that is missing or of another shape than the config
    implies. ``config``: see `families.as_config`."""
    config = as_config(config)
    shape_of, read = _reader(source)
    if layout == "auto":
        layout = detect_layout(config, source.keys(), layer_index, root, family)
    prefix = block_prefix(config, layer_index, layout, root, family)
    shapes = layer_shapes(config, family)
    got = pieces(config, layout, family)
    check_shapes(got, shapes, prefix, shape_of, source.keys())
    for var, piece in got.items():
        variable = getattr(layer, var, None)
        shape = None if variable is None else tuple(variable.get_value().shape)
        if shape != shapes[var]:
            raise ValueError(
                f"hf: the layer's {var} is {shape}, the config implies {shapes[var]}: build the "
                f"layer with moe_kwargs(config)"
            )
        dtype = variable.get_value().dtype
        blocks: dict[tuple, np.ndarray] = {}

        def block(index, piece=piece, shape=shape, dtype=dtype, blocks=blocks):
            index = (*index, *(slice(None),) * (len(shape) - len(index)))
            index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
            key = tuple((s.start, s.stop) for s in index)
            if key not in blocks:
                blocks[key] = read_block(piece, prefix, index, read).astype(dtype)
            return blocks[key]

        value = jax.make_array_from_callback(shape, variable_sharding(layer, var), block)
        variable.set_value(value)
