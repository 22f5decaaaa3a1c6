"""`python -m experiments.serve` end to end on a workdir trained here: balanced and plain prefill
predict the same next tokens (to float rounding), the padded, masked batch predicts what each
prompt alone predicts, the continuation starts with the prediction, and bad input ends in one
``error:`` line with exit code 2."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

import ultraep_jax as uep
from experiments.lab import cli
from experiments.lab.output_files import check_output_path
from experiments.lab.program import fallback_note
from experiments.lab.training import build
from experiments.lab.training.config import TrainConfig
from experiments.serve import engine
from experiments.serve.config import DEFAULT_PROMPTS, ServeConfig
from experiments.serve.prompts import Prompt, pad_batch
from experiments.serve.report import report
from experiments.train import trainer
from models.moe_lm import MoESettings
from tests.experiments.program_runs import run_each
from tests.xla_settings import program_env

# End-to-end runs of the programs (seconds to minutes each): `-m "not slow"` skips them.
# One test process builds the module fixture (pytest-xdist).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_serve")]

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Positions for the shipped prompts too: the documented command's run folder is a copy of the
# module's trained workdir (`test_documented_command_runs_from_another_folder`).
MAX_SEQ_LEN = 128
TINY = {
    "steps": 4,
    "batch_size": 8,
    "seq_len": 32,
    "d_model": 16,
    "num_layers": 2,
    "num_heads": 2,
    "d_ff": 16,
    "num_experts": 8,
    "top_k": 2,
    "max_seq_len": MAX_SEQ_LEN,
    "slots_per_rank": 2,
    "min_tokens_per_replica": 2,
    "max_corpus_bytes": 100_000,
    "eval_batches": 0,  # no evaluation: no test here reads one
    "learning_rate": 1e-2,
    "checkpoint_every": 4,
    "eval_every": 4,
    "print_every": 100,
}
PROMPTS = {
    "a.txt": b"def main():\n    return ",
    "b.txt": b"import os\nimport sys\n\nclass Foo:\n    def ",
    "c.txt": b"for i in range(",
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("serve") / "run"
    trainer.run(TrainConfig.from_flat({"workdir": str(path), **TINY}))
    return path


@pytest.fixture(scope="module")
def prompt_dir(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("prompts")
    for name, text in PROMPTS.items():
        (path / name).write_bytes(text)
    return path


def _serve(*args, timeout=600) -> subprocess.CompletedProcess:
    env = program_env()
    return subprocess.run(
        [sys.executable, "-m", "experiments.serve", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


#: How the module's served run runs its layers: a tensor axis the workdir was not trained with
#: (served on data 1 x expert 4 x tensor 2; `test_predictions_equal_each_prompt_alone` checks its
#: predictions against the plain mesh's) and a choice of each execution flag.
SERVE_CHOICES = (
    "--tensor_size=2",
    "--planner=portable",
    "--max_fanout=1",
    "--transfer_chunks=2",
    "--ranks_per_domain=2",
)


@pytest.fixture(scope="module")
def served(workdir, prompt_dir, tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("out") / "serve.json"
    proc = _serve(
        f"--workdir={workdir}",
        f"--prompts={prompt_dir}/*.txt",
        "--balance=both",
        "--repeats=1",
        "--new_tokens=3",
        "--min_tokens_per_rank=0",  # a few tokens per rank: balance anyway
        *SERVE_CHOICES,
        f"--output={out}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_balanced_and_plain_predict_the_same(served):
    res, stdout = served
    bal, plain = res["runs"]["ultraep"], res["runs"]["none"]
    assert len(bal["next_token"]) == len(PROMPTS)
    assert bal["next_token"] == plain["next_token"]
    np.testing.assert_allclose(bal["next_logprob"], plain["next_logprob"], rtol=0, atol=1e-5)
    assert sum(bal["dropped"]) == 0 and sum(plain["dropped"]) == 0
    # The same loads before balancing (padding adds none), no worse after.
    np.testing.assert_allclose(bal["imbalance_before"], plain["imbalance_before"], rtol=1e-6)
    after, before = np.array(bal["imbalance_after"]), np.array(bal["imbalance_before"])
    assert np.all(after <= before + 1e-6)
    assert plain["replicas"] == [0, 0]
    B, T = res["batch"]
    real = sum(len(t) for t in PROMPTS.values())
    assert res["prompt_tokens"] == real and T == max(len(t) for t in PROMPTS.values())
    assert B % 4 == 0 and bal["masked"] == [B * T - real] * TINY["num_layers"]
    assert "next-token predictions the same for 3 of 3 prompts" in stdout
    assert "tokens/s" in stdout and "max/mean before" in stdout
    assert res["fallback"] is False and "below --min_tokens_per_rank" not in stdout


def test_a_workdir_serves_with_another_tensor_size_and_the_execution_flags(served):
    """The workdir (trained with --tensor_size=1) served on a tensor axis of 2, and the report
    says so; --planner, --max_fanout, --transfer_chunks and --ranks_per_domain reach the balanced
    prefill (the same predictions as plain EP: `test_balanced_and_plain_predict_the_same`)."""
    res, stdout = served
    assert res["mesh"] == {"data": 1, "expert": 4, "tensor": 2}
    assert res["tensor_size"] == {"served": 2, "trained": 1}
    assert "EP=4 x data=1 x tensor=2 on 8 cpu devices" in stdout
    note = "note: trained with --tensor_size=1, served with --tensor_size=2: the same weights, "
    assert note + "each expert's hidden width split over 2 devices" in stdout
    assert res["execution"] == {"planner": "portable", "transfer_chunks": 2}
    assert (res["balancer"]["max_fanout"], res["balancer"]["ranks_per_domain"]) == (1, 2)
    as_trained = report({**res, "tensor_size": {"served": 2, "trained": 2}})
    assert "each expert's hidden width split over 2 devices, as trained (the workdir's " in (
        as_trained
    )
    plain = {**res, "mesh": {"data": 1, "expert": 8, "tensor": 1}}
    text = report({**plain, "tensor_size": {"served": 1, "trained": 1}})
    assert "EP=8 x data=1 on 8" in text and "tensor" not in text


def test_report_on_the_fallback_and_without_decode(served):
    """Balanced, the report gives the time ratio; on the fallback both prefills ran plain EP, so
    it says so instead of a ratio of two identical programs; without decode steps it prints no
    empty continuations."""
    res, stdout = served
    assert re.search(r"balanced / plain prefill time: \d+\.\d{3}; next-token", stdout)
    # One process over simulated devices: the ratio is said to be total work, not a clock.
    assert "simulated CPU devices in one process are the total work" in stdout
    assert stdout.count("; continues ") == len(PROMPTS)
    threshold = {**res["balancer"], "min_tokens_per_rank": 256}  # above its tokens per rank
    text = report({**res, "fallback": True, "balancer": threshold, "decode": {"steps": 0}})
    not_compared = "balanced / plain prefill time: not compared (the balanced prefill ran plain EP)"
    assert f"{not_compared}; next-token" in text
    assert "note: " in text and not re.search(r"prefill time: \d", text)
    assert "continues" not in text and "greedy continuations" not in text
    assert text.count("next ultraep: ") == len(PROMPTS)


def test_help_leads_with_usage_and_examples(input_runs):
    run = input_runs["help"]
    assert run["code"] == 0, run["stderr"][-2000:]
    lines = run["stdout"].splitlines()
    # --prompts has a default (experiments/serve/prompts): the usage line shows it optional.
    usage = "usage: python -m experiments.serve --workdir=DIR [--prompts=FILES]"
    assert lines[0].startswith(usage)
    examples = [line for line in lines if line.startswith("  python -m experiments.serve")]
    assert len(examples) == 3 and "``" not in run["stdout"]
    assert "--prompts" in run["stdout"] and "--new_tokens" in run["stdout"]


def test_shipped_prompts_balance_with_the_default_model():
    """The documented example: experiments/serve/prompts padded into one batch gives each of 8
    ranks at least the default --min_tokens_per_rank, with every prompt within max_seq_len."""
    prompts = sorted((ROOT / "experiments" / "serve" / "prompts").iterdir())
    tokens = [len(p.read_bytes()) for p in prompts]
    assert prompts and all(0 < t <= TrainConfig().model.max_seq_len for t in tokens)
    rows = -(-len(prompts) // 8) * 8
    assert rows * max(tokens) // 8 >= ServeConfig("w", "p").min_tokens_per_rank


def test_fallback_note():
    """Below --min_tokens_per_rank the report says the balanced prefill ran plain EP."""
    subject = "the balanced prefill runs"
    assert fallback_note(256, 256, subject) == fallback_note(300, 0, subject) == ""
    note = fallback_note(6, 256, subject)
    assert note.startswith("note: 6 tokens per rank is below --min_tokens_per_rank=256: the ")
    assert "runs plain expert parallelism" in note


def test_predictions_equal_each_prompt_alone(served, workdir):
    """Each prompt run by itself (no padding, no mask, plain EP, 8 copies as the batch) predicts
    what the padded, masked batch predicted, and the continuation starts with it."""
    res, _ = served
    _, train_cfg = engine.read_train_config(str(workdir))
    mesh = build.make_mesh(1, 8, 1)  # the mesh experiments.serve builds on 8 devices
    state, step = engine.restore(train_cfg, workdir, mesh)
    assert step == TINY["steps"] == res["checkpoint_step"]
    model = engine.build(train_cfg, mesh, state, MoESettings())
    by_file = {pathlib.Path(p["file"]).name: p for p in res["prompts"]}
    # One program per prompt length: called as it is, the model ran each operation as a program
    # of its own (about 60 compiled per length).
    logits_of = nnx.jit(lambda model, tokens: model(tokens)[0])
    for name, text in PROMPTS.items():
        tokens = np.tile(np.frombuffer(text, np.uint8).astype(np.int32), (8, 1))
        logits = logits_of(model, engine.on_mesh(mesh, tokens, split=True))
        last = np.asarray(logits, np.float64)[0, -1]
        logp = last - np.log(np.sum(np.exp(last - last.max()))) - last.max()
        got = by_file[name]
        assert got["next_token"]["ultraep"] == chr(int(np.argmax(logp))), name
        np.testing.assert_allclose(got["next_logprob"]["none"], logp.max(), atol=1e-4)
        assert got["continuation"][:1] == got["next_token"]["none"], name
        assert 1 <= len(got["continuation"].encode()) <= 3 * 4  # 3 tokens, replacement chars


def test_pad_batch_by_hand():
    prompts = [Prompt(pathlib.Path("x"), np.array([5, 6, 7])), Prompt(pathlib.Path("y"), [9])]
    tokens, mask, lengths = pad_batch(prompts, rows_multiple=4, length=4)
    np.testing.assert_array_equal(tokens, [[5, 6, 7, 0], [9, 0, 0, 0], [0] * 4, [0] * 4])
    np.testing.assert_array_equal(mask, [[1, 1, 1, 0], [1, 0, 0, 0], [0] * 4, [0] * 4])
    np.testing.assert_array_equal(lengths, [3, 1, 0, 0])
    with pytest.raises(ValueError, match="length 2 is shorter than the longest prompt"):
        pad_batch(prompts, 4, length=2)


@pytest.fixture(scope="module")
def input_runs(workdir, prompt_dir, tmp_path_factory) -> dict:
    """What `python -m experiments.serve` printed and exited with for ``--help`` and for each
    unusable input of the tests below (`program_runs.run_each`'s records, by name), all in one
    process: each command line goes through the program's own flag parsing and ``main`` as when
    run alone, and a test of a one-line error pays no JAX start of its own (one such input runs
    as a program of its own: `test_missing_workdir`). ``paths``: the files and folders they
    name."""
    base = tmp_path_factory.mktemp("inputs")
    paths = {"no_run": base / "no_run", "empty": base / "empty.txt", "long": base / "long.txt"}
    paths["no_run"].mkdir()
    paths["empty"].write_bytes(b"")
    paths["long"].write_bytes(b"x" * (MAX_SEQ_LEN + 1))
    paths["afile"] = base / "afile"
    paths["afile"].write_text("x")
    paths["under_a_file"], paths["a_folder"] = paths["afile"] / "serve.json", base
    argvs = {
        "help": ["--help"],
        "no_run": [f"--workdir={paths['no_run']}", f"--prompts={prompt_dir}"],
        "empty": [f"--workdir={workdir}", f"--prompts={paths['empty']}"],
        "long": [f"--workdir={workdir}", f"--prompts={paths['long']}"],
    }
    for where in ("under_a_file", "a_folder"):
        argvs[where] = [f"--workdir={workdir}", f"--prompts={prompt_dir}"]
        argvs[where].append(f"--output={paths[where]}")
    runs = dict(zip(argvs, run_each("experiments.serve", list(argvs.values())), strict=True))
    return {**runs, "paths": paths}


def _one_error_line(code, stderr, *needles):
    assert code == 2, (code, stderr[-2000:])
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_workdir(tmp_path, prompt_dir):
    """A missing workdir, as a program of its own (absl's ``app.run``, the process's exit)."""
    missing = tmp_path / "nothing"
    proc = _serve(f"--workdir={missing}", f"--prompts={prompt_dir}")
    _one_error_line(proc.returncode, proc.stderr, f"--workdir={missing}", "does not exist")


def test_workdir_without_a_run(input_runs):
    run, message = input_runs["no_run"], "not a folder written by experiments.train"
    _one_error_line(run["code"], run["stderr"], "config.json", message)


def test_empty_prompt_file(input_runs):
    run, empty = input_runs["empty"], input_runs["paths"]["empty"]
    _one_error_line(run["code"], run["stderr"], str(empty), "is empty")


def test_prompt_longer_than_max_seq_len(input_runs):
    run, long = input_runs["long"], input_runs["paths"]["long"]
    needles = (str(long), f"{MAX_SEQ_LEN + 1} tokens", f"max_seq_len={MAX_SEQ_LEN}")
    _one_error_line(run["code"], run["stderr"], *needles)


def test_decode_compiles_the_fallback(workdir):
    """The decode steps' program has no planner call; the prefill's, balanced, has one."""
    _, train_cfg = engine.read_train_config(str(workdir))
    mesh = build.make_mesh(1, 8, 1)  # the mesh experiments.serve builds on 8 devices
    state, _ = engine.restore(train_cfg, workdir, mesh)
    balancer = uep.BalancerConfig(slots_per_rank=2, min_tokens_per_replica=2, min_tokens_per_rank=0)
    tokens = np.zeros((8, 16), np.int32)
    lengths = np.full((8,), 4, np.int32)
    per_rank = tokens.size // 8
    fallback = engine.decode_balancer(balancer, per_rank)
    assert fallback.min_tokens_per_rank == per_rank + 1 and not fallback.applies(per_rank)
    assert engine.decode_balancer(None, per_rank) is None
    decode = engine.greedy_step(
        engine.build(train_cfg, mesh, state, MoESettings(fallback)), mesh, 2
    )
    args = (engine.on_mesh(mesh, tokens, split=False), engine.on_mesh(mesh, lengths, split=False))
    assert "ultraep_plan" not in decode.func.lower(*decode.args, *args).as_text()
    mask = engine.on_mesh(mesh, np.ones_like(tokens, bool), split=True)
    texts = {}
    for planner in ("native", "portable"):  # --planner: the FFI call, or the planner in JAX
        settings = MoESettings(balancer, 1.05, execution=uep.Execution(planner=planner))
        prefill = engine.prefill_step(engine.build(train_cfg, mesh, state, settings), mesh)
        split = engine.on_mesh(mesh, tokens, split=True)
        texts[planner] = prefill.func.lower(*prefill.args, split, mask, args[1]).as_text()
    assert "ultraep_plan" in texts["native"] and "ultraep_plan" not in texts["portable"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"workdir": ""}, "--workdir must name a folder"),
        ({"prompts": ""}, "--prompts must name"),
        ({"balance": "all"}, "--balance must be one of ultraep, none, both, got 'all'"),
        ({"new_tokens": -1}, "--new_tokens must be an int >= 0, got -1"),
        ({"repeats": 0}, "--repeats must be an int >= 1, got 0"),
        ({"capacity_factor": 0.0}, "--capacity_factor must be a finite number > 0, got 0.0"),
        ({"capacity_factor": float("inf")}, "--capacity_factor must be a finite number > 0"),
        ({"balance_eps": -0.5}, "--balance_eps must be finite and >= 0, got -0.5"),
        ({"tensor_size": -1}, "--tensor_size must be an int >= 0, got -1"),
        ({"planner": "fast"}, r"--planner must be one of \('auto', 'native', 'portable'\)"),
        ({"transfer_chunks": 0}, "--transfer_chunks must be a positive int, got 0"),
        ({"max_fanout": -1}, "--max_fanout must be an int >= 0, got -1"),
        ({"ranks_per_domain": -1}, r"--ranks_per_domain must be >= 0 \(0: one domain\), got -1"),
    ],
)
def test_bad_config_raises_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        ServeConfig(**{"workdir": "w", "prompts": "p", **kwargs})
    assert "\n" not in str(info.value)


def test_capacity_factor_takes_trains_values():
    """Serve rejected --capacity_factor=none, which train accepts: one parser reads both."""
    for text, value in (("auto", 1.05), ("none", None), ("1.5", 1.5), (" 2 ", 2.0)):
        parsed = cli.parse_capacity_factor(text)
        assert ServeConfig("w", "p", capacity_factor=parsed).capacity_factor == value, text
        assert TrainConfig(workdir="w", capacity_factor=parsed).capacity_factor == value, text
    for bad in (0, -1.0, float("nan"), True, "lots"):
        for make in (
            lambda cf: ServeConfig("w", "p", capacity_factor=cf),
            lambda cf: TrainConfig(workdir="w", capacity_factor=cf),
        ):
            with pytest.raises(ValueError, match="--capacity_factor must be a"):
                make(bad)


def test_default_prompts_are_the_shipped_ones():
    """experiments/README.md's command (`--workdir=runs/default` alone) ended with "--prompts must
    name a prompt file, folder or glob"."""
    shipped = ROOT / "experiments" / "serve" / "prompts"
    assert pathlib.Path(ServeConfig("w").prompts) == pathlib.Path(DEFAULT_PROMPTS) == shipped
    assert len(list(shipped.iterdir())) == 24


@pytest.mark.parametrize("where", ["under_a_file", "a_folder"])
def test_unwritable_output_fails_before_the_prefill(input_runs, where):
    """An --output under an existing file ran the whole prefill, then died with a 56-line
    FileExistsError."""
    run, output = input_runs[where], input_runs["paths"][where]
    _one_error_line(run["code"], run["stderr"], f"--output={output}")
    assert "prefill" not in run["stdout"] and "Traceback" not in run["stderr"]
    assert input_runs["paths"]["afile"].read_text() == "x"


def test_check_output_path(tmp_path):
    check_output_path(tmp_path / "new" / "deeper" / "out.json", "--out")  # created later
    (tmp_path / "f").write_text("")
    check_output_path(tmp_path / "f", "--out")  # replaced
    with pytest.raises(ValueError, match=r"--out=.*f/x.json: .*f is a file, not a folder"):
        check_output_path(tmp_path / "f" / "x.json", "--out")
    with pytest.raises(ValueError, match="is a folder; name a file"):
        check_output_path(tmp_path, "--out")


def test_documented_command_runs_from_another_folder(tmp_path_factory, workdir):
    """experiments/README.md's serve command, as written, on a run folder runs/default (a tiny
    model whose positions cover the shipped prompts: a copy of the module's trained workdir),
    from a folder other than the checkout: the default prompts are found beside the program."""
    here = tmp_path_factory.mktemp("elsewhere")
    run = here / "runs" / "default"
    shutil.copytree(workdir, run, ignore=shutil.ignore_patterns("serve.json"))
    env = program_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = "python -m experiments.serve --workdir=runs/default"
    proc = subprocess.run(
        [sys.executable, *command.split()[1:]],
        cwd=here,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((run / "serve.json").read_text())
    assert len(res["prompts"]) == 24 and res["tokens_per_rank"] == 279
    # docs/serving.md's reason why decode runs plain EP: the window, not the new tokens, per rank.
    assert res["decode"]["tokens_per_rank"] == 327 > ServeConfig("w").min_tokens_per_rank
    assert "327 per rank" in (ROOT / "docs" / "serving.md").read_text()
    assert "next-token predictions the same for" in proc.stdout


def test_config_modes():
    assert ServeConfig("w", "p").modes == ("ultraep", "none")
    assert ServeConfig("w", "p", balance="none").modes == ("none",)


@pytest.mark.parametrize("module", ["experiments.bench.moe", "experiments.replay.main"])
def test_benchmarks_capacity_factor_takes_the_same_values(module):
    """The layer benchmarks (bench.moe, and breakeven and rates, which share its flags) and the
    replay took only a float: they read a number or auto as train and serve do, and refuse none
    (their buffers must be finite) with the reason in one line. Each in its own process: both
    define the flag."""
    code = f"""
import {module}
from absl import flags
flag = flags.FLAGS["capacity_factor"]
print(flag.default, [flag.parser.parse(t) for t in ("auto", "1.25", " 2 ")])
for bad in ("none", "0"):
    try:
        flag.parser.parse(bad)
    except ValueError as e:
        print(e)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "1.05 [1.05, 1.25, 2.0]"
    refused = r"none \(dropless\) is refused: .*; give a number > 0, or auto \(1.05\)"
    assert re.fullmatch(refused, out[1])
    assert out[2] == "--capacity_factor must be a finite number > 0, got 0.0"
