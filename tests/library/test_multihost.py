"""`uep.routed_experts` under `jax.distributed`: two processes, each holding half of the global
arrays, called eagerly and from `jit` with the ids closed over (`multihost_worker.py`)."""

import os
import pathlib
import socket
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two processes start, import and compile
def test_eager_calls_on_arrays_spanning_two_processes():
    """The concrete-id check used to fetch the whole global array, which fails for one that spans
    another process's devices; each process now checks the ids it holds."""
    address = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), address, str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        assert f"process {i}: ok" in out
