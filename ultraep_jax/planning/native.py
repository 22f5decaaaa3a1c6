"""Loads the native planner libraries built from ffi/ and registers their XLA FFI targets."""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import pathlib

import jax

PLAN_TARGET = "ultraep_plan"
#: The parallel form of the planner (ffi/planner_parallel.h): the same plans; on CUDA a block of
#: warps per plan, on the CPU the same code with the lanes emulated in loops.
PLAN_PARALLEL_TARGET = "ultraep_plan_parallel"

_CPU_LIB = "libultraep_ffi_cpu.so"
_CUDA_LIB = "libultraep_ffi_cuda.so"


@functools.cache
def _library_dir() -> pathlib.Path | None:
    """The folder of one build of the native libraries, or None.

    Beside the package's modules; or, when a source checkout shadows the installed package (tests
    run from the repository root) or an editable install keeps them apart, where pip put them. Both
    libraries come from this one folder, so the CPU and CUDA handlers are always of the same build.
    """
    folders = [pathlib.Path(__file__).parent.parent]  # the package's folder
    try:
        dist = importlib.metadata.distribution("ultraep_jax")
        folders.append(pathlib.Path(dist.locate_file("ultraep_jax")))
    except importlib.metadata.PackageNotFoundError:
        pass
    return next((folder for folder in folders if (folder / _CPU_LIB).exists()), None)


def library_path(name: str) -> pathlib.Path | None:
    """The native library `name` of that build, or None where it was not built."""
    folder = _library_dir()
    if folder is None or not (folder / name).exists():
        return None
    return folder / name


@functools.cache
def cpu_library() -> ctypes.CDLL:
    """The host library; registers the CPU handler (and the CUDA one, when it was built)."""
    path = library_path(_CPU_LIB)
    if path is None:
        raise ImportError(
            f"ultraep_jax: native library {_CPU_LIB} not found in the package; "
            "install the package with `pip install .` so that ffi/ gets built"
        )
    lib = ctypes.cdll.LoadLibrary(str(path))
    for name in ("ultraep_workspace_elems", "ultraep_parallel_workspace_elems"):
        getattr(lib, name).restype = ctypes.c_int64
        getattr(lib, name).argtypes = [ctypes.c_int64] * 3
    lib.ultraep_parallel_warps.restype = ctypes.c_int64
    lib.ultraep_parallel_warps.argtypes = [ctypes.c_int64] * 3
    handlers = {PLAN_TARGET: "UltraepPlan", PLAN_PARALLEL_TARGET: "UltraepPlanParallel"}
    for target, handler in handlers.items():
        fn = getattr(lib, handler + "Cpu")
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(fn), platform="cpu")
    cuda_path = library_path(_CUDA_LIB)
    if cuda_path is not None:
        # Loading needs no GPU (the CUDA runtime is linked statically and finds the driver lazily).
        cuda = ctypes.cdll.LoadLibrary(str(cuda_path))
        for target, handler in handlers.items():
            fn = getattr(cuda, handler + "Cuda")
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(fn), platform="CUDA")
    return lib


def has_cuda_handler() -> bool:
    """Whether the CUDA planner handler was built into this install."""
    return library_path(_CUDA_LIB) is not None


def workspace_elems(
    ep_size: int, num_experts: int, slots_per_rank: int, parallel: bool = False
) -> int:
    """int64 workspace elements one plan needs (the C++ code's own formula), for the sequential
    core or, with ``parallel``, for the parallel form (the same on CPU and CUDA)."""
    lib = cpu_library()
    fn = lib.ultraep_parallel_workspace_elems if parallel else lib.ultraep_workspace_elems
    return int(fn(ep_size, num_experts, slots_per_rank))


def parallel_warps(ep_size: int, num_experts: int, slots_per_rank: int) -> int:
    """Warps the parallel form runs per plan (probes at once); 0 where it runs the sequential
    core instead (warp state too large for a block's shared memory)."""
    return int(cpu_library().ultraep_parallel_warps(ep_size, num_experts, slots_per_rank))
