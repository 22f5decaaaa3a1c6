"""The GPU runbook, `experiments/gpu/run_all.sh`, without a GPU: `--check` checks every command it
would run (each program imports and its flags parse, pytest collects, the setup's queries of the
install run), so that a move inside the library or a renamed flag cannot break it silently; a
failed part makes the script exit 1 after the later parts have run."""

import os
import pathlib
import subprocess
import sys

import pytest

from experiments.gpu.command_check import split_command

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUN_ALL = ROOT / "experiments" / "gpu" / "run_all.sh"
PARTS = ("setup", "tests", "gpu_check", "exchange", "replay_train", "replay_prefill", "gmm")


def run_all(out: pathlib.Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "OUT"} | {"PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(RUN_ALL), "--check", f"--out={out}", *args],
        env=environment | env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_split_command():
    argv = ["env", "JAX_PLATFORMS=cuda,cpu", "python3", "-m", "pytest", "-q", "a.py"]
    assert split_command(argv) == ({"JAX_PLATFORMS": "cuda,cpu"}, "pytest", ["-q", "a.py"])
    argv = ["python3", "-m", "experiments.replay", "--mode=train"]
    assert split_command(argv) == ({}, "experiments.replay", ["--mode=train"])
    with pytest.raises(ValueError, match="expected"):
        split_command(["python3", "script.py"])


@pytest.mark.slow
@pytest.mark.parametrize("dry", [False, True], ids=["gpu_commands", "dry_run_commands"])
def test_every_command_of_the_runbook_starts(dry, tmp_path):
    result = run_all(tmp_path, *(["--dry_run"] if dry else []))
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    for part in PARTS[1:] + ("summary",):
        assert f"== {part}: exit 0" in log, part
    # The setup asks the install (ultraep_jax.tools) whether the native libraries are there: a
    # dry run then skips the reinstall; otherwise pip's command is checked, not run.
    setup = "== setup: installed already" if dry else "== setup: exit 0"
    assert setup in log
    assert "cuda_planner_handler: unknown" not in log  # the install's query answers
    assert "imports, flags parse" in log


@pytest.mark.slow
def test_a_failed_part_fails_the_run_after_the_later_parts(tmp_path):
    result = run_all(tmp_path, "--parts=replay_train,gmm", REPLAY_EP="x")
    log = result.stdout + result.stderr
    assert result.returncode == 1, log[-4000:]
    assert "== replay_train: exit 1" in log
    assert "== gmm: exit 0" in log
    assert "== failed: replay_train" in log
