"""usage: python -m experiments.gpu.command_check [env K=V ...] PYTHON -m MODULE [ARG ...]

Checks one command of the GPU runbook (`run_all.sh --check`) without running it and without a GPU:
a program (``-m experiments...``) is imported and its arguments parsed against its absl flags
(an unknown flag or a bad value fails), `pytest` collects its tests, `pip` is not run. Leading
``env K=V`` assignments are applied, but for ``JAX_PLATFORMS``, which is cpu here. Exits 0 when
the command would start, 1 (with the error) when it would not.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys


def split_command(argv: list[str]) -> tuple[dict[str, str], str, list[str]]:
    """(environment assignments, module, its arguments) of ``[env K=V ...] PYTHON -m MODULE
    ARG...``; raises ValueError for any other shape."""
    env = {}
    rest = list(argv)
    if rest and rest[0] == "env":
        rest.pop(0)
        while rest and "=" in rest[0] and not rest[0].startswith("-"):
            key, _, value = rest.pop(0).partition("=")
            env[key] = value
    if len(rest) < 3 or rest[1] != "-m":
        raise ValueError(f"command_check: expected [env K=V ...] PYTHON -m MODULE ..., got {argv}")
    return env, rest[2], rest[3:]


def program_module(module: str):
    """The module that defines ``python -m module``'s flags: the package's ``__main__`` (whose
    ``main`` runs only as a script) or the module itself."""
    imported = importlib.import_module(module)
    if hasattr(imported, "__path__"):
        return importlib.import_module(f"{module}.__main__")
    return imported


def check_program(module: str, args: list[str]) -> None:
    """Imports ``module`` and parses ``args`` against its flags (raises on a bad one)."""
    from absl import flags

    program_module(module)
    flags.FLAGS([module, *args])


def main(argv: list[str]) -> int:
    env, module, args = split_command(argv)
    os.environ.update(env)
    os.environ["JAX_PLATFORMS"] = "cpu"
    if module == "pip":
        print(f"command_check: {module} not run")
        return 0
    if module == "pytest":
        # In this process: collecting needs none of the parallel test processes (pytest-xdist).
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *args]
        return subprocess.run(cmd, check=False).returncode
    try:
        check_program(module, args)
    except Exception as e:  # noqa: BLE001 - any failure to start is the answer
        print(f"command_check: {module}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"command_check: {module}: imports, flags parse")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
