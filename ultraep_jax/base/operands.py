"""Which operands and devices the grouped-matmul kernels take: the facts the resolver's predicates
read (`config.resolve`) and the kernels' own modules check, stated once here (importing no kernel).

`MgpuTiles`, `mgpu_unsupported`: JAX's Mosaic GPU ragged-dot kernels (`experts.gmm_mgpu`);
`mosaic_tpu_unsupported`: tokamax's Mosaic TPU ragged dot (`experts.gmm_tokamax`); `is_hopper`,
`is_hopper_gpu`, `tpu_generation`: what a device's kind and compute capability say;
`host_is_hopper`, `default_device`: the devices the kernels themselves read when they are
lowered, whatever the mesh (JAX's and tokamax's code; where, in jax 0.11.2 and 0.12.1 and
tokamax 0.0.17, is said at each).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax
import jax.numpy as jnp


class MgpuTiles(NamedTuple):
    """Tile settings of JAX's Mosaic GPU ragged-dot kernels (see `gmm_mgpu.grouped_matmul_mgpu`).

    The defaults were the fastest forward + backward of those timed on an H100 (bf16, K=7168,
    N=2048, G=8, M=32768; experiments/results/gpu_h100.txt): 5 pipeline stages, column tiles
    traversed in groups of 4 (grid_block_n=1 was 1.7x slower)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 5
    grid_block_n: int = 4


def mgpu_unsupported(lhs_shape, rhs_shape, dtype, tiles: MgpuTiles | None = None) -> str | None:
    """Why `gmm_mgpu.grouped_matmul_mgpu` cannot take these operands (None: it can): the dtype
    must be bf16/f16, and K, N must be multiples of the tiles (the kernels do not pad)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (needs bfloat16 or float16)"
    (_, K), (_, _, N) = lhs_shape, rhs_shape
    t = MgpuTiles() if tiles is None else tiles
    for name, dim, tile in (
        ("K", K, t.block_k),  # forward: K in block_k chunks
        ("N", N, t.block_k),  # d_lhs: N in block_k chunks
        ("N", N, t.block_n),  # forward columns, d_rhs columns
        ("K", K, t.block_m),  # d_rhs rows
    ):
        if dim % tile:
            return f"{name}={dim} is not a multiple of {tile}"
    return None


#: tokamax's Mosaic TPU ragged dot takes every non-group dimension of both operands only from
#: this size (it raises NotImplementedError below it: tokamax 0.0.17); the rows M are padded to
#: its row tiles by the caller (`gmm_tokamax`), so the rule here is on K and N.
MOSAIC_TPU_MIN_DIM = 128


def mosaic_tpu_unsupported(lhs_shape, rhs_shape, device_kind: str | None) -> str | None:
    """Why tokamax's Mosaic TPU ragged dot cannot take these operands (lhs [M, K], rhs [G, K,
    N]) on a TPU of ``device_kind`` (None: it can): it runs on TPU v5 and later (its
    ``supported_on``), and K and N must be >= `MOSAIC_TPU_MIN_DIM`."""
    generation = tpu_generation(device_kind)
    if generation is None or generation < 5:
        return f"device kind {device_kind!r} (tokamax's Mosaic TPU kernel needs TPU v5 or later)"
    (_, K), (_, _, N) = lhs_shape, rhs_shape
    if min(K, N) < MOSAIC_TPU_MIN_DIM:
        return f"K={K}, N={N} (each must be >= {MOSAIC_TPU_MIN_DIM})"
    return None


def tpu_generation(device_kind: str | None) -> int | None:
    """The TPU generation a device kind names ("TPU v5 lite" -> 5, "TPU7x" -> 7), or None."""
    match = re.match(r"TPU\s*v?(\d+)", device_kind or "")
    return int(match.group(1)) if match else None


#: Device kinds of NVIDIA's Hopper GPUs (compute capability 9.0).
_HOPPER = re.compile(r"\b(GH200|H100|H200|H800|H20)\b")


def is_hopper(device_kind: str | None, compute_capability: str | None = None) -> bool:
    """Whether a device of ``device_kind`` ("NVIDIA H100 80GB HBM3") and ``compute_capability``
    ("9.0"; None where the device carries none, as an abstract device) is a Hopper GPU: its
    compute capability 9.x where known, else its kind."""
    if compute_capability is not None:
        return str(compute_capability).split(".")[0] == "9"
    return bool(_HOPPER.search(device_kind or ""))


def is_hopper_gpu(device) -> bool:
    """Whether ``device`` (a JAX device, compile-only ones included) is a Hopper GPU (`is_hopper`
    of its kind and, where it carries one, its compute capability)."""
    return device.platform == "gpu" and is_hopper(
        device.device_kind, getattr(device, "compute_capability", None)
    )


def host_is_hopper() -> bool:
    """Whether this process's first device (``jax.devices()[0]``) is an NVIDIA GPU of compute
    capability 9.x. JAX's Mosaic GPU weight-gradient kernel reads that device when it is traced,
    whatever the mesh: its grid is ``jax.devices()[0].core_count``
    (jax/experimental/pallas/ops/gpu/transposed_ragged_dot_mgpu.py:192), and neither a
    ``jax.default_device`` nor the mesh changes it; a CPU host's device has no core count. So
    "mgpu" lowers only on a Hopper host (its forward kernel alone, 132 SMs fixed, lowers
    anywhere)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    return is_hopper_gpu(dev)


def default_device():
    """JAX's default device: ``jax.default_device``'s where one is set, else this process's first
    (`jax.extend.backend.get_default_device`). tokamax's GPU ragged dot reads it when it is
    traced, for its kernel's variant and grid (tokamax/_src/gpu_utils.py:30,
    ops/ragged_dot/pallas_mosaic_gpu.py:376, pallas_mosaic_gpu_kernel_sm90.py:149 in tokamax
    0.0.17), so it lowers for a mesh's GPUs within ``jax.default_device`` of one of them (a
    compile-only device of `jax.experimental.topologies` serves)."""
    import jax.extend.backend

    return jax.extend.backend.get_default_device()
