"""Arrays as they come to the mapping: a tensor of any framework as a NumPy array (torch's
bfloat16 and float8 through their bits, torch left unimported until a torch tensor is met), and
a layer's variables from whatever holds them (the layer, its `nnx.State`, a pure dict)."""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

#: The dtypes NumPy lacks, by torch's and ml_dtypes' common name (``torch.bfloat16``,
#: ``ml_dtypes.bfloat16``): a torch tensor of one is read through its bits.
ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


def from_bits(bits: np.ndarray, name: str) -> np.ndarray:
    """``bits`` (integers, of the dtype's width: int16 or uint16 for bfloat16, uint8 for float8)
    reinterpreted, same shape, as the ml_dtypes dtype ``name`` (one of `ML_DTYPES`)."""
    dtype = np.dtype(getattr(ml_dtypes, name))
    if bits.dtype.kind not in "iu" or bits.dtype.itemsize != dtype.itemsize:
        raise TypeError(f"hf: {name} needs {dtype.itemsize}-byte integer bits, got {bits.dtype}")
    return bits.view(dtype)


def _torch_to_numpy(tensor) -> np.ndarray:
    """A torch tensor (any device, with or without grad) as a NumPy array of its dtype; where
    NumPy has none (`ML_DTYPES`) its bits viewed as ml_dtypes' (``Tensor.numpy`` refuses them:
    "Got unsupported ScalarType BFloat16")."""
    import torch  # a torch tensor was passed: torch is imported already

    tensor = tensor.detach().cpu()
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in ML_DTYPES:
        return tensor.numpy()
    bits = torch.int16 if tensor.element_size() == 2 else torch.uint8
    return from_bits(tensor.view(bits).numpy(), name)


def as_numpy(value) -> np.ndarray:
    """A tensor (NumPy, JAX, torch, or anything `np.asarray` takes) as a NumPy array of its own
    dtype, same shape."""
    if type(value).__module__.split(".")[0] == "torch" and hasattr(value, "detach"):
        return _torch_to_numpy(value)
    return np.asarray(value)


def variable_values(params) -> dict:
    """The layer's variables by name, from a `uep.MoE` itself (all of them, `RouterBias`
    included), its ``nnx.State`` (``nnx.state(layer, nnx.Param)``: the trained parameters; a
    gradient) or a mapping of names to arrays (``nnx.to_pure_dict(...)``, `from_hf`'s)."""
    if not isinstance(params, Mapping):
        from flax import nnx

        if not isinstance(params, nnx.Module):
            raise TypeError(
                "hf: the variables must be a uep.MoE, its nnx.State or a dict of arrays, got "
                f"{type(params).__name__}"
            )
        params = nnx.state(params)
    return {name: _unwrapped(v) for name, v in params.items()}


def _unwrapped(value):
    """A variable's value (an ``nnx.Variable``'s), or ``value`` itself."""
    get = getattr(value, "get_value", None)
    return get() if callable(get) else getattr(value, "value", value)
