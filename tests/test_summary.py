"""The run's closing summary (tests/conftest.py): its slowest test files, each with the seconds
its tests spent in JAX's tracing, lowering and XLA compiling, counted in the test processes and
summed in the one that prints it."""

import re

from tests.child_pytest import run_pytest

FILES = {
    # A program of some hundred operations: its stages take tenths of a second, which the
    # summary's one decimal shows.
    "test_jit.py": (
        "import jax, jax.numpy as jnp\n"
        "def chain(x):\n"
        "    for i in range(100):\n"
        "        x = jnp.tanh(x @ x) + i\n"
        "    return x\n"
        "def test_compiles():\n"
        "    assert jax.jit(chain)(jnp.ones((8, 8))).shape == (8, 8)\n"
    ),
    "test_plain.py": "def test_nothing_compiled():\n    pass\n",
}


def test_slowest_files_split_jax_compile_stages(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    # One test process: its counts reach the process that prints the summary.
    run = run_pytest(tmp_path, "-n", "1", "-q", *FILES)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    stages = r"JAX traced (\d+\.\d) s, lowered (\d+\.\d), compiled (\d+\.\d)"
    header = re.search(r"slowest test files \(of \d+ s in test processes; " + stages, out)
    jit = re.search(r"\d+\.\d s  test_jit\.py  \(" + stages + r"\)", out)
    assert header and jit, out
    assert float(jit.group(3)) > 0, out  # XLA compiled the jitted function
    assert jit.groups() == header.groups(), out  # the only file that compiled
    plain = [line for line in out.splitlines() if "test_plain.py" in line and " s  " in line]
    assert len(plain) == 1 and "JAX" not in plain[0], out
