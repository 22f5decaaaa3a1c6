"""XLA:GPU's compiler on a host without a GPU (docs/gpu.md): the compile-only GPUs of the
installed CUDA plugin (`compile_only_devices`, `compile_only_mesh`), whose target configuration is
XLA's own spec of the device kind, read from the plugin's library (`target_config`). A program
jitted over such a mesh compiles with XLA:GPU here (``.lower(...).compile()``: its
``memory_analysis()`` and ``as_text()``) and cannot run. Needs JAX >= 0.12 with the CUDA plugin
and PJRT library of jaxlib's exact version, ptxas (on PATH or the nvidia-cuda-nvcc wheel), and a
process started with ``JAX_PLATFORMS=cpu`` (``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` quiets the
plugin's check for a CUDA install). Nothing here is imported by the layer."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import mmap
import pathlib

import numpy as np

#: The CUDA plugins' PJRT modules (jax-cuda13-pjrt, jax-cuda12-pjrt) and their distributions.
CUDA_PLUGINS = (
    ("jax_plugins.xla_cuda13", "jax-cuda13-pjrt"),
    ("jax_plugins.xla_cuda12", "jax-cuda12-pjrt"),
)
#: The PJRT library in a plugin module's folder.
PLUGIN_LIBRARY = "xla_cuda_plugin.so"
#: XLA's device descriptions (xla/backends/gpu/target_config/specs/*.txtpb) of the GPUs the
#: programs compile for, by a short name.
DEVICE_KINDS = {
    "h100": "NVIDIA H100 80GB HBM3",
    "h200": "NVIDIA H200 141GB HBM3e",
}
#: The H100 of XLA's specs (h100_sxm.txtpb), the default target.
H100 = DEVICE_KINDS["h100"]
#: GPUs per node of a multi-node topology (an HGX H100 or H200 node).
GPUS_PER_NODE = 8


def cuda_plugin() -> tuple[pathlib.Path, str] | None:
    """(the installed CUDA plugin's PJRT library, its distribution's version), or None where no
    CUDA plugin is installed."""
    for module, distribution in CUDA_PLUGINS:
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:  # no jax_plugins package at all
            spec = None
        if spec is not None and spec.origin is not None:
            library = pathlib.Path(spec.origin).parent / PLUGIN_LIBRARY
            if library.exists():
                return library, importlib.metadata.version(distribution)
    return None


@functools.cache
def target_config(device_kind: str = H100) -> str:
    """XLA's ``GpuTargetConfigProto`` of ``device_kind`` (a `DEVICE_KINDS` value or another
    device description XLA has a spec of), in text form, as the CUDA plugin's library embeds it
    (XLA compiles its specs into the library as NUL-terminated strings): the string that ends
    with that device's ``device_description_str``. Read from the installed plugin, so it is
    always the spec that plugin parses. Raises one line (LookupError) where no plugin or no such
    spec is found."""
    found = cuda_plugin()
    if found is None:
        raise LookupError("target_config: no CUDA plugin (jax-cuda13-plugin) is installed")
    library, _ = found
    key = f'device_description_str: "{device_kind}"\n'.encode()
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        at = data.find(key)
        if at < 0 or data[at + len(key)] != 0:
            raise LookupError(f"target_config: {library} embeds no spec of {device_kind!r}")
        return data[data.rfind(b"\0", 0, at) + 1 : at + len(key)].decode()


def topology_name(count: int, per_node: int = GPUS_PER_NODE) -> str:
    """The CUDA plugin's topology of ``count`` GPUs, "<slices>x<hosts per slice>x<devices per
    host>": one node of ``count`` ("1x1x8") up to ``per_node``, else ``count / per_node`` nodes
    of ``per_node``, each its own slice (an NVLink domain: "8x1x8" is 8 HGX nodes, EP64). Raises
    one line (ValueError) where ``count`` is more than a node and not a whole number of nodes."""
    if count < 1 or per_node < 1:
        raise ValueError(f"topology_name: counts must be >= 1, got {count} GPUs, {per_node}/node")
    if count <= per_node:
        return f"1x1x{count}"
    if count % per_node:
        raise ValueError(f"topology_name: {count} GPUs is no whole number of {per_node}-GPU nodes")
    return f"{count // per_node}x1x{per_node}"


def compile_only_devices(
    count: int, device_kind: str = H100, per_node: int = GPUS_PER_NODE
) -> list:
    """``count`` compile-only GPUs of ``device_kind`` (`topology_name`'s nodes), ids 0 to
    ``count - 1`` in order (node after node)."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda",
        target_config=target_config(device_kind),
        topology=topology_name(count, per_node),
    )
    devices = list(topology.devices)
    ids = [d.id for d in devices]
    if ids != list(range(count)):
        raise ValueError(f"compile_only_devices: the plugin's devices have ids {ids}")
    return devices


def compile_only_mesh(
    ep: int = 8,
    dp: int = 1,
    device_kind: str = H100,
    *,
    per_node: int = GPUS_PER_NODE,
    axis_types=None,
):
    """A `jax.sharding.Mesh` of ``ep`` ranks on the "expert" axis under a "data" axis of size
    ``dp`` (none when 1), over ``dp * ep`` compile-only GPUs (`compile_only_devices`). Device ids
    are row-major over the mesh (device ``d`` is in data row ``d // ep``). ``axis_types``: one
    per axis, or None for `jax.sharding.Mesh`'s default."""
    import jax

    devices = np.array(compile_only_devices(dp * ep, device_kind, per_node))
    shape, names = ((ep,), ("expert",)) if dp == 1 else ((dp, ep), ("data", "expert"))
    types = {} if axis_types is None else {"axis_types": tuple(axis_types)}
    return jax.sharding.Mesh(devices.reshape(shape), names, **types)
