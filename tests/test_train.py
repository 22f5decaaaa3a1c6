"""The training run: loss goes down, balancing leaves the math unchanged, resume reproduces an
uninterrupted run, bad flags end in one line, and 2 processes x 4 devices match 1 x 8."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from experiments import trainer
from experiments.train_config import TrainConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Small enough for CPU tests; the corpus is the default one (the stdlib), capped.
SMALL = dict(
    batch_size=8,
    seq_len=32,
    d_model=32,
    num_layers=1,
    num_heads=2,
    d_ff=32,
    num_experts=8,
    top_k=2,
    slots_per_rank=2,
    min_tokens_per_replica=2,
    max_corpus_bytes=200_000,
    eval_batches=1,
    learning_rate=1e-2,
    print_every=100,
)
SMALL_FLAGS = [f"--{k}={v}" for k, v in SMALL.items()]


def _records(workdir) -> list[dict]:
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _run(tmp_path, name, **overrides) -> list[dict]:
    cfg = TrainConfig(workdir=str(tmp_path / name), **{**SMALL, **overrides})
    trainer.run(cfg)
    return _records(cfg.workdir)


def test_loss_decreases_and_outputs_are_written(tmp_path):
    records = _run(tmp_path, "run", steps=12, eval_every=6, checkpoint_every=6)
    assert [r["step"] for r in records] == list(range(1, 13))
    losses = [r["loss"] for r in records]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5
    last = records[-1]
    assert {"loss", "eval_loss", "imbalance_before", "imbalance_after"} <= set(last)
    assert len(last["imbalance_before"]) == SMALL["num_layers"]
    png = (tmp_path / "run" / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    for r in records:  # balancing keeps its promise wherever there was something to balance
        for before, after in zip(r["imbalance_before"], r["imbalance_after"]):
            assert after <= before + 1e-6


def test_balancing_does_not_change_the_loss(tmp_path):
    plain = _run(tmp_path, "none", balance="none", steps=4)
    balanced = _run(tmp_path, "ultraep", balance="ultraep", steps=4)
    assert sum(sum(r["replicas"]) for r in balanced) > 0  # replicas really were used
    assert all(sum(r["dropped"]) == 0 for r in plain + balanced)
    np.testing.assert_allclose([r["loss"] for r in balanced], [r["loss"] for r in plain], rtol=1e-5)


def test_resume_continues_the_same_trajectory(tmp_path):
    whole = _run(tmp_path, "whole", steps=6, checkpoint_every=3)
    _run(tmp_path, "split", steps=3, checkpoint_every=3)  # "interrupted" after step 3
    resumed = _run(tmp_path, "split", steps=6, checkpoint_every=3)
    assert [r["step"] for r in resumed] == list(range(1, 7))
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in whole], rtol=1e-5)


def _python(args, env_extra=None, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(env_extra or {})
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.train", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--balance=fancy", "unknown --balance"),
        ("--num_experts=12", "not divisible"),
        ("--data=/nonexistent/corpus", "/nonexistent/corpus"),
        ("--capacity_factor=lots", "--capacity_factor"),
    ],
)
def test_bad_flags_end_with_one_line(tmp_path, flag, message):
    proc = _python([f"--workdir={tmp_path}", flag])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    steps = ["--steps=3", "--checkpoint_every=3", "--eval_every=3", *SMALL_FLAGS]
    single = _python([f"--workdir={tmp_path / 'one'}", *steps])
    out, err = single.communicate(timeout=600)
    assert single.returncode == 0, err[-3000:]
    address = f"127.0.0.1:{_free_port()}"
    procs = [
        _python(
            [
                f"--workdir={tmp_path / 'two'}",
                *steps,
                "--num_processes=2",
                f"--process_id={i}",
                "--cpu_devices=4",
                f"--coordinator_address={address}",
            ]
        )
        for i in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    one, two = _records(tmp_path / "one"), _records(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-5)
    assert two[-1]["eval_loss"] == pytest.approx(one[-1]["eval_loss"], rel=1e-5)
