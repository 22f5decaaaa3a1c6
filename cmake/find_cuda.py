"""What CMakeLists.txt asks Python about CUDA when it decides whether to build the CUDA handler.

    python find_cuda.py jax    the CUDA major version of the installed JAX CUDA plugin
                               (jax-cuda12-plugin, jax-cuda13-plugin: "13"), or nothing
    python find_cuda.py nvcc   nvcc of an nvidia-cuda-nvcc wheel this Python can import
                               (13.x ships nvcc; jax[cuda13] installs it), or nothing

Run with ``python -I``, these see the packages of the environment pip installs into: pip runs the
build backend with that environment's Python, isolated from its packages only through PYTHONPATH,
which -I ignores. Without -I they see the packages of the build environment (pyproject.toml adds
the nvcc wheel there when ULTRAEP_BUILD_CUDA=ON).
"""

import importlib.metadata
import importlib.util
import pathlib
import re
import sys


def jax_cuda_major() -> str:
    """The CUDA major version of the newest JAX CUDA plugin installed, or ""."""
    majors = []
    for dist in importlib.metadata.distributions():
        name = re.sub(r"[-_.]+", "-", (dist.metadata["Name"] or "").lower())
        if match := re.fullmatch(r"jax-cuda(\d+)-plugin", name):
            majors.append(int(match[1]))
    return str(max(majors)) if majors else ""


def wheel_nvcc() -> str:
    """nvcc of the nvidia-cuda-nvcc wheel (nvidia/cu<major>/bin/nvcc), the newest, or ""."""
    spec = importlib.util.find_spec("nvidia")
    folders = spec.submodule_search_locations if spec else None
    found = [
        path
        for folder in folders or []
        for path in pathlib.Path(folder).glob("cu[0-9]*/bin/nvcc")
        if path.is_file()
    ]
    found.sort(key=lambda path: int(path.parent.parent.name[2:]))
    return str(found[-1]) if found else ""


if __name__ == "__main__":
    print({"jax": jax_cuda_major, "nvcc": wheel_nvcc}[sys.argv[1]](), end="")
