"""The training run: loss goes down, balancing leaves the math unchanged, resume reproduces an
uninterrupted run, bad flags and unusable inputs end in one line, the saved configuration guards
resuming, Ctrl-C saves everything, summary.json is written, and 2 processes x 4 devices match
1 x 8."""

import dataclasses
import functools
import json
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags

import ultraep_jax as uep
from experiments.lab import dataclass_flags
from experiments.lab.training import build
from experiments.lab.training.config import (
    BALANCED_CAPACITY_FACTOR,
    TrainConfig,
    default_workdir,
    one_ep_rank_note,
    parse_capacity_factor,
)
from experiments.lab.training.workdir import files_written, workdir_contents
from experiments.train import plot, stop, trainer
from experiments.train.step_profile import StepProfile
from models.moe_lm import ModelConfig
from models.presets import PRESETS
from tests.experiments.program_runs import run_each
from tests.xla_settings import program_env

# End-to-end runs of the programs (seconds to minutes each): `-m "not slow"` skips them.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Small enough for CPU tests; the corpus is the default one (the stdlib), capped.
SMALL = {
    "batch_size": 8,
    "seq_len": 32,
    "d_model": 32,
    "num_layers": 1,
    "num_heads": 2,
    "d_ff": 32,
    "num_experts": 8,
    "top_k": 2,
    "slots_per_rank": 2,
    "min_tokens_per_replica": 2,
    "min_tokens_per_rank": 0,  # 32 tokens per rank: balance anyway (no fallback)
    "max_corpus_bytes": 200_000,
    "eval_batches": 1,
    "learning_rate": 1e-2,
    "print_every": 100,
}
SMALL_FLAGS = [f"--{k}={v}" for k, v in SMALL.items()]


def _records(workdir) -> list[dict]:
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _config(workdir, **overrides) -> TrainConfig:
    return TrainConfig.from_flat({"workdir": str(workdir), **SMALL, **overrides})


#: The runs whose tests read no evaluation leave it out: the evaluation step is a program of its
#: own to compile for each model and balancing mode (a third of the training step's compiling).
NO_EVAL = {"eval_batches": 0}


def _run(tmp_path, name, **overrides) -> list[dict]:
    cfg = _config(tmp_path / name, **overrides)
    trainer.run(cfg)
    return _records(cfg.workdir)


def _summary(workdir) -> dict:
    return json.loads((pathlib.Path(workdir) / "summary.json").read_text())


def _checkpoint_steps(workdir) -> list[int]:
    folder = pathlib.Path(workdir) / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


#: The tests of `default_run` run in one test process, which trains it once (pytest-xdist).
DEFAULT_RUN_GROUP = pytest.mark.xdist_group("test_train_default_run")


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> pathlib.Path:
    """The workdir of a 12-step balanced run of `SMALL` evaluating every 3 steps and saving every
    6, in this process (8 devices), trained once for the tests that read it: its outputs
    (`test_loss_decreases_and_outputs_are_written`), and its first steps as the uninterrupted
    run that a resumed run (`test_resume_continues_the_same_trajectory`) and a run of 2
    processes (`test_two_processes_match_one`) must reproduce (a step's loss does not depend on
    the steps after it, the evaluations or the checkpoints)."""
    workdir = (tmp_path_factory.mktemp("default") / "run").absolute()
    trainer.run(_config(workdir, steps=12, eval_every=3, checkpoint_every=6, profile_loads=True))
    return workdir


@DEFAULT_RUN_GROUP
def test_loss_decreases_and_outputs_are_written(default_run):
    workdir = default_run
    records = _records(workdir)
    assert [r["step"] for r in records] == list(range(1, 13))
    losses = [r["loss"] for r in records]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5
    last = records[-1]
    assert {"loss", "eval_loss", "imbalance_before", "imbalance_after"} <= set(last)
    assert len(last["imbalance_before"]) == SMALL["num_layers"]
    png = (workdir / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # --profile_loads: each step's loads, every (token, choice) pair counted once per view
    loads = [json.loads(line) for line in (workdir / "loads.jsonl").read_text().splitlines()]
    assert [r["step"] for r in loads] == list(range(1, 13))
    pairs = SMALL["batch_size"] * SMALL["seq_len"] * SMALL["top_k"]
    for r in loads:
        (layer,) = r["layers"]
        assert sum(layer["expert_load"]) == sum(layer["rank_load_before"]) == pairs
        assert sum(layer["rank_load_after"]) == pairs  # dropped pairs included
    for r in records:  # balancing keeps its promise wherever there was something to balance
        for before, after in zip(r["imbalance_before"], r["imbalance_after"], strict=True):
            assert after <= before + 1e-6
    summary = _summary(workdir)
    assert summary["step"] == 12 and summary["finished"] and summary["stopped_by"] is None
    assert summary["final_loss"] == last["loss"]
    assert summary["final_eval_loss"] == last["eval_loss"] and summary["final_eval_step"] == 12
    before = np.array([r["imbalance_before"] for r in records])
    after = np.array([r["imbalance_after"] for r in records])
    np.testing.assert_allclose(summary["imbalance_before"]["mean"], before.mean(0), atol=1e-5)
    np.testing.assert_allclose(summary["imbalance_before"]["max"], before.max(0), atol=1e-5)
    np.testing.assert_allclose(summary["imbalance_after"]["mean"], after.mean(0), atol=1e-5)
    np.testing.assert_allclose(summary["imbalance_after"]["max"], after.max(0), atol=1e-5)
    assert summary["dropped_pairs"] == sum(sum(r["dropped"]) for r in records)
    replicas = np.mean([sum(r["replicas"]) for r in records])
    assert summary["mean_replicas"] == pytest.approx(replicas, abs=1e-3) and replicas > 0
    # The first step's time includes compiling it: the medians leave it out.
    assert [r.get("compiling", False) for r in records] == [True] + [False] * 11
    assert summary["timed_steps"] == 11
    assert summary["median_step_time_s"] == pytest.approx(
        np.median([r["step_time"] for r in records[1:]]), abs=1e-5
    )
    assert summary["median_tokens_per_s"] == pytest.approx(
        np.median([r["tokens_per_s"] for r in records[1:]]), abs=0.1
    )
    assert summary["config"]["num_experts"] == SMALL["num_experts"]
    config = json.loads((workdir / "config.json").read_text())
    assert config == summary["config"] and config["capacity_factor"] == BALANCED_CAPACITY_FACTOR


#: The execution flags, none at its default (`test_the_execution_flags_reach_every_layer`: each
#: reaches the layers; the layer tests: the same math whatever they are).
EXECUTION_CHOICES = {"planner": "portable", "max_fanout": 1, "transfer_chunks": 2}
EXECUTION_CHOICES["ranks_per_domain"] = 2


@DEFAULT_RUN_GROUP
def test_balancing_does_not_change_the_loss(tmp_path, default_run):
    """The plain run's losses are the balanced run's (`default_run`'s first 4 steps: a step's
    loss does not depend on the evaluations or checkpoints after it)."""
    # Defaults: dropless worst-case buffers without balancing, 1.05 x the mean with it.
    plain = _run(tmp_path, "none", balance="none", steps=4, **NO_EVAL)
    balanced = _records(default_run)[:4]
    assert _summary(tmp_path / "none")["config"]["capacity_factor"] is None
    assert _summary(default_run)["config"]["capacity_factor"] == 1.05
    assert sum(sum(r["replicas"]) for r in balanced) > 0  # replicas really were used
    assert all(sum(r["dropped"]) == 0 for r in plain + balanced)
    np.testing.assert_allclose([r["loss"] for r in balanced], [r["loss"] for r in plain], rtol=1e-5)
    # --eval_batches=0: no evaluation, not even after the last step.
    assert not [r for r in plain if "eval_loss" in r]
    assert _summary(tmp_path / "none")["final_eval_loss"] is None


def test_tensor_size_2_splits_the_mixtral_presets_experts_over_f():
    """--tensor_size=2 with the mixtral preset: a (data 1, expert 4, tensor 2) mesh whose every
    layer splits each expert's hidden width F over "tensor" (the layers' values and gradients
    then equal the dense reference's: tests/library/test_expert_tensor.py), whole experts
    without it."""
    small = {k: SMALL[k] for k in ("batch_size", "seq_len", "max_corpus_bytes")}
    small.update(min_tokens_per_rank=0, capacity_factor=None, ep_size=4, steps=3, **NO_EVAL)
    model = dataclasses.replace(PRESETS["mixtral"].model, num_layers=1)
    for tensor in (1, 2):
        values = {"workdir": "w", "tensor_size": tensor, **small}
        cfg = TrainConfig.from_flat(values, model)
        assert cfg.check_devices(8) == (2 // tensor, 4, tensor)
        mesh = build.make_mesh(*cfg.check_devices(8))
        want = {"data": 2 // tensor, "expert": 4} | ({"tensor": 2} if tensor == 2 else {})
        assert dict(mesh.shape) == want
        settings = build.moe_settings(cfg, mesh)
        assert settings.tensor_axis == ("tensor" if tensor == 2 else None)
        (block,) = build.build_model(cfg, mesh).blocks
        assert block.moe.ep.tensor_axis == settings.tensor_axis
        w_gate = block.moe.w_gate[...]  # [E, D, F]
        spec = (*w_gate.sharding.spec, None, None, None)[: w_gate.ndim]
        assert spec == ("expert", None, settings.tensor_axis), spec


@pytest.mark.parametrize(
    "values, message",
    [
        ({"tensor_size": 3}, "--tensor_size=3 does not divide the 8 devices"),
        ({"tensor_size": 2, "d_ff": 33}, "--d_ff=33 is not divisible by --tensor_size=2"),
        (
            {"tensor_size": 2, "ep_size": 8},
            "--ep_size=8 does not divide the 4 devices that --tensor_size=2 leaves of 8 (the data "
            "x expert axes); use --ep_size=1, 2 or 4, or 0 for all 4",
        ),
        (
            {"ep_size": 3, "num_experts": 4},
            "--ep_size=3 does not divide the 8 devices (the data x expert axes); use --ep_size=1,"
            " 2 or 4",
        ),
        ({"tensor_size": 0}, "tensor_size must be a positive int"),
    ],
)
def test_bad_tensor_size_is_one_line(values, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        TrainConfig.from_flat({"workdir": "w", **values}).check_devices(8)
    assert "\n" not in str(err.value)


def test_one_ep_rank_with_balancing_is_one_line_or_a_note():
    """--tensor_size=8 on 8 devices left one EP rank: the run balanced nothing and said nothing.
    Now the flags check refuses it in one line; an explicit --ep_size=1 (one EP rank asked for)
    runs with a note; without balancing the same mesh needs neither."""
    message = (
        "--tensor_size=8 leaves 1 of the 8 devices to the data x expert axes: one EP rank, "
        "nothing for --balance=ultraep to balance; use a smaller --tensor_size, --balance=none, "
        "or --ep_size=1 to run so anyway"
    )
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        TrainConfig.from_flat({"workdir": "w", "tensor_size": 8}).check_devices(8)
    assert "\n" not in str(err.value)
    for values in ({"tensor_size": 8, "ep_size": 1}, {"ep_size": 1}):
        cfg = TrainConfig.from_flat({"workdir": "w", **values})
        assert cfg.check_devices(8)[1] == 1
        note = one_ep_rank_note(cfg, 1, 8)
        assert note.startswith("note: one EP rank of 8 devices: --balance=ultraep has nothing")
    plain = TrainConfig.from_flat({"workdir": "w", "balance": "none", "tensor_size": 8})
    assert plain.check_devices(8)[1] == 1 and one_ep_rank_note(plain, 1, 8) == ""
    balanced = TrainConfig.from_flat({"workdir": "w"})
    assert one_ep_rank_note(balanced, *balanced.check_devices(8)[1:2], 8) == ""
    assert one_ep_rank_note(balanced, 1, 1) == ""  # one device in all: nothing to say


def test_the_execution_flags_reach_every_layer():
    """--planner, --max_fanout, --transfer_chunks and --ranks_per_domain: flags of the run that
    reach each MoE layer through one `MoESettings` (the programs could not choose them)."""
    cfg = _config("w", **EXECUTION_CHOICES)
    mesh = build.make_mesh(*cfg.check_devices(8))
    settings = build.moe_settings(cfg, mesh)
    assert (settings.balancer.max_fanout, settings.balancer.ranks_per_domain) == (1, 2)
    assert (settings.execution.planner, settings.execution.transfer_chunks) == ("portable", 2)
    assert settings.capacity_factor == 1.05 and not settings.force_balanced
    (block,) = build.build_model(cfg, mesh).blocks
    assert block.moe.ep.balancer == settings.balancer
    assert block.moe.ep.execution.planner == "portable"
    ideal = build.moe_settings(_config("w", balance="ideal"), mesh)
    assert ideal.balancer is None and ideal.force_balanced and ideal.execution == uep.Execution()
    assert ideal.execution.planner == TrainConfig().planner == "auto"
    tensor = _config("w", tensor_size=2)
    assert build.moe_settings(tensor, build.make_mesh(*tensor.check_devices(8))).tensor_axis


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"planner": "fast"},
            "--planner must be one of ('auto', 'native', 'portable'), got 'fast'",
        ),
        ({"transfer_chunks": 0}, "--transfer_chunks must be a positive int, got 0"),
        ({"max_fanout": -1}, "--max_fanout must be an int >= 0, got -1"),
        ({"ranks_per_domain": -1}, "--ranks_per_domain must be >= 0 (0: one domain), got -1"),
        ({"ranks_per_domain": 3}, "--ranks_per_domain=3 does not divide the EP size 8"),
        ({"transfer_chunks": 33}, "--transfer_chunks=33 exceeds the 32 hidden columns"),
        ({"transfer_chunks": 17, "tensor_size": 2}, "exceeds the 16 hidden columns of an expert"),
    ],
)
def test_bad_execution_flags_are_one_line(values, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        _config("w", **values).check_devices(8)
    assert "\n" not in str(err.value)


def test_profile_steps_on_a_process_of_several_devices_is_one_line(tmp_path):
    """One process over 8 simulated devices traced the 8 devices' ops against one step's wall
    time: terms summing to ~4x the step, "outside ops -0.221 s". The run refuses before
    anything is written, saying why and what measures it; one device per process runs."""
    cfg = _config(tmp_path / "profiled", steps=5, profile_steps=2)
    with pytest.raises(ValueError) as info:
        trainer.run(cfg)
    text = str(info.value)
    assert text.startswith("--profile_steps=2 splits a process's step into terms, but a process ")
    assert "holding 8 devices adds their work up" in text and "--pinned_ranks=2" in text
    assert "--profile_steps=0" in text and "\n" not in text
    assert not (tmp_path / "profiled").exists()
    cfg.check_process(1)  # a pinned rank: one device
    _config(tmp_path / "w", steps=5).check_process(8)  # nothing profiled: any devices


def test_step_profile_traces_the_last_steps_and_writes_the_terms(tmp_path):
    """`StepProfile` on one device (what a pinned rank holds): the last 2 of 3 steps traced, the
    terms file written with the terms and what lies outside the ops making the profiled steps'
    mean wall time, the traces removed; none when the profiled steps include this start's
    compiling step."""

    @jax.jit
    def step(x):
        with jax.named_scope("experts"):
            y = jnp.tanh(x @ x)
        return jnp.sort(y, axis=0)

    x = jnp.full((64, 64), 0.01, jnp.float32)
    profile = StepProfile(tmp_path, steps=3, profile_steps=2, start=0)
    marks, walls = [], []
    for s in (1, 2, 3):
        marks.append(profile.starts(s))
        begin = time.perf_counter()
        jax.block_until_ready(step(x))
        walls.append(time.perf_counter() - begin)
        profile.ended(s, walls[-1])
    assert marks == [False, True, True]
    out = profile.finish(lambda: step.lower(x).compile().as_text())
    assert json.loads((tmp_path / "terms_rank0.json").read_text()) == out
    assert out["steps"] == 2 and out["rank"] == 0
    assert out["wall_s"] == pytest.approx(np.mean(walls[1:]))
    assert sum(out["terms_s"].values()) + out["outside_ops_s"] == pytest.approx(out["wall_s"])
    assert out["terms_s"]["experts"] > 0 and out["terms_s"]["rest"] > 0
    assert not (tmp_path / "profile").exists()
    resumed = StepProfile(tmp_path / "r", steps=3, profile_steps=2, start=1)
    assert [resumed.starts(s) for s in (2, 3)] == [False, False] and resumed.finish(str) is None


@pytest.mark.parametrize("profile_steps", [5, 4, -1])
def test_profile_steps_must_leave_the_compiling_step_untraced(profile_steps):
    """At most --steps - 2 (bench.step's range too): 4 of 5 steps left no timed step."""
    with pytest.raises(ValueError, match=re.escape(f"--profile_steps={profile_steps} must be in")):
        TrainConfig.from_flat({"workdir": "w", "steps": 5, "profile_steps": profile_steps})
    assert TrainConfig.from_flat({"workdir": "w", "steps": 5, "profile_steps": 3}).steps == 5


def test_the_summary_and_the_files_name_the_profiled_steps(tmp_path):
    """The summary's line left out "steps 1, 8, 9, 10, compiling" for a run whose last 3 steps
    were profiled; the closing list of files left out the terms files."""
    records = [
        {"step": s, "loss": 1.0, "step_time": 0.1, "tokens_per_s": 10.0 * s} for s in range(1, 11)
    ]
    records[0]["compiling"] = True
    for r in records[7:]:
        r["profiled"] = True
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = plot.summarize(tmp_path / "metrics.jsonl")
    want = "over 6 steps (left out: step 1, compiling; steps 8-10, profiled)"
    assert f"tokens/s: median 45.0 {want}" in out, out  # steps 2-7
    cfg = _config(tmp_path, steps=10, profile_steps=3)
    for name in ("config.json", "summary.json", "terms_rank1.json"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "checkpoints").mkdir()
    lines = files_written(cfg, tmp_path, 10).splitlines()
    assert [line.split()[0] for line in lines[1:]] == [
        "config.json",
        "metrics.jsonl",
        "summary.json",
        "terms_rank<p>.json",
        "checkpoints/",
    ]
    assert "profiled steps split into terms (--profile_steps)" in lines[4]
    assert "terms_rank<p>.json at the end" in workdir_contents(cfg)


@DEFAULT_RUN_GROUP
def test_resume_continues_the_same_trajectory(tmp_path, capsys, default_run):
    whole = _records(default_run)[:6]  # the uninterrupted run's steps 1-6
    capsys.readouterr()
    _run(tmp_path, "split", steps=3, checkpoint_every=3)  # "interrupted" after step 3
    out = capsys.readouterr().out
    workdir = (tmp_path / "split").absolute()
    assert out.splitlines()[0].startswith(f"workdir {workdir}: config.json")
    assert f"files in {workdir}:" in out and "summary.json" in out.split("files in")[-1]
    # docs/training.md's sample of the default run shows every kind of line a run prints, and
    # only those (a smaller model and fewer steps here: the same kinds of lines).
    assert _line_kinds(_doc_sample()) == _line_kinds(out)
    resumed = _run(tmp_path, "split", steps=6, checkpoint_every=3)
    assert [r["step"] for r in resumed] == list(range(1, 7))
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in whole], rtol=1e-5)
    # Each start's first step (1, and 4 after the resume) compiles: the summary times the others.
    assert [r["step"] for r in resumed if r.get("compiling")] == [1, 4]
    timed = [r for r in resumed if r["step"] in (2, 3, 5, 6)]
    summary = _summary(tmp_path / "split")
    assert summary["timed_steps"] == 4
    median_s = np.median([r["step_time"] for r in timed])
    assert summary["median_step_time_s"] == pytest.approx(median_s, abs=1e-5)
    median_tps = np.median([r["tokens_per_s"] for r in timed])
    out = capsys.readouterr().out
    line = f"tokens/s: median {median_tps:.1f} over 4 steps (left out: steps 1, 4, compiling)"
    assert line in out
    assert f"step time: median {1e3 * median_s:.2f} ms" in out


def test_plain_ep_at_an_explicit_capacity_factor_drops_pairs(tmp_path):
    records = _run(tmp_path, "cf", balance="none", capacity_factor=1.0, steps=2, **NO_EVAL)
    dropped = sum(sum(r["dropped"]) for r in records)
    assert dropped > 0  # routing is imbalanced, so a buffer of exactly the mean overflows
    summary = _summary(tmp_path / "cf")
    assert summary["dropped_pairs"] == dropped and summary["config"]["capacity_factor"] == 1.0


def test_capacity_factor_auto_none_and_numbers():
    assert TrainConfig(workdir="w").capacity_factor == BALANCED_CAPACITY_FACTOR == 1.05
    assert TrainConfig(workdir="w").slots_per_rank == 2
    assert TrainConfig(workdir="w", balance="none").capacity_factor is None
    assert TrainConfig(workdir="w", balance="none", capacity_factor="auto").capacity_factor is None
    assert TrainConfig(workdir="w", balance="none", capacity_factor=2).capacity_factor == 2.0
    assert TrainConfig(workdir="w", capacity_factor=None).capacity_factor is None
    assert parse_capacity_factor(" Auto ") == "auto"
    assert parse_capacity_factor("none") is None
    assert parse_capacity_factor("1.5") == 1.5
    with pytest.raises(ValueError, match="--capacity_factor"):
        parse_capacity_factor("lots")
    for bad in (0, -1.0, float("nan"), float("inf"), True, "lots"):
        with pytest.raises(ValueError, match="--capacity_factor"):
            TrainConfig(workdir="w", capacity_factor=bad)


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("learning_rate", float("nan"), "--learning_rate must be finite, got nan"),
        ("learning_rate", float("inf"), "--learning_rate must be finite, got inf"),
        ("learning_rate", 0.0, "--learning_rate must be > 0, got 0.0"),
        ("learning_rate", "fast", "--learning_rate must be a number, got 'fast'"),
        ("balance_eps", -1.0, "--balance_eps must be >= 0, got -1.0"),
        ("balance_eps", float("nan"), "--balance_eps must be finite, got nan"),
        ("eval_fraction", float("nan"), "--eval_fraction must be in (0, 1), got nan"),
        ("capacity_factor", float("nan"), "--capacity_factor must be a finite number > 0"),
    ],
)
def test_float_fields_are_finite_and_errors_name_their_flag(name, value, message):
    """--learning_rate=nan trained to a nan loss; --balance_eps=-1 said "--learning_rate must be
    > 0 and --balance_eps >= 0" without saying which was wrong."""
    with pytest.raises(ValueError) as info:
        TrainConfig(workdir="w", **{name: value})
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text, text
    others = ("--learning_rate", "--balance_eps", "--eval_fraction", "--capacity_factor")
    assert [flag for flag in others if flag in text] == [f"--{name}"], text


def test_saved_config_blocks_only_state_changes():
    saved = TrainConfig(workdir="a").to_json()
    same_state = TrainConfig(
        workdir="b", steps=7, print_every=3, eval_every=2, checkpoint_every=1, learning_rate=1e-3
    )
    blocking, changed = same_state.compare_saved(saved)
    assert blocking == [] and changed == ["--learning_rate=0.003 -> 0.001"]
    other = TrainConfig(workdir="a", model=ModelConfig(d_model=32, num_heads=2))
    blocking, _ = other.compare_saved(saved)
    assert blocking == ["--d_model=64 (given: 32)", "--num_heads=4 (given: 2)"]
    # The sequence length is the data's: with the same learned positions it may change.
    shorter = TrainConfig(workdir="a", seq_len=64)
    assert shorter.compare_saved(saved) == ([], ["--seq_len=128 -> 64"])


def test_config_json_is_flat_and_reads_back():
    model = ModelConfig(d_model=32, max_seq_len=64)
    cfg = TrainConfig(workdir="w", balance="none", seq_len=64, model=model)
    saved = cfg.to_json()
    model_names = [f.name for f in dataclasses.fields(ModelConfig)]
    own_names = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "model"]
    assert sorted(saved) == sorted(model_names + own_names)
    assert saved["d_model"] == 32 and saved["max_seq_len"] == 64 and saved["num_layers"] == 2
    assert saved["capacity_factor"] is None and saved["workdir"] == "w"
    assert TrainConfig.from_flat(json.loads(json.dumps(saved))) == cfg
    with pytest.raises(ValueError, match="unknown configuration field.*d_modle"):
        TrainConfig.from_flat({"d_modle": 32})


def test_config_json_from_before_max_seq_len_was_a_flag():
    # Such a file has no vocab_size and max_seq_len: its model's positions covered seq_len.
    old = {**TrainConfig(workdir="a").to_json(), "seq_len": 32}
    del old["vocab_size"], old["max_seq_len"]
    blocking, _ = TrainConfig(workdir="a", seq_len=32).compare_saved(old)
    assert blocking == ["--max_seq_len=32 (given: 128)"]
    fits = TrainConfig(workdir="a", seq_len=32, model=ModelConfig(max_seq_len=32))
    assert fits.compare_saved(old) == ([], [])


def test_seq_len_fits_the_model_and_model_errors_name_the_field():
    with pytest.raises(ValueError, match=r"--seq_len=256 exceeds --max_seq_len=128"):
        TrainConfig(seq_len=256)
    assert TrainConfig(seq_len=256, model=ModelConfig(max_seq_len=256)).seq_len == 256
    with pytest.raises(ValueError, match="--batch_size must be a positive int, got 0"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="--eval_batches must be an int >= 0, got -1"):
        TrainConfig(eval_batches=-1)
    assert TrainConfig(eval_batches=0).eval_batches == 0  # no evaluation
    with pytest.raises(TypeError, match="ModelConfig.d_ff must be an int, got bool True"):
        TrainConfig.from_flat({"d_ff": True})
    with pytest.raises(ValueError, match="top_k=3 exceeds num_experts=2"):
        TrainConfig.from_flat({"num_experts": 2, "top_k": 3})


_PARSERS = {"capacity_factor": parse_capacity_factor}


def _fresh_flags(*args: str) -> flags.FlagValues:
    values = flags.FlagValues()
    dataclass_flags.define_flags(TrainConfig, _PARSERS, flag_values=values)
    values(["prog", *args])
    return values


def test_one_flag_per_field_with_its_default_type_and_help():
    values = _fresh_flags()
    for cls in (TrainConfig, ModelConfig):
        for field in dataclasses.fields(cls):
            if field.name == "model":
                assert "model" not in values
                continue
            flag = values[field.name]
            default = cls().to_json()[field.name] if cls is TrainConfig else field.default
            if field.name == "capacity_factor":
                assert flag.value == "auto" and flag.flag_type() == "string"
            else:
                assert flag.value == default, field.name
            assert flag.help and flag.help[0].isupper(), field.name
    types = {name: values[name].flag_type() for name in ("d_model", "balance_eps", "data")}
    assert types == {"d_model": "int", "balance_eps": "float", "data": "string"}
    assert values["profile_loads"].flag_type() == "bool"
    assert values["num_heads"].help == "Attention heads; must divide d_model."
    assert values["data"].help == (
        "Text files: a path, folder or glob (default: the Python standard library's source files)."
    )
    with pytest.raises(flags.IllegalFlagValueError):
        _fresh_flags("--d_model=wide")


def test_default_workdir_names_the_model():
    assert default_workdir(None, {}) == "runs/default"
    assert default_workdir("deepseek_v3", {}) == "runs/deepseek_v3"
    # Model flags in ModelConfig's field order, whatever order they were given in.
    named = default_workdir("mixtral", {"num_layers": 4, "d_model": 32})
    assert named == "runs/mixtral-d_model=32-num_layers=4"
    assert default_workdir(None, {"top_k": 1}) == "runs/default-top_k=1"
    with pytest.raises(ValueError, match="not model fields: steps"):
        default_workdir(None, {"steps": 3})


#: The command lines of `test_a_preset_or_model_flag_gets_its_own_workdir` and their workdirs.
WORKDIR_CASES = [
    ([], "runs/default"),
    (["--preset=tiny", "--steps=3", "--balance=none"], "runs/default"),
    (["--preset=deepseek_v3"], "runs/deepseek_v3"),
    (["--preset=deepseek_v3", "--num_layers=1"], "runs/deepseek_v3-num_layers=1"),
    (["--d_model=32"], "runs/default-d_model=32"),
    (["--preset=mixtral", "--workdir=elsewhere"], "elsewhere"),
]


@functools.cache
def _workdirs_from_flags() -> list[str]:
    """`main.config_from_flags().workdir` of each command line of `WORKDIR_CASES`, in one process
    (per test process): the flags parsed afresh for each (absl's global flags, reset between)."""
    code = (
        "import json, sys; from absl import flags; from experiments.train import main; "
        "out = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    flags.FLAGS.unparse_flags(); flags.FLAGS(['train', *argv])\n"
        "    out.append(main.config_from_flags().workdir)\n"
        "print(json.dumps(out))"
    )
    env = program_env()
    argvs = json.dumps([args for args, _ in WORKDIR_CASES])
    proc = subprocess.run(
        [sys.executable, "-c", code, argvs], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("case", range(len(WORKDIR_CASES)))
def test_a_preset_or_model_flag_gets_its_own_workdir(case):
    """`--preset=deepseek_v3` right after the default run used to resume runs/default's
    checkpoints of another model (an error)."""
    assert _workdirs_from_flags()[case] == WORKDIR_CASES[case][1], WORKDIR_CASES[case][0]


def test_only_flags_given_override_the_base_model():
    values = _fresh_flags(
        "--d_model=32", "--capacity_factor=none", "--steps=5", "--noprofile_loads"
    )
    given = dataclass_flags.given_values(TrainConfig, _PARSERS, flag_values=values)
    assert given == {"d_model": 32, "capacity_factor": None, "steps": 5, "profile_loads": False}
    base = ModelConfig(d_model=64, num_layers=3, num_heads=2, max_seq_len=256)  # a "preset"
    cfg = TrainConfig.from_flat(given, base)
    assert cfg.model == ModelConfig(d_model=32, num_layers=3, num_heads=2, max_seq_len=256)
    assert cfg.steps == 5 and cfg.capacity_factor is None and cfg.balance == "ultraep"
    assert TrainConfig.from_flat({}, base) == TrainConfig(model=base)


def test_finished_workdir_is_left_alone(tmp_path, capsys):
    _run(tmp_path, "done", steps=2, checkpoint_every=1)
    metrics = tmp_path / "done" / "metrics.jsonl"
    before = metrics.read_text()
    capsys.readouterr()
    result = trainer.run(_config(tmp_path / "done", steps=2))
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "raise --steps" in out[0] and "step 2" in out[0], out
    assert result["finished"] and result["step"] == 2 and result["stopped_by"] is None
    assert metrics.read_text() == before
    # Resuming with a different model shape: a RunError naming the flag, before anything runs.
    with pytest.raises(trainer.RunError, match=r"--d_model=32 \(given: 16\)"):
        trainer.run(_config(tmp_path / "done", d_model=16))
    # Without config.json (an older workdir), restoring the checkpoint itself says it.
    (tmp_path / "done" / "config.json").unlink()
    with pytest.raises(trainer.RunError, match="does not fit this model") as err:
        _run(tmp_path, "done", steps=3, d_model=16)
    assert "kernel is (32, 32) there, (16, 16) here" in str(err.value), err.value
    assert metrics.read_text() == before


def test_stop_request_handler(capfd):
    request = stop.StopRequest()
    # As in a terminal, whatever this process inherited (a script's background job ignores it).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.install()
    try:
        assert signal.getsignal(signal.SIGINT) is request
        assert signal.getsignal(signal.SIGTERM) is request
        assert request.signum is None and request.begins(1) and request.begins(2)
        request(signal.SIGTERM)
        # The message names the step the loop began last, and no later step begins.
        assert "SIGTERM: stopping after step 2 to save" in capfd.readouterr().err
        assert request.signum == signal.SIGTERM and not request.begins(3) and request.step == 2
        # A second Ctrl-C is not caught any more: it ends the process at once. A second SIGTERM
        # (`timeout` sends one to the process, then one to its group) is absorbed.
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM) is request
        request(signal.SIGTERM)
        assert request.signum == signal.SIGTERM and not request.begins(3)
        assert capfd.readouterr().err == ""
    finally:
        request.restore()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, previous)


def test_stop_request_leaves_an_ignored_sigint_ignored():
    """A background job of a shell script starts with SIGINT ignored; the run keeps it so (the
    script's Ctrl-C is not for it) and stops on SIGTERM."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    request = stop.StopRequest()
    try:
        request.install()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is request
        request(signal.SIGTERM)
        assert not request.begins(1) and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        request.restore()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        request.restore()
        signal.signal(signal.SIGINT, previous)


def _python(args, env_extra=None, timeout=600, merge_stderr=False):
    env = program_env()
    env.update(env_extra or {})
    # SIGINT as in a terminal, also when pytest runs as a script's background job: an ignored
    # SIGINT would be inherited, and the run keeps an ignored SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "experiments.train", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
            text=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)


#: Flags each of which ends the run with one ``error:`` line (`test_bad_flags_end_with_one_line`).
BAD_FLAGS = [
    ("--balance=fancy", "unknown --balance"),
    ("--num_experts=12", "not divisible"),
    ("--data=/nonexistent/corpus", "/nonexistent/corpus"),
    ("--capacity_factor=lots", "--capacity_factor"),
    ("--seq_len=512", "--max_seq_len=128"),
    ("--d_model=0", "d_model must be a positive int"),
    ("--tensor_size=3", "--tensor_size=3 does not divide the 8 devices"),
]
#: Flags that absl cannot parse, or that the run refuses before starting
#: (`test_unparsable_flags_end_with_one_line_and_exit_2`), by id.
UNPARSABLE_FLAGS = {
    "preset": (["--preset=nonexistent"], "flag --preset=nonexistent: value should be one of"),
    "steps": (["--steps=abc"], "flag --steps=abc: invalid literal"),
    "slots0": (["--slots_per_rank=0"], "--slots_per_rank=0 leaves --balance=ultraep no spare slot"),
    "lr_nan": (["--learning_rate=nan"], "--learning_rate must be finite, got nan"),
}
#: The help flags (`test_help_leads_with_usage_and_three_examples`): each alone, and after a flag.
HELP_ARGVS = [["--helpshort"], ["--steps=3", "--help"], ["--steps=3", "--helpshort"], ["-?"]]
#: The tests of `flag_runs` run in one test process, which builds it once (pytest-xdist).
FLAG_RUNS_GROUP = pytest.mark.xdist_group("test_train_flag_runs")


@pytest.fixture(scope="module")
def flag_runs(tmp_path_factory) -> dict:
    """What `python -m experiments.train` printed and exited with for each command line of the
    flag tests: ``{("help", i) | ("bad", flag) | ("unparsable", id): run}``, a run being
    `program_runs.run_each`'s record, plus ``("workdir", key)``: the run's ``--workdir``. All
    in one process: each line goes through the program's own flag parsing and ``main`` as when
    run alone, and a test of a one-line error pays no JAX start of its own (one such line runs
    as a program of its own: `test_a_flag_error_ends_the_program_with_one_line`)."""
    base = tmp_path_factory.mktemp("flag_runs")
    argvs = {("help", i): argv for i, argv in enumerate(HELP_ARGVS)}
    for i, (flag, _) in enumerate(BAD_FLAGS):
        argvs["bad", flag] = [f"--workdir={base / f'bad{i}'}", flag]
    for name, (args, _) in UNPARSABLE_FLAGS.items():
        argvs["unparsable", name] = [f"--workdir={base / name / 'run'}", *args]
    runs = run_each("experiments.train", list(argvs.values()))
    out = dict(zip(argvs, runs, strict=True))
    out.update({("workdir", name): base / name / "run" for name in UNPARSABLE_FLAGS})
    return out


@FLAG_RUNS_GROUP
@pytest.mark.parametrize("flag, message", BAD_FLAGS)
def test_bad_flags_end_with_one_line(flag_runs, flag, message):
    run = flag_runs["bad", flag]
    assert run["code"] != 0
    assert "Traceback" not in run["stderr"]
    errors = [line for line in run["stderr"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], run["stderr"]


def _one_error_line(proc, message):
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], err
    return errors[0]


@pytest.mark.parametrize("case", ["empty file", "empty files", "tiny file", "workdir is a file"])
def test_unusable_inputs_end_with_one_line(tmp_path, case):
    """The run's own checks of its data and workdir, in this process: a one-line `RunError`
    before anything is written, which the program ends with as its one line ``error: ...`` and
    exit code 2, as for every RunError (run as a program by
    `test_resume_with_another_model_ends_with_one_line`)."""
    workdir = tmp_path / "run"
    if case == "empty file":
        (tmp_path / "empty.txt").write_bytes(b"")
        values, message = {"data": str(tmp_path / "empty.txt")}, "the corpus is empty"
    elif case == "empty files":
        (tmp_path / "texts").mkdir()
        for name in ("a.txt", "b.txt"):
            (tmp_path / "texts" / name).write_bytes(b"")
        values, message = {"data": str(tmp_path / "texts")}, "the corpus is empty"
    elif case == "tiny file":
        (tmp_path / "tiny.txt").write_bytes(b"abc")
        values, message = {"data": str(tmp_path / "tiny.txt")}, "too small"
    else:
        workdir.write_text("not a folder")
        values, message = {}, "is a file"
    with pytest.raises(trainer.RunError, match=re.escape(message)) as info:
        trainer.run(_config(workdir, **values))
    assert "\n" not in str(info.value)
    if case != "workdir is a file":
        assert not workdir.exists()  # nothing written for a run that cannot start


def test_resume_with_another_model_ends_with_one_line(tmp_path, capsys):
    workdir = tmp_path / "run"
    _run(tmp_path, "run", steps=1, checkpoint_every=1)
    assert _checkpoint_steps(workdir) == [1]
    # A one-step run has only its compiling step: no median step time or tokens/s.
    summary = _summary(workdir)
    assert summary["timed_steps"] == 0 and summary["median_step_time_s"] is None
    assert summary["median_tokens_per_s"] is None
    out = capsys.readouterr().out
    assert "tokens/s, step time: no timed step (left out: step 1, compiling)" in out
    assert "median" not in out
    flags_ = [f"--workdir={workdir}", "--steps=2", *SMALL_FLAGS, "--d_model=16", "--num_layers=2"]
    line = _one_error_line(_python(flags_), "different model")
    assert "--d_model=32 (given: 16)" in line and "--num_layers=1 (given: 2)" in line
    assert "--steps" not in line
    assert _checkpoint_steps(workdir) == [1]


#: Steps, and checkpoint and eval intervals, that a run stopped by a signal never reaches.
_ENDLESS = 100000


def _signalled_run(workdir, signum, from_step: int, resend_on: str | None = None):
    """`experiments.train` in a subprocess for `_ENDLESS` steps (a line per step, no checkpoint
    or eval but the first) sent ``signum`` once it prints step ``from_step``; with
    ``resend_on``, at every step line from there on until it prints a line starting with
    ``resend_on``, and once more then. Returns its exit code and output (stdout and stderr)."""
    args = [f"--workdir={workdir}", *SMALL_FLAGS, f"--steps={_ENDLESS}", "--print_every=1"]
    args += [f"--checkpoint_every={_ENDLESS}", f"--eval_every={_ENDLESS}"]
    proc = _python(args, merge_stderr=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step") and int(line.split()[1]) >= from_step:
            proc.send_signal(signum)
            if resend_on is None:
                break
        if resend_on is not None and line.startswith(resend_on):
            proc.send_signal(signum)
            break
    rest, _ = proc.communicate(timeout=300)
    return proc.returncode, "".join(lines) + rest


def test_ctrl_c_saves_and_resume_continues(tmp_path, capsys):
    workdir = tmp_path / "run"
    returncode, out = _signalled_run(workdir, signal.SIGINT, from_step=3)
    assert returncode == 130, out[-3000:]
    assert "Traceback" not in out
    records = _records(workdir)
    stopped = records[-1]["step"]
    assert 3 <= stopped < _ENDLESS
    assert [r["step"] for r in records] == list(range(1, stopped + 1))
    assert _checkpoint_steps(workdir)[-1] == stopped  # orbax also keeps its first save, step 1
    assert f"stopped by SIGINT after step {stopped} of {_ENDLESS}" in out
    # The step the signal came in is the last one: the message names it when the signal comes.
    assert f"SIGINT: stopping after step {stopped} to save" in out
    assert f"workdir {workdir}" in out and f"files in {workdir}" in out
    assert (workdir / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    summary = _summary(workdir)
    assert summary["step"] == stopped and summary["stopped_by"] == "SIGINT"
    assert not summary["finished"] and summary["final_loss"] == records[-1]["loss"]

    capsys.readouterr()
    _run(tmp_path, "run", steps=stopped + 2, checkpoint_every=_ENDLESS)
    assert f"resuming after step {stopped}" in capsys.readouterr().out
    assert [r["step"] for r in _records(workdir)] == list(range(1, stopped + 3))
    assert _checkpoint_steps(workdir)[-2:] == [stopped, stopped + 2]
    assert _summary(workdir)["finished"]


def test_sigterm_twice_still_saves(tmp_path):
    """`timeout` signals the run and then its whole process group: the second SIGTERM, arriving
    while the run saves, used to kill it (exit -15, nothing saved after the last checkpoint)."""
    workdir = tmp_path / "run"
    # Another SIGTERM once the run says it handles the first one (while it saves).
    returncode, out = _signalled_run(workdir, signal.SIGTERM, 2, resend_on="SIGTERM: stopping")
    assert returncode == 128 + signal.SIGTERM, out[-3000:]
    stopped = _records(workdir)[-1]["step"]
    assert _checkpoint_steps(workdir)[-1] == stopped >= 2
    assert _summary(workdir)["stopped_by"] == "SIGTERM"
    assert f"stopped by SIGTERM after step {stopped}" in out


@FLAG_RUNS_GROUP
@pytest.mark.parametrize("name", UNPARSABLE_FLAGS)
def test_unparsable_flags_end_with_one_line_and_exit_2(flag_runs, name):
    """absl's own parse errors printed two lines and exited 1; `--slots_per_rank=0` with
    balancing silently kept the 1.05x buffer sized for balancing and dropped pairs."""
    run, (_, message) = flag_runs["unparsable", name], UNPARSABLE_FLAGS[name]
    err = run["stderr"]
    assert run["code"] == 2, err
    assert err.strip().splitlines() == [err.strip()] and err.startswith(f"error: {message}"), err
    assert not flag_runs["workdir", name].exists()


def test_a_flag_error_ends_the_program_with_one_line(tmp_path):
    """`python -m experiments.train` with a flag absl cannot parse, as a program of its own
    (absl's ``app.run`` around the parse, the process's exit): one line, exit code 2, nothing
    written. The other flag errors run in one process (`flag_runs`)."""
    proc = _python([f"--workdir={tmp_path / 'run'}", "--steps=abc"])
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    message = UNPARSABLE_FLAGS["steps"][1]
    assert err.strip().splitlines() == [err.strip()] and err.startswith(f"error: {message}"), err
    assert not (tmp_path / "run").exists()


def test_help_exits_0_for_the_planner():
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.planner", "--help"],
        cwd=ROOT,
        env=program_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--balance_eps" in proc.stdout


@FLAG_RUNS_GROUP
def test_help_leads_with_usage_and_three_examples(flag_runs):
    """--help used to open with absl's file path of the module and an RST-quoted header;
    --helpshort, --help and -? exit 0 with the same text."""
    runs = [flag_runs["help", i] for i in range(len(HELP_ARGVS))]
    for run in runs:
        assert run["code"] == 0, run["stderr"][-2000:]
    outputs = [run["stdout"] for run in runs]
    assert all(out == outputs[0] for out in outputs)
    lines = outputs[0].splitlines()
    assert lines[0] == "usage: python -m experiments.train [--flag=value ...]"
    examples = [i for i, line in enumerate(lines) if line.startswith("  python -m ")]
    assert len(examples) == 3 and examples[-1] < lines.index("flags:")
    assert all(lines[i].startswith("  python -m experiments.train") for i in examples)
    assert not [line for line in lines if line.rstrip().endswith(".py:")]
    assert "``" not in outputs[0] and "  --steps: Training steps" in outputs[0]


def test_no_spare_slots_with_balancing_is_an_error():
    with pytest.raises(ValueError, match="--slots_per_rank=0 leaves --balance=ultraep"):
        TrainConfig(slots_per_rank=0)
    assert TrainConfig(slots_per_rank=0, balance="none").capacity_factor is None


def _doc_sample() -> str:
    """The sample output of the default run in docs/training.md (its "## The default run")."""
    text = (ROOT / "docs" / "training.md").read_text().split("## The default run", 1)[1]
    return text.split("```\n", 2)[1]


def _line_kinds(text: str) -> set[str]:
    """What kinds of lines a run's output has: each line with the workdir (from the first line)
    as <workdir>, a per-layer run of before->after figures as one, every number as #."""
    workdir = re.match(r"workdir (\S+): ", text).group(1)
    kinds = set()
    for line in text.splitlines():
        line = line.replace(workdir, "<workdir>")
        line = re.sub(r"[\d.]+->[\d.]+( +[\d.]+->[\d.]+)*", "#->#", line)
        line = re.sub(r"\d[\d,]*(\.\d+)?", "#", line)
        line = " ".join(line.split())
        if line and line != "...":
            kinds.add(line)
    return kinds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@DEFAULT_RUN_GROUP
def test_two_processes_match_one(tmp_path, default_run):
    steps = ["--steps=3", "--checkpoint_every=3", "--eval_every=3", *SMALL_FLAGS]
    # The one process: `default_run`, in this one (8 devices), the run `python -m
    # experiments.train` with `steps` makes for 12 steps (the default preset's model is
    # `ModelConfig`'s defaults); its first 3 steps and the evaluation after step 3.
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
    one, two = _records(default_run)[:3], _records(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-5)
    assert two[-1]["eval_loss"] == pytest.approx(one[-1]["eval_loss"], rel=1e-5)


# Internal planning documents are not part of the repository: user-facing text (docstrings, help
# strings, messages) must not send readers to them.
INTERNAL_REFERENCES = re.compile(r"DESIGN\.md|\b[Ii]ssue \d|(?<![./])\bshared/")
# Reworded by the engineer who owns it; drop it from here once that lands.
NOT_YET_REWORDED = set()


def test_no_references_to_internal_documents():
    found = []
    for path in sorted([*ROOT.glob("experiments/**/*.py"), *ROOT.glob("models/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel in NOT_YET_REWORDED:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if INTERNAL_REFERENCES.search(line):
                found.append(f"{rel}:{lineno}: {line.strip()}")
    assert not found, "\n".join(found)


def test_fallback_below_the_threshold_drops_nothing(tmp_path):
    """--batch_size=8 (32 tokens per rank on 8 devices, below the default threshold 256) with
    balancing and its 1.05x buffers: the layers run plain EP and drop no pair (they dropped a
    third of them when the fallback kept the balanced buffer)."""
    records = _run(
        tmp_path, "fallback", balance="ultraep", min_tokens_per_rank=256, steps=3, **NO_EVAL
    )
    assert _summary(tmp_path / "fallback")["config"]["capacity_factor"] == 1.05
    assert all(sum(r["replicas"]) == 0 for r in records)  # plain EP: the fallback ran
    assert all(sum(r["dropped"]) == 0 for r in records)


def test_fallback_note_below_the_threshold():
    """A balanced run whose batch gives each rank fewer tokens than --min_tokens_per_rank says so
    at start; at or above it, or without balancing, nothing."""
    below = TrainConfig(workdir="w", batch_size=8, seq_len=32)  # 32 tokens per rank on 8
    assert below.min_tokens_per_rank == 256
    note = trainer.fallback_note(below, 8)
    assert note.startswith("note: 32 tokens per rank is below --min_tokens_per_rank=256")
    assert trainer.fallback_note(TrainConfig(workdir="w"), 8) == ""  # 16 x 128 / 8 = 256
    assert trainer.fallback_note(dataclasses.replace(below, min_tokens_per_rank=0), 8) == ""
    assert trainer.fallback_note(TrainConfig(workdir="w", batch_size=8, balance="none"), 8) == ""


def test_ideal_mode_runs_balanced_loads_and_says_what_it_is(tmp_path, capsys):
    """--balance=ideal: the force-balanced ideal at the balanced run's 1.05x buffers: every
    layer's ranks at the mean (32 tokens per rank, 64 pairs over 8 experts), no pair dropped, no
    replica, and the run says it is a timing reference."""
    records = _run(tmp_path, "ideal", balance="ideal", steps=2, **NO_EVAL)
    assert _summary(tmp_path / "ideal")["config"]["capacity_factor"] == 1.05
    assert "note: --balance=ideal is the force-balanced ideal, a timing reference" in (
        capsys.readouterr().out
    )
    for r in records:
        assert sum(r["dropped"]) == 0 and sum(r["replicas"]) == 0
        assert all(v == 1.0 for v in r["imbalance_before"])
    with pytest.raises(ValueError, match=r"unknown --balance='idea'; expected one of none, "):
        TrainConfig(balance="idea")
