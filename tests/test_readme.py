"""Every ```python block of README.md runs as written (in a fresh interpreter, as a user would
paste it)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path):
    script = tmp_path / f"block{index}.py"
    script.write_text(BLOCKS[index])
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=README.parent,
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
