"""Pytest run in a child process on a folder of synthetic test files, with this suite's conftest
(tests/conftest.py), for the tests of the suite's own options and summary."""

import os
import pathlib
import subprocess
import sys

from tests.xla_settings import ACCEPTED_FLAGS_ENV

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_pytest(folder: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m pytest -p tests.conftest -p no:cacheprovider *args`` in ``folder``, the
    checkout importable, with the parent's accepted XLA flags (the child does not probe XLA
    again); stdout and stderr captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", *args],
        cwd=folder,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
        | {k: os.environ[k] for k in (ACCEPTED_FLAGS_ENV,) if k in os.environ},
        capture_output=True,
        text=True,
        check=False,
    )
