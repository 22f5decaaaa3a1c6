"""Simulated CPU devices: `force_cpu_devices` asks XLA's host platform for a device count. It must
run before JAX initialises a backend; it and `launch_pinned_ranks` (one device per rank process) are
the only places the experiments touch ``XLA_FLAGS``. `host_for_compile_only_gpus` sets up a
process that compiles for GPUs it does not have.
"""

from __future__ import annotations

import os

#: XLA's flag for the host platform's device count.
DEVICE_FLAG = "--xla_force_host_platform_device_count"


def force_cpu_devices(count: int, *, cpu_only: bool = False) -> None:
    """Asks XLA's host platform for ``count`` devices (a no-op if ``XLA_FLAGS`` already names a
    count, so a caller's choice wins). ``cpu_only`` also pins JAX to the CPU platform unless
    ``JAX_PLATFORMS`` is set. Only the host platform reads the flag: on a GPU it changes nothing."""
    if count < 1:
        raise ValueError(f"cpu device count must be >= 1, got {count}")
    flags = os.environ.get("XLA_FLAGS", "")
    if DEVICE_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_FLAG}={count}".strip()
    if cpu_only:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


#: The environment a process compiling for compile-only GPUs needs (docs/gpu.md): JAX
#: on the CPU host (it has no GPU to start), and no check of a CUDA install by the CUDA plugin
#: (none is needed to compile).
COMPILE_ONLY_GPU_ENV = {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}


def host_for_compile_only_gpus() -> None:
    """Sets `COMPILE_ONLY_GPU_ENV` where the caller's environment does not set them, for a
    program that compiles with XLA:GPU for compile-only GPUs (`ultraep_jax.tools.
    compile_only_mesh`). Must run before JAX initialises a backend."""
    for name, value in COMPILE_ONLY_GPU_ENV.items():
        os.environ.setdefault(name, value)
