"""`--one-case-each` (tests/conftest.py), the option of CI's second JAX line: of each parametrized
test it keeps the first case that ``-m`` leaves, and every case of a test marked ``every_case``."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

CASES = """
import pytest

@pytest.mark.parametrize("n", [pytest.param(0, marks=pytest.mark.slow), 1, 2])
def test_first_left_by_m(n):
    pass

@pytest.mark.parametrize("a", ["x", "y"])
@pytest.mark.parametrize("b", [1, 2])
def test_product(a, b):
    pass

@pytest.mark.every_case
@pytest.mark.parametrize("n", [1, 2])
def test_all_kept(n):
    pass

class TestInClass:
    @pytest.mark.parametrize("n", [1, 2])
    def test_product(self, n):
        pass

def test_plain():
    pass
"""


def test_keeps_the_first_case_left_by_m_and_every_case_of_every_case_tests(tmp_path):
    (tmp_path / "test_cases.py").write_text(CASES)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-W",
            "ignore::pytest.PytestUnknownMarkWarning",
            "--collect-only",
            "-q",
            "--one-case-each",
            "-m",
            "not slow",
            "test_cases.py",
        ],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )
    kept = [line for line in run.stdout.splitlines() if "::" in line]
    assert kept == [
        "test_cases.py::test_first_left_by_m[1]",
        "test_cases.py::test_product[1-x]",
        "test_cases.py::test_all_kept[1]",
        "test_cases.py::test_all_kept[2]",
        "test_cases.py::TestInClass::test_product[1]",
        "test_cases.py::test_plain",
    ], run.stdout + run.stderr
    assert "6/12 tests collected (6 deselected)" in run.stdout, run.stdout
