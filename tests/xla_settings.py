"""The XLA flags of the test processes and of the program runs they start. No JAX import here:
tests/conftest.py sets XLA_FLAGS from this before JAX is imported anywhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys

#: XLA:CPU's quick-compile settings (LLVM at -O0, no fusion emitters where the running XLA still
#: has the switch: jaxlib 0.12 removed it). The tests run small shapes, so compiling is most of
#: their time, and these settings compile the layer's step about 2.5x faster on jax 0.10 (1.4x on
#: 0.12); what a program computes does not depend on them. XLA aborts the process on a flag it does
#: not know, so only the flags the running XLA accepts are passed (`accepted_xla_flags`). The
#: program runs the tests start get them too (`program_env`). ULTRAEP_TEST_XLA_DEFAULTS=1 runs the
#: tests with XLA's defaults.
FAST_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_llvm_disable_expensive_passes=true",
)
#: The accepted subset of `FAST_COMPILE_FLAGS`, found once per test session (in the process that
#: starts the test processes, which inherit it).
ACCEPTED_FLAGS_ENV = "ULTRAEP_TEST_FAST_XLA_FLAGS"


def accepted_xla_flags(flags) -> list[str]:
    """The ``flags`` this process's XLA accepts: a child process starts XLA with them and reports
    the first unknown one (XLA names it, then aborts), which is dropped, until one starts."""
    flags = list(flags)
    probe = "import jax; jax.devices()"
    while flags:
        env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
        run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
        if run.returncode == 0:
            return flags
        unknown = re.search(r"Unknown flags? in XLA_FLAGS: (\S+)", run.stderr)
        if unknown is None or unknown.group(1) not in flags:
            raise RuntimeError(f"XLA did not start with {flags}: {run.stderr.strip()[-300:]}")
        flags.remove(unknown.group(1))
    return flags


def fast_compile_flags() -> str:
    """The quick-compile flags for this session ("" under ULTRAEP_TEST_XLA_DEFAULTS=1)."""
    if os.environ.get("ULTRAEP_TEST_XLA_DEFAULTS", "") not in ("", "0"):
        return ""
    if ACCEPTED_FLAGS_ENV not in os.environ:
        os.environ[ACCEPTED_FLAGS_ENV] = " ".join(accepted_xla_flags(FAST_COMPILE_FLAGS))
    return os.environ[ACCEPTED_FLAGS_ENV]


def program_env(**overrides) -> dict[str, str]:
    """The environment of a program run a test starts (``python -m experiments...``): this one's,
    with the quick-compile flags as its XLA flags and without the test processes' device count
    and platform (the program asks for its own devices), then ``overrides``."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    if fast_compile_flags():
        env["XLA_FLAGS"] = fast_compile_flags()
    env.update(overrides)
    return env
