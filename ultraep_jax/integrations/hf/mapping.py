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

A block that lacks a tensor or holds one of another shape than its config's is refused in one
line that lists every such tensor (`check_shapes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax.numpy as jnp
import numpy as np

from ultraep_jax.integrations.hf.arrays import as_numpy, variable_values
from ultraep_jax.integrations.hf.families import as_config, family_of, moe_kwargs

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


def layer_shapes(config, family: str | None = None) -> dict[str, tuple[int, ...]]:
    """The shape of each layer variable the family's block maps to (``config``: see
    `families.as_config`)."""
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


def pieces(config, layout: str, family: str | None = None) -> dict[str, Piece]:
    """Each layer variable's `Piece` of the block's tensors in ``layout`` (`LAYOUTS`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"hf: layout must be one of {LAYOUTS}, got {layout!r}")
    config = as_config(config)
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
    if shared and "shared_gate" in shapes:  # a width of 0 is no shared expert
        out |= {
            f"shared_{p}": Piece(f"{shared}.{p}_proj.weight", transpose=True)
            for p in ("gate", "up", "down")
        }
    if "shared_expert_gate" in shapes:
        out["shared_expert_gate"] = Piece("shared_expert_gate.weight", transpose=True)
    return out


def block_prefix(
    config, layer: int, layout: str, root: str = ROOT, family: str | None = None
) -> str:
    """The prefix of decoder layer ``layer``'s MoE tensors in ``layout``
    (``model.layers.3.mlp.``; Mixtral's checkpoints ``model.layers.3.block_sparse_moe.``)."""
    fam = family_of(config, family)
    block = fam.checkpoint_block if layout == "checkpoint" else "mlp"
    return f"{root}.{layer}.{block}."


def detect_layout(config, names, layer: int, root: str = ROOT, family: str | None = None) -> str:
    """The layout of decoder layer ``layer``'s block among the tensor ``names``: the one of
    `LAYOUTS` more of whose tensors are there (the router, the first expert's, the shared
    expert's, ...; "checkpoint" on a tie), so that a block lacking some is read in its layout and
    `check_shapes` names what it lacks; raises one line when no tensor of either is there."""
    config = as_config(config)
    found = {}
    for layout in LAYOUTS:
        prefix = block_prefix(config, layer, layout, root, family)
        first = {p.name.format(e=0) for p in pieces(config, layout, family).values()}
        found[layout] = sum(prefix + n in names for n in first)
    best = max(LAYOUTS, key=lambda layout: found[layout])  # the first of a tie
    if found[best]:
        return best
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
    config,
    tensors: Mapping[str, np.ndarray],
    layer: int,
    *,
    layout: str = "auto",
    root: str = ROOT,
    family: str | None = None,
) -> dict[str, np.ndarray]:
    """Decoder layer ``layer``'s MoE block, from ``tensors`` (full names -> arrays, in either
    layout; "auto": `detect_layout`), as the layer's variables (name -> NumPy array, the
    tensors' dtype). ``config``: see `families.as_config`; ``tensors`` may be NumPy, JAX or torch
    arrays (a ``state_dict``, bfloat16 too: `arrays.as_numpy`). Whole arrays on the host:
    `loading.load_moe` places each device's block instead."""
    config = as_config(config)
    if layout == "auto":
        layout = detect_layout(config, tensors, layer, root, family)
    prefix = block_prefix(config, layer, layout, root, family)
    shapes = layer_shapes(config, family)
    got = pieces(config, layout, family)
    check_shapes(got, shapes, prefix, lambda name: np.shape(tensors[name]), tensors)
    host: dict[str, np.ndarray] = {}  # each tensor converted once (a fused one feeds two)

    def read(name, index):
        if name not in host:
            host[name] = as_numpy(tensors[name])
        return host[name][index]

    return {
        var: read_block(piece, prefix, tuple(slice(0, n) for n in shapes[var]), read)
        for var, piece in got.items()
    }


def block_tensors(got, shapes, prefix: str) -> dict[str, tuple[int, ...]]:
    """Each tensor of the block (full name, one per expert where the layout has them) with its
    stored shape, in the block's order."""
    return {
        prefix + name.format(e=e): shape
        for name, shape in tensor_shapes(got, shapes).items()
        for e in (range(shapes["w_gate"][0]) if "{e}" in name else [None])
    }


def block_problems(got, shapes, prefix: str, shape_of, names) -> list[str]:
    """Every tensor of the block that is missing ("no <name>") or whose shape is not the
    configuration's ("<name> has shape ..."), in the block's order (``shape_of(full name)``,
    ``names`` the tensors present)."""
    problems = []
    for full, want in block_tensors(got, shapes, prefix).items():
        if full not in names:
            problems.append(f"no {full}")
        elif (shape := tuple(shape_of(full))) != want:
            problems.append(f"{full} has shape {shape} where the config implies {want}")
    return problems


def check_shapes(got, shapes, prefix: str, shape_of, names) -> None:
    """Raises one line listing every tensor of the block that is missing or whose shape is not
    the configuration's (`block_problems`)."""
    if problems := block_problems(got, shapes, prefix, shape_of, names):
        raise ValueError(f"hf: the MoE block {prefix}* is not the config's: {'; '.join(problems)}")


#: The variables that are state, not an ``nnx.Param`` (`uep.RouterBias`): absent from a
#: Param-only state and from gradients, and then their tensors are left out.
STATE_VARIABLES = ("router_bias",)


def _present(got: Mapping[str, Piece], values: Mapping) -> dict[str, Piece]:
    """The pieces whose variables ``values`` holds; raises one line naming the trained
    parameters it lacks (a missing `STATE_VARIABLES` entry leaves its tensor out)."""
    missing = [var for var in got if var not in values and var not in STATE_VARIABLES]
    if missing:
        raise ValueError(
            f"hf: the variables have no {', '.join(missing)}: pass the layer's nnx.Param state "
            "(nnx.state(layer, nnx.Param)) or the layer itself"
        )
    return {var: piece for var, piece in got.items() if var in values}


def to_hf(
    config,
    params,
    layer: int,
    *,
    layout: str = "checkpoint",
    root: str = ROOT,
    family: str | None = None,
    dtype=None,
) -> dict[str, np.ndarray]:
    """The layer's variables as decoder layer ``layer``'s block tensors in ``layout`` (full
    names -> NumPy arrays): `from_hf`'s inverse, bit for bit.

    Args:
      config: see `families.as_config`.
      params: the variables by name: the layer itself, ``nnx.state(layer, nnx.Param)`` (or its
        ``nnx.to_pure_dict``), `from_hf`'s dict, or gradients of the same form (with
        ``layout="module"``: transformers' names of its ``param.grad``). `uep.RouterBias`
        ``router_bias`` is state, no ``nnx.Param``: where it is absent, its tensor
        (``gate.e_score_correction_bias``) is left out; a missing parameter is refused.
      layout: `LAYOUTS`.
      dtype: every tensor cast to it (a checkpoint's, such as ``jnp.bfloat16`` or "bfloat16");
        None: each variable's dtype.
    """
    config = as_config(config)
    prefix = block_prefix(config, layer, layout, root, family)
    shapes = layer_shapes(config, family)
    values = variable_values(params)
    got = _present(pieces(config, layout, family), values)
    full = _variable_order_shapes(got, shapes)
    whole: dict[str, np.ndarray] = {}
    for var, piece in got.items():
        value = as_numpy(values[var])
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
        value = value if dtype is None else value.astype(jnp.dtype(dtype))
        if piece.per_expert:
            out |= {
                prefix + piece.name.format(e=e): np.ascontiguousarray(v)
                for e, v in enumerate(value)
            }
        else:
            out[prefix + piece.name] = np.ascontiguousarray(value)
    return out
