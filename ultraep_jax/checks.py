"""Input checks of the routed experts: one line naming the value, at trace time (shapes, dtypes)
or, for concrete expert ids, at call time. Each message begins with the public entry point the
user called (``caller``: "MoE", "routed_experts", "routed_experts_local")."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ultraep_jax.config import ExpertParallel

#: The routed experts' parameters in the order ``params`` lists them (the biases optional).
PARAM_NAMES = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")


def check_dtype(caller: str, name: str, a, want=jnp.floating) -> None:
    """Raises (one line naming the value) unless ``a``'s dtype is of the kind ``want``
    (`jnp.floating`: real floating point; `jnp.integer`)."""
    if not jnp.issubdtype(a.dtype, want):
        kind = "an integer" if want is jnp.integer else "a real floating-point"
        raise TypeError(f"{caller}: {name} must have {kind} dtype, got {a.dtype}")


def _check_arrays(caller: str, x, experts, weights, params, ep, token_mask) -> None:
    """Types, dtypes and the shapes every caller shares: x [..., D], experts and weights
    [..., K], token_mask [...] (x's leading shape)."""
    if not isinstance(ep, ExpertParallel):
        raise TypeError(f"{caller}: ep must be an ExpertParallel, got {type(ep).__name__}")
    if not isinstance(params, (tuple, list)) or len(params) not in (3, 6):
        raise ValueError(
            f"{caller}: params must be (w_gate, w_up, w_down), got {type(params).__name__}"
            + (f" of {len(params)}" if isinstance(params, (tuple, list)) else "")
            + " (with the experts' biases: (w_gate, w_up, w_down, b_gate, b_up, b_down))"
        )
    named = {"x": x, "experts": experts, "weights": weights}
    named.update(zip(PARAM_NAMES, params, strict=False))
    if token_mask is not None:
        named["token_mask"] = token_mask
    for name, a in named.items():
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(f"{caller}: {name} must be an array, got {type(a).__name__}")
        if name == "token_mask":
            if a.dtype != jnp.bool_:
                raise TypeError(f"{caller}: token_mask must be a bool array, got {a.dtype}")
        else:
            check_dtype(caller, name, a, jnp.integer if name == "experts" else jnp.floating)
    if x.ndim < 2:
        raise ValueError(
            f"{caller}: x must be [..., d_model] with tokens, got shape {tuple(x.shape)}"
        )
    lead = tuple(x.shape[:-1])
    if experts.shape != weights.shape or tuple(experts.shape[:-1]) != lead:
        raise ValueError(
            f"{caller}: experts {tuple(experts.shape)} and weights {tuple(weights.shape)} must "
            f"both be [..., top_k] with x's leading shape {lead}"
        )
    if token_mask is not None and tuple(token_mask.shape) != lead:
        raise ValueError(
            f"{caller}: token_mask {tuple(token_mask.shape)} must have x's leading shape {lead}"
        )
    if 0 in x.shape or experts.shape[-1] == 0:
        raise ValueError(
            f"{caller}: tokens, d_model and top_k must be >= 1, got x {tuple(x.shape)} and "
            f"experts {tuple(experts.shape)}"
        )


def _check_weights(caller: str, params, num_experts: int, d_model: int, where: str) -> None:
    """w_gate, w_up [E', D, F] and w_down [E', F, D] with E' = ``num_experts``, and the biases
    b_gate, b_up [E', F] and b_down [E', D] if given; all of one dtype."""
    w_gate, w_up, w_down = params[:3]
    E, D, F = num_experts, d_model, w_gate.shape[-1]
    if (w_gate.shape, w_up.shape, w_down.shape) != ((E, D, F), (E, D, F), (E, F, D)):
        raise ValueError(
            f"{caller}: expert weights must be w_gate, w_up [{where}={E}, D={D}, F] and w_down "
            f"[{where}, F, D]; got {tuple(w_gate.shape)}, {tuple(w_up.shape)}, "
            f"{tuple(w_down.shape)}"
        )
    shapes = tuple(tuple(b.shape) for b in params[3:])
    if shapes and shapes != ((E, F), (E, F), (E, D)):
        raise ValueError(
            f"{caller}: expert biases must be b_gate, b_up [{where}={E}, F={F}] and b_down "
            f"[{where}, D={D}]; got {', '.join(str(s) for s in shapes)}"
        )
    if len({w.dtype for w in params}) != 1:
        *rest, last = PARAM_NAMES[: len(params)]
        names = f"{', '.join(rest)} and {last}"
        raise TypeError(
            f"{caller}: {names} must have one dtype, got {', '.join(str(w.dtype) for w in params)}"
        )


def check_chunks(caller: str, ep: ExpertParallel, d_ff: int) -> None:
    """Raises one line unless ``ep.execution.transfer_chunks`` fits in ``d_ff`` hidden columns
    (those of one device: `ExpertParallel.local_d_ff` of the whole width)."""
    check_chunk_count(ep.execution.transfer_chunks, d_ff, caller)


def check_chunk_count(chunks: int, d_ff: int, caller: str = "Execution") -> None:
    """Raises one line unless ``chunks`` (a positive int: `Execution` checks that) fits in
    ``d_ff``: a chunk of the replica transfer is at least one hidden column."""
    if chunks > d_ff:
        raise ValueError(
            f"{caller}: transfer_chunks={chunks} exceeds d_ff={d_ff} (a chunk is at "
            "least one hidden column)"
        )


def check_int32_sizes(caller: str, pairs: int, capacity: int) -> None:
    """Raises (one line naming the value) unless the pairs on a device and the receive buffer's
    rows fit the int32 indices of `dispatch`."""
    limit = 2**31 - 1
    if pairs > limit:
        raise ValueError(
            f"{caller}: {pairs} (token, choice) pairs per device exceed 2**31 - 1 (dispatch "
            "indexes them in int32); split the batch over more devices"
        )
    if capacity > limit:
        raise ValueError(
            f"{caller}: a receive buffer of {capacity} rows per device exceeds 2**31 - 1 (dispatch "
            "indexes it in int32); set a capacity_factor or split the batch over more devices"
        )


def check_call_inputs(x, experts, weights, params, ep, token_mask) -> None:
    """Raises (one line naming the value) unless `over_mesh.routed_experts` can run on
    these global arrays; concrete expert ids of real tokens are range-checked."""
    caller = "routed_experts"
    _check_arrays(caller, x, experts, weights, params, ep, token_mask)
    _check_weights(caller, params, ep.num_experts, x.shape[-1], "E")
    check_chunks(caller, ep, ep.local_d_ff(params[0].shape[-1], caller))
    per_device = -(-math.prod(x.shape[:-1]) // ep.token_devices)  # padded to the devices
    top_k = experts.shape[-1]
    check_int32_sizes(caller, per_device * top_k, ep.capacity(per_device, top_k))
    for e in _readable_ids(experts, token_mask):
        if e.size and (e.min() < 0 or e.max() >= ep.num_experts):
            raise ValueError(
                f"{caller}: experts must be in [0, {ep.num_experts}), got {e.min()}..{e.max()}"
            )


def _fully_addressable(a) -> bool:
    """Whether this process holds every value of ``a`` (None and host arrays included)."""
    return not isinstance(a, jax.Array) or a.is_fully_addressable


def _index_key(index: tuple[slice, ...]) -> tuple:
    """A hashable form of a shard's index (slices are not hashable before Python 3.12)."""
    return tuple((s.start, s.stop, s.step) for s in index)


def _readable_ids(experts, token_mask) -> list[np.ndarray]:
    """The concrete expert ids of real tokens that this process can read, as NumPy arrays: all of
    them in one process; under `jax.distributed`, for a global array that spans other processes'
    devices, those of the shards on this process's devices (each process checks its own), where
    the mask's shard on the same device covers the same tokens. Nothing where the ids or the mask
    are traced, or where no mask shard lines up: there a pair whose id is outside [0, E) is
    skipped at run time and counted in ``MoEStats.invalid``."""
    if isinstance(experts, jax.core.Tracer) or isinstance(token_mask, jax.core.Tracer):
        return []
    if _fully_addressable(experts) and _fully_addressable(token_mask):
        e = np.asarray(experts)
        return [e if token_mask is None else e[np.asarray(token_mask)]]
    if _fully_addressable(token_mask):
        mask = None if token_mask is None else np.asarray(token_mask)
        return [
            np.asarray(s.data) if mask is None else np.asarray(s.data)[mask[s.index[:-1]]]
            for s in experts.addressable_shards
        ]
    if not isinstance(experts, jax.Array):
        return []
    masks = {(s.device, _index_key(s.index)): s.data for s in token_mask.addressable_shards}
    ids = []
    for s in experts.addressable_shards:
        mask = masks.get((s.device, _index_key(s.index[:-1])))
        if mask is not None:
            ids.append(np.asarray(s.data)[np.asarray(mask)])
    return ids


def check_local_inputs(x, experts, weights, params, ep, token_mask) -> None:
    """Raises (one line naming the value) unless `core.routed_experts_local` can run on this
    device's arrays: the weights are this device's E / R experts (and its F / tensor_size hidden
    columns)."""
    caller = "routed_experts_local"
    _check_arrays(caller, x, experts, weights, params, ep, token_mask)
    _check_weights(caller, params, ep.num_experts // ep.ep_size, x.shape[-1], "E/R")
    check_chunks(caller, ep, params[0].shape[-1])
    tokens, top_k = math.prod(x.shape[:-1]), experts.shape[-1]
    check_int32_sizes(caller, tokens * top_k, ep.capacity(tokens, top_k))
