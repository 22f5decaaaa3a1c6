"""``--suite`` (tests/conftest.py): ``quick``, README.md's test command, keeps the tests not marked
slow (or marked gpu_compile), of each parametrized one the first case left, and every case of a
test marked ``every_case``; ``rest`` keeps exactly what ``quick`` leaves out."""

import pathlib

from tests.child_pytest import run_pytest

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

@pytest.mark.slow
def test_slow():
    pass

@pytest.mark.slow
@pytest.mark.gpu_compile
@pytest.mark.parametrize("n", [1, 2])
def test_gpu_compile(n):
    pass
"""

QUICK = [
    "test_cases.py::test_first_left_by_m[1]",
    "test_cases.py::test_product[1-x]",
    "test_cases.py::test_all_kept[1]",
    "test_cases.py::test_all_kept[2]",
    "test_cases.py::TestInClass::test_product[1]",
    "test_cases.py::test_plain",
    "test_cases.py::test_gpu_compile[1]",
]
REST = [
    "test_cases.py::test_first_left_by_m[0]",
    "test_cases.py::test_first_left_by_m[2]",
    "test_cases.py::test_product[1-y]",
    "test_cases.py::test_product[2-x]",
    "test_cases.py::test_product[2-y]",
    "test_cases.py::TestInClass::test_product[2]",
    "test_cases.py::test_slow",
    "test_cases.py::test_gpu_compile[2]",
]


def _collected(folder: pathlib.Path, *args: str) -> tuple[list[str], str]:
    """The test ids pytest collects in ``folder`` with this suite's conftest and ``args``."""
    run = run_pytest(
        folder,
        *["-p", "no:xdist", "-W", "ignore::pytest.PytestUnknownMarkWarning"],
        *["--collect-only", "-q", *args, "test_cases.py"],
    )
    return [line for line in run.stdout.splitlines() if "::" in line], run.stdout + run.stderr


def test_quick_and_rest_split_the_suite(tmp_path):
    (tmp_path / "test_cases.py").write_text(CASES)
    quick, out = _collected(tmp_path, "--suite=quick")
    assert quick == QUICK, out
    assert "7/15 tests collected (8 deselected)" in out, out
    rest, out = _collected(tmp_path, "--suite=rest")
    assert rest == REST, out
    assert "8/15 tests collected (7 deselected)" in out, out
    # -k and -m apply first: the first case they leave is quick's.
    quick, out = _collected(tmp_path, "--suite=quick", "-k", "not x")
    assert quick == [q.replace("[1-x]", "[1-y]") for q in QUICK], out
    everything, out = _collected(tmp_path)
    assert sorted(everything) == sorted(QUICK + REST), out
