"""Loads the native planner libraries built from ffi/ and registers their XLA FFI targets."""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import pathlib

import jax

PLAN_TARGET = "ultraep_plan"

_CPU_LIB = "libultraep_ffi_cpu.so"
_CUDA_LIB = "libultraep_ffi_cuda.so"


@functools.cache
def _library_dir() -> pathlib.Path | None:
    """The folder of one build of the native libraries, or None.

    Beside the package's modules; or, when a source checkout shadows the installed package (tests
    run from the repository root) or an editable install keeps them apart, where pip put them. Both
    libraries come from this one folder, so the CPU and CUDA handlers are always of the same build.
    """
    import ultraep_jax

    folders = [pathlib.Path(folder) for folder in ultraep_jax.__path__]
    try:
        dist = importlib.metadata.distribution("ultraep_jax")
        folders.append(pathlib.Path(dist.locate_file("ultraep_jax")))
    except importlib.metadata.PackageNotFoundError:
        pass
    return next((folder for folder in folders if (folder / _CPU_LIB).exists()), None)


def _find(name: str) -> pathlib.Path | None:
    """The native library `name` of that build, or None where it was not built."""
    folder = _library_dir()
    if folder is None or not (folder / name).exists():
        return None
    return folder / name


@functools.cache
def cpu_library() -> ctypes.CDLL:
    """The host library; registers the CPU handler (and the CUDA one, when it was built)."""
    path = _find(_CPU_LIB)
    if path is None:
        raise ImportError(
            f"ultraep_jax: native library {_CPU_LIB} not found in the package; "
            "install the package with `pip install .` so that ffi/ gets built"
        )
    lib = ctypes.cdll.LoadLibrary(str(path))
    lib.ultraep_workspace_elems.restype = ctypes.c_int64
    lib.ultraep_workspace_elems.argtypes = [ctypes.c_int64] * 3
    jax.ffi.register_ffi_target(PLAN_TARGET, jax.ffi.pycapsule(lib.UltraepPlanCpu), platform="cpu")
    cuda_path = _find(_CUDA_LIB)
    if cuda_path is not None:
        # Loading needs no GPU (the CUDA runtime is linked statically and finds the driver lazily).
        cuda = ctypes.cdll.LoadLibrary(str(cuda_path))
        jax.ffi.register_ffi_target(
            PLAN_TARGET, jax.ffi.pycapsule(cuda.UltraepPlanCuda), platform="CUDA"
        )
    return lib


def has_cuda_handler() -> bool:
    """Whether the CUDA planner handler was built into this install."""
    return _find(_CUDA_LIB) is not None


def workspace_elems(ep_size: int, num_experts: int, slots_per_rank: int) -> int:
    """int64 workspace elements one plan needs (the C++ core's own formula)."""
    return int(cpu_library().ultraep_workspace_elems(ep_size, num_experts, slots_per_rank))
