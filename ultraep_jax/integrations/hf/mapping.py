"""A Hugging Face MoE block's tensors <-> `uep.MoE`'s variables, exactly, in either direction.

Two layouts of the block's tensors:

- "checkpoint": what the released checkpoints and transformers' ``save_pretrained`` hold: one
  tensor per expert and projection, ``experts.<e>.gate_proj.weight`` [F, D], ``up_proj`` [F, D],
  ``down_proj`` [D, F] (Mixtral: ``w1``, ``w3``, ``w2`` under ``block_sparse_moe``);
- "module": what transformers 5 holds in memory (its ``state_dict``, its gradients): the experts
  fused, ``experts.gate_up_proj`` [E, 2F, D] (rows :F the gate, F: the up) and
  ``experts.down_proj`` [E, D, F].

gpt-oss has one layout for both: ``router.weight`` [E, D] with ``router.bias`` [E],
``experts.gate_up_proj`` [E, D, 2F] applied as ``x @ W`` with gate and up interleaved (columns
0, 2, ... the gate), ``gate_up_proj_bias`` [E, 2F] likewise, ``down_proj`` [E, F, D] and
``down_proj_bias`` [E, D] (the layer's ``router_logit_bias``, ``b_gate``, ``b_up``, ``b_down``).

The others apply a weight as ``x @ W.T``; the layer holds ``router_kernel`` [D, E], ``w_gate``,
``w_up`` [E, D, F], ``w_down`` [E, F, D], ``shared_gate``, ``shared_up`` [D, F_s],
``shared_down`` [F_s, D], ``shared_expert_gate`` [D, 1] and the router's choice bias
``router_bias`` [E] (DeepSeek-V3's ``e_score_correction_bias``). Each layer variable is one
`Piece` of one tensor (or of one tensor per expert); `read_block` reads any block of a variable
from the tensors it lives in (what a device holds: `loading.load_moe`), and `to_hf` writes the
variables back into the tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from ultraep_jax.integrations.hf.families import family_of, moe_kwargs

#: The layouts, by name (see the module doc).
LAYOUTS = ("checkpoint", "module")
#: Where the decoder layers are in a CausalLM's tensor names.
ROOT = "model.layers"


@dataclasses.dataclass(frozen=True)
class Piece:
    """Where one layer variable's values are among the block's tensors.

    Attributes:
      name: the tensor's name after the block's prefix (``experts.gate_up_proj``); with ``{e}``
        in it, one tensor per expert (``experts.{e}.gate_proj.weight``) whose stack along a new
        first axis is the variable.
      transpose: the tensor holds the variable's last two axes swapped (HF's ``x @ W.T``).
      axis, start, step: along ``axis`` (of the tensor in the variable's order of axes), the
        variable's values are at ``start``, ``start + step``, ...; the others belong to other
        pieces of the same tensor (a fused gate and up).
    """

    name: str
    transpose: bool = False
    axis: int = -1
    start: int = 0
    step: int = 1

    @property
    def per_expert(self) -> bool:
        """One tensor per expert (the variable's first axis)."""
        return "{e}" in self.name


def layer_shapes(config: Mapping, family: str | None = None) -> dict[str, tuple[int, ...]]:
    """The shape of each layer variable the family's block maps to."""
    kw = moe_kwargs(config, family)
    D, F, E, Fs = kw["d_model"], kw["d_ff"], kw["num_experts"], kw["shared_d_ff"]
    shapes = {"router_kernel": (D, E), "w_gate": (E, D, F), "w_up": (E, D, F), "w_down": (E, F, D)}
    if kw["router"].uses_bias:
        shapes["router_bias"] = (E,)
    if Fs:
        shapes |= {"shared_gate": (D, Fs), "shared_up": (D, Fs), "shared_down": (Fs, D)}
    if kw["shared_expert_gate"]:
        shapes["shared_expert_gate"] = (D, 1)
    if kw["router_logit_bias"]:
        shapes["router_logit_bias"] = (E,)
    if kw["expert_bias"]:
        shapes |= {"b_gate": (E, F), "b_up": (E, F), "b_down": (E, D)}
    return shapes


def pieces(config: Mapping, layout: str, family: str | None = None) -> dict[str, Piece]:
    """Each layer variable's `Piece` of the block's tensors in ``layout`` (`LAYOUTS`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"hf: layout must be one of {LAYOUTS}, got {layout!r}")
    fam = family_of(config, family)
    F = moe_kwargs(config, family)["d_ff"]
    shapes = layer_shapes(config, family)
    out = {"router_kernel": Piece(f"{fam.router_module}.weight", transpose=True)}
    if "router_bias" in shapes:
        out["router_bias"] = Piece(f"{fam.router_module}.e_score_correction_bias")
    if fam.gpt_oss:  # one layout: gate and up interleaved along 2F, applied as x @ W
        return out | {
            "router_logit_bias": Piece(f"{fam.router_module}.bias"),
            "w_gate": Piece("experts.gate_up_proj", start=0, step=2),
            "w_up": Piece("experts.gate_up_proj", start=1, step=2),
            "w_down": Piece("experts.down_proj"),
            "b_gate": Piece("experts.gate_up_proj_bias", start=0, step=2),
            "b_up": Piece("experts.gate_up_proj_bias", start=1, step=2),
            "b_down": Piece("experts.down_proj_bias"),
        }
    if layout == "checkpoint" and fam.expert_names is not None:
        gate, up, down = (f"experts.{{e}}.{n}.weight" for n in fam.expert_names)
        out |= {
            "w_gate": Piece(gate, transpose=True),
            "w_up": Piece(up, transpose=True),
            "w_down": Piece(down, transpose=True),
        }
    else:
        out |= {
            "w_gate": Piece("experts.gate_up_proj", transpose=True, start=0),
            "w_up": Piece("experts.gate_up_proj", transpose=True, start=F),
            "w_down": Piece("experts.down_proj", transpose=True),
        }
    shared = {"gated": "shared_expert", "deepseek": "shared_experts"}.get(fam.shared)
    if shared:
        out |= {
            f"shared_{p}": Piece(f"{shared}.{p}_proj.weight", transpose=True)
            for p in ("gate", "up", "down")
        }
    if "shared_expert_gate" in shapes:
        out["shared_expert_gate"] = Piece("shared_expert_gate.weight", transpose=True)
    return out


def block_prefix(
    config: Mapping, layer: int, layout: str, root: str = ROOT, family: str | None = None
) -> str:
    """The prefix of decoder layer ``layer``'s MoE tensors in ``layout``
    (``model.layers.3.mlp.``; Mixtral's checkpoints ``model.layers.3.block_sparse_moe.``)."""
    fam = family_of(config, family)
    block = fam.checkpoint_block if layout == "checkpoint" else "mlp"
    return f"{root}.{layer}.{block}."


def detect_layout(
    config: Mapping, names, layer: int, root: str = ROOT, family: str | None = None
) -> str:
    """The layout of decoder layer ``layer``'s block among the tensor ``names``: "checkpoint"
    where its router is under the checkpoints' prefix and its experts are per-expert tensors
    (or the family's checkpoints are fused), else "module"; raises one line when neither holds
    the router."""
    for layout in LAYOUTS:
        prefix = block_prefix(config, layer, layout, root, family)
        got = pieces(config, layout, family)
        first = {p.name.format(e=0) for p in got.values()}
        if all(prefix + n in names for n in first):
            return layout
    router = pieces(config, "module", family)["router_kernel"].name
    raise ValueError(
        f"hf: no MoE block of layer {layer} in the tensors (looked for "
        f"{block_prefix(config, layer, 'checkpoint', root, family)}{router} and its experts)"
    )


#: Reads a block of one tensor: (full name, index: a tuple of slices, one per axis) -> array.
Reader = Callable[[str, tuple], np.ndarray]


def _tensor_index(piece: Piece, index: tuple[slice, ...]) -> tuple[slice, ...]:
    """The index of the tensor (in the variable's order of axes, per-expert axis included)
    holding the variable's block ``index`` (each a slice with start and stop)."""
    axis = piece.axis % len(index)
    out = list(index)
    s = index[axis]
    stop = piece.start + piece.step * (s.stop - 1) + 1
    out[axis] = slice(piece.start + piece.step * s.start, stop, piece.step)
    return tuple(out)


def _swap(index: tuple) -> tuple:
    return (*index[:-2], index[-1], index[-2])


def read_block(piece: Piece, prefix: str, index: tuple[slice, ...], read: Reader) -> np.ndarray:
    """The block ``index`` (a slice with start and stop per axis) of the layer variable that
    ``piece`` describes, read with ``read`` from the block's tensors under ``prefix``."""
    where = _tensor_index(piece, index)
    experts = range(where[0].start, where[0].stop) if piece.per_expert else [None]
    rest = where[1:] if piece.per_expert else where
    blocks = []
    for e in experts:
        name = prefix + piece.name.format(e=e)
        block = read(name, _swap(rest) if piece.transpose else rest)
        blocks.append(np.swapaxes(block, -1, -2) if piece.transpose else block)
    return np.stack(blocks) if piece.per_expert else blocks[0]


def _variable_order_shapes(
    got: Mapping[str, Piece], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """Each block tensor's shape (name after the prefix, ``{e}`` unformatted) in its variables'
    order of axes, the per-expert axis included: the pieces of a tensor fill it together."""
    out: dict[str, tuple[int, ...]] = {}
    for var, piece in got.items():
        shape = list(shapes[var])
        axis = piece.axis % len(shape)
        shape[axis] = piece.start + piece.step * (shape[axis] - 1) + 1
        prev = out.get(piece.name, shape)
        out[piece.name] = tuple(max(a, b) for a, b in zip(prev, shape, strict=True))
    return out


def _stored(piece: Piece, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A tensor's stored shape from its shape in the variable's order of axes."""
    shape = shape[1:] if piece.per_expert else shape
    return _swap(shape) if piece.transpose else shape


def tensor_shapes(
    got: Mapping[str, Piece], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """Each block tensor's stored shape (name after the prefix, ``{e}`` unformatted), from the
    variables' ``shapes``."""
    by_name = {piece.name: piece for piece in got.values()}
    full = _variable_order_shapes(got, shapes)
    return {name: _stored(by_name[name], shape) for name, shape in full.items()}


def from_hf(
    config: Mapping,
    tensors: Mapping[str, np.ndarray],
    layer: int,
    *,
    layout: str = "auto",
    root: str = ROOT,
    family: str | None = None,
) -> dict[str, np.ndarray]:
    """Decoder layer ``layer``'s MoE block, from ``tensors`` (full names -> arrays, in either
    layout; "auto": `detect_layout`), as the layer's variables (name -> NumPy array, the
    tensors' dtype). Whole arrays on the host: `loading.load_moe` places each device's block
    instead."""
    if layout == "auto":
        layout = detect_layout(config, tensors, layer, root, family)
    prefix = block_prefix(config, layer, layout, root, family)
    shapes = layer_shapes(config, family)
    got = pieces(config, layout, family)
    check_shapes(got, shapes, prefix, lambda name: np.shape(tensors[name]), tensors)
    read = lambda name, index: np.asarray(tensors[name])[index]  # noqa: E731
    return {
        var: read_block(piece, prefix, tuple(slice(0, n) for n in shapes[var]), read)
        for var, piece in got.items()
    }


def check_shapes(got, shapes, prefix: str, shape_of, names) -> None:
    """Raises one line naming the first tensor of the block that is missing or whose shape is
    not the configuration's (``shape_of(full name)``, ``names`` the tensors present)."""
    for name, want in tensor_shapes(got, shapes).items():
        for e in range(shapes["w_gate"][0]) if "{e}" in name else [None]:
            full = prefix + name.format(e=e)
            if full not in names:
                raise ValueError(f"hf: the tensors have no {full}")
            if tuple(shape_of(full)) != want:
                raise ValueError(
                    f"hf: {full} has shape {tuple(shape_of(full))}; the config implies {want}"
                )


def to_hf(
    config: Mapping,
    params: Mapping[str, np.ndarray],
    layer: int,
    *,
    layout: str = "checkpoint",
    root: str = ROOT,
    family: str | None = None,
) -> dict[str, np.ndarray]:
    """The layer's variables (name -> array, e.g. `from_hf`'s or the layer's own) as decoder
    layer ``layer``'s block tensors in ``layout`` (full names -> NumPy arrays, the variables'
    dtype): `from_hf`'s inverse, bit for bit."""
    prefix = block_prefix(config, layer, layout, root, family)
    shapes = layer_shapes(config, family)
    got = pieces(config, layout, family)
    full = _variable_order_shapes(got, shapes)
    whole: dict[str, np.ndarray] = {}
    for var, piece in got.items():
        value = np.asarray(params[var])
        if value.shape != shapes[var]:
            raise ValueError(f"hf: {var} has shape {value.shape}; the config implies {shapes[var]}")
        target = whole.setdefault(piece.name, np.zeros(full[piece.name], value.dtype))
        target[_tensor_index(piece, tuple(slice(0, n) for n in value.shape))] = value
    out = {}
    for piece in got.values():
        value = whole.pop(piece.name, None)
        if value is None:
            continue  # written already (a fused tensor's other piece)
        value = np.swapaxes(value, -1, -2) if piece.transpose else value
        if piece.per_expert:
            out |= {
                prefix + piece.name.format(e=e): np.ascontiguousarray(v)
                for e, v in enumerate(value)
            }
        else:
            out[prefix + piece.name] = np.ascontiguousarray(value)
    return out
