"""The whole-step benchmark (`experiments.bench.step`): its arithmetic against hand-computed values,
one tiny run of the program (four modes, ratios from the rounds' own numbers, balanced and plain
at the same loss), and bad input in one line."""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from absl import flags

from experiments.bench import step, step_report
from experiments.lab import step_cases
from experiments.lab.training.config import TrainConfig
from experiments.lab.training.data import (
    corpus_files,
    default_corpus_root,
    load_corpus,
    split_corpus,
)
from models.presets import preset
from tests.experiments.program_runs import run_each
from tests.xla_settings import program_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY_MODEL = {"d_model": 32, "num_layers": 1, "num_heads": 2, "d_ff": 32, "num_experts": 8}
TINY = " ".join(f"--{k}={v}" for k, v in TINY_MODEL.items())
TINY += " --seq_len=32 --min_tokens_per_replica=2 --min_tokens_per_rank=0"
# No evaluation (the benchmark's runs evaluate once, after the last step; its report reads no
# evaluation): a later flag wins over the benchmark's --eval_batches=1, and each run's processes
# compile no evaluation step.
TINY += " --eval_batches=0"


def _bench(args, timeout=900):
    env = program_env()
    return subprocess.run(
        [sys.executable, "-m", "experiments.bench.step", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_rotated_orders_and_logged_steps():
    modes = list(step_cases.MODES)
    assert [step.rotated(modes, r)[0] for r in range(5)] == [*modes, modes[0]]
    assert step_report.logged_steps(40) == ["1", "10", "20", "30", "40"]
    assert step_report.logged_steps(3) == ["1", "2", "3"]


def test_flop_shares_of_the_default_preset():
    """D=128, F=512, E=8, top-2, 2 layers, T=128, V=256, per token forward: attention
    2 x (8 D^2 + 4 T D) = 393216, router 2 x 2 D E = 4096, experts 2 x 2 x 6 D F = 1572864,
    head 2 D V = 65536."""
    shares = step.flop_shares(preset("moe_heavy").model, 128)
    total = 393216 + 4096 + 1572864 + 65536
    assert shares["experts"] == pytest.approx(1572864 / total)
    assert shares["attention"] == pytest.approx(393216 / total)
    assert shares["head"] == pytest.approx(65536 / total) and shares["shared_expert"] == 0
    assert sum(shares.values()) == pytest.approx(1.0)


def _run(ms, loss_shift=0.0):
    return {
        "step_time_s": ms / 1e3,
        "tokens_per_s": 4096 / (ms / 1e3),
        "dropped_pairs": 0,
        "imbalance_before": [1.2, 1.4],
        "imbalance_after": [1.01, 1.01],
        "losses": {"1": 5.0 + loss_shift, "2": 4.0},
        "calibration": None,
    }


def _terms(rank, experts_ms, exchange_ms, wall_ms):
    terms = dict.fromkeys(step_report.TERMS, 0.0)
    terms.update(experts=experts_ms / 1e3, exchange=exchange_ms / 1e3, rest=0.05)
    collectives = dict.fromkeys(step_report.TERMS, 0.0)
    collectives["exchange"] = exchange_ms / 1e3
    outside = wall_ms / 1e3 - sum(terms.values())
    return {
        "rank": rank,
        "steps": 3,
        "wall_s": wall_ms / 1e3,
        "terms_s": terms,
        "collectives_s": collectives,
        "outside_ops_s": outside,
    }


def test_terms_are_the_mean_rank_and_gaps_are_to_the_ideal():
    """Rank 0 busy (experts 150 ms, waits 10 ms), rank 1 idle (experts 110, waits 50): the mean
    rank 130 / 30; a second round's profile and the medians over rounds; gaps by term."""
    busy, idle = _terms(0, 150, 10, 220), _terms(1, 110, 50, 220)
    mean = step_report.mean_terms([busy, idle])
    assert mean["terms_s"]["experts"] == pytest.approx(0.130)
    assert mean["collectives_s"]["exchange"] == pytest.approx(0.030)
    assert mean["wall_s"] == pytest.approx(0.220) and mean["ranks"] == 2
    assert step_report.mean_terms([]) is None
    ideal = step_report.mean_terms([_terms(0, 120, 20, 200), _terms(1, 120, 20, 200)])
    runs = [dict(_run(220), terms=mean), dict(_run(240), terms=mean)]
    runs[1]["terms"] = step_report.mean_terms([_terms(0, 160, 10, 240), _terms(1, 120, 50, 240)])
    summary = step_report.mode_summary(runs)["profile"]
    assert summary["terms_ms"]["experts"] == pytest.approx((130 + 140) / 2)
    assert summary["wall_ms"] == pytest.approx(230) and summary["profiled_steps"] == 3
    assert summary["experts_share"] == pytest.approx(135 / 230)
    modes = {"ideal": step_report.mode_summary([dict(_run(200), terms=ideal)] * 2)}
    modes["plain"] = step_report.mode_summary(runs)
    gaps = step_report.gaps(modes)["plain"]
    assert gaps["experts"] == pytest.approx(135 - 120) and gaps["exchange"] == pytest.approx(10)
    assert sum(gaps.values()) == pytest.approx(230 - 200)
    unprofiled = step_report.mode_summary([_run(220)])
    assert unprofiled["profile"] is None


def test_ratios_are_medians_of_per_round_ratios():
    times = {"ideal": (300, 280, 320), "balanced": (310, 290, 300), "plain": (380, 300, 330)}
    times["plain@1.25"] = (330, 320, 310)
    rounds = [{m: _run(t[r]) for m, t in times.items()} for r in range(3)]
    ratios = step_report.round_ratios(rounds)
    assert ratios["balanced_pct_of_ideal"]["rounds"] == pytest.approx(
        [300 / 310 * 100, 280 / 290 * 100, 320 / 300 * 100]
    )
    assert ratios["balanced_pct_of_ideal"]["median"] == pytest.approx(300 / 310 * 100)
    assert ratios["balanced_x_over_plain"]["median"] == pytest.approx(330 / 300)
    assert ratios["balanced_x_over_plain@1.25"]["median"] == pytest.approx(330 / 310)
    assert ratios["plain_pct_of_ideal"]["median"] == pytest.approx(280 / 300 * 100)
    summary = step_report.mode_summary([r["plain"] for r in rounds])
    assert summary["step_time_s"]["median"] == pytest.approx(0.330)
    assert summary["spread"] == pytest.approx((0.380 - 0.300) / 0.330)
    assert step_report.loss_difference(rounds) == 0.0
    rounds[1]["balanced"] = _run(290, loss_shift=1e-3)
    assert step_report.loss_difference(rounds) == pytest.approx(1e-3)
    assert "balanced_pct_of_ideal" not in step_report.round_ratios([{"plain": _run(1)}])


#: Command lines that end with one ``error:`` line, and a part of it, by id
#: (`test_bad_input_is_one_line`).
BAD_INPUT = {
    "modes": (["--modes=ideal,fast"], "unknown mode fast; expected some of ideal, balanced"),
    "case": (
        ["--train_cases=relu"],
        "unknown case relu; expected some of softmax, sigmoid, skewed",
    ),
    "balance": (["--train_flags=--balance=none"], "sets --balance=none, which the benchmark sets"),
    "data": (["--train_flags=--data=a.txt"], "sets --data=a.txt, which the benchmark sets"),
    "skewed_data": (
        ["--train_cases=skewed", "--data=a.txt"],
        "--data conflicts with case skewed, which",
    ),
    "cases_data": (
        ["--train_cases=softmax,skewed", "--data=a.txt"],
        "--data conflicts with case skewed",
    ),
    "rounds": (["--rounds=0"], "must be >= 1"),
    "cores": ([f"--pinned_ranks={len(os.sched_getaffinity(0)) + 1}"], "cores this process may use"),
}


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory) -> dict:
    """``{id: (run, run_dir)}``: what `python -m experiments.bench.step` printed and exited with
    for each command line of `BAD_INPUT` (`program_runs.run_each`'s record) and its empty
    ``--run_dir``. All in one process: each line goes through the program's own flag parsing
    and ``main`` as when run alone, and a test of a one-line error pays no JAX start of its own
    (one such line runs as a program of its own:
    `test_a_bad_input_ends_the_program_in_one_line`)."""
    base = tmp_path_factory.mktemp("bad_input")
    dirs = {name: base / name for name in BAD_INPUT}
    for folder in dirs.values():
        folder.mkdir()
    argvs = [[*args, f"--run_dir={dirs[name]}"] for name, (args, _) in BAD_INPUT.items()]
    runs = run_each("experiments.bench.step", argvs)
    return {name: (run, dirs[name]) for name, run in zip(BAD_INPUT, runs, strict=True)}


def _one_error_line(code, stderr, message, run_dir):
    assert code == 2, stderr[-2000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], stderr
    assert not any(run_dir.iterdir())


@pytest.mark.xdist_group("test_bench_step_bad_input")
@pytest.mark.parametrize("name", BAD_INPUT)
def test_bad_input_is_one_line(bad_input_runs, name):
    run, run_dir = bad_input_runs[name]
    _one_error_line(run["code"], run["stderr"], BAD_INPUT[name][1], run_dir)


def test_a_bad_input_ends_the_program_in_one_line(tmp_path):
    """`BAD_INPUT`'s ``--rounds=0`` as a program of its own (absl's ``app.run`` around the
    parse, the process's exit); the others run in one process (`bad_input_runs`)."""
    args, message = BAD_INPUT["rounds"]
    proc = _bench([*args, f"--run_dir={tmp_path}"], timeout=120)
    _one_error_line(proc.returncode, proc.stderr, message, tmp_path)


def _train_commands(*argvs: list[str]) -> list[dict[str, list[str]]]:
    """For each of ``argvs``: each case's trainer command line (plain mode) as the benchmark
    builds it from those flags, in one process (the flags parsed afresh for each)."""
    code = (
        "import json, sys; from absl import flags; from experiments.bench import step\n"
        "out = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    flags.FLAGS.unparse_flags(); flags.FLAGS(['step', *argv])\n"
        "    out.append({c: step.train_command(c, 'plain', step.pathlib.Path('w'))\n"
        "                for c in flags.FLAGS.train_cases})\n"
        "print(json.dumps(out))"
    )
    env = program_env()
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(argvs)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_the_skewed_case_reads_its_own_mix_and_the_others_data():
    """skewed: the softmax router on `CASE_DATA`'s glob under this Python's standard library;
    the other cases read --data when given, else the trainer's default corpus (no --data)."""
    mix = str(default_corpus_root() / step_cases.CASE_DATA["skewed"])
    cmds, with_data = _train_commands(
        ["--train_cases=softmax,skewed"], ["--train_cases=softmax,sigmoid", "--data=a.txt"]
    )
    assert [a for a in cmds["skewed"] if a.startswith("--data")] == [f"--data={mix}"]
    assert "--router=softmax" in cmds["skewed"] and "--balance=none" in cmds["skewed"]
    assert not [a for a in cmds["softmax"] if a.startswith("--data")]
    assert all(cmd.count("--data=a.txt") == 1 for cmd in with_data.values())


def test_the_skewed_mix_resolves_to_non_empty_text_files():
    """The mix exists on this Python (a glob under the standard library, not a path of one
    machine), opens with the modules docs/results/step.md names, every file holds bytes, and its
    training part holds 40 default batches (32 x 128 bytes): 40 steps read no byte twice."""
    assert not pathlib.Path(step_cases.CASE_DATA["skewed"]).is_absolute()
    files = corpus_files(str(default_corpus_root() / step_cases.CASE_DATA["skewed"]))
    names = [f.name for f in files]
    assert names[:5] == ["stat.py", "statistics.py", "string.py", "stringprep.py", "struct.py"]
    assert all(f.is_file() and f.suffix == ".py" and f.stat().st_size > 0 for f in files)
    train, _ = split_corpus(load_corpus(files, 2 << 20), 0.02, 128)
    assert train.size > 40 * 32 * 128  # 40 steps read each byte once, as on the whole corpus


def test_profile_steps_take_the_trainers_range_and_need_pinned_ranks():
    """--profile_steps: the trainer's range (at most --steps - 2; the benchmark's own check
    allowed what the trainer refused and the other way round), and only with pinned ranks: on 8
    simulated devices in one process the terms added the devices' work up (3-4x the step)."""
    check = step._check_profile
    assert check({"steps": 4, "profile_steps": 2, "pinned_ranks": 2})
    assert check({"steps": 4, "profile_steps": 0, "pinned_ranks": 0})
    for values, message in [
        ({"steps": 4, "profile_steps": 3}, "--profile_steps=3 must be in [0, 2] with --steps=4"),
        ({"steps": 2, "profile_steps": 1}, "--profile_steps=1 must be in [0, 0] with --steps=2"),
        ({"steps": 4, "profile_steps": -1}, "--profile_steps=-1 must be in [0, 2]"),
    ]:
        with pytest.raises(flags.ValidationError, match=re.escape(message)):
            check({**values, "pinned_ranks": 2})
        with pytest.raises(ValueError, match=re.escape(message)):  # the trainer's own words
            TrainConfig(workdir="w", **values)
    with pytest.raises(flags.ValidationError, match=r"holding 8 devices adds their work up") as e:
        check({"steps": 40, "profile_steps": 3, "pinned_ranks": 0})
    assert "--pinned_ranks=2" in str(e.value) and "--profile_steps=0" in str(e.value)


def test_the_flag_of_the_cases_is_train_cases():
    """A case is a router on a text ("skewed" is a text), not a router: --train_cases, not
    --routers (and not --cases, planner.domains' flag, nor --workloads, sim's and replay's)."""
    assert "train_cases" in flags.FLAGS and "routers" not in flags.FLAGS
    assert flags.FLAGS["train_cases"].name == "train_cases"
    assert flags.FLAGS["train_cases"].default == ["softmax"]


def _one_round_report() -> dict:
    """A report of one case, one round, every mode profiled (hand values, ms)."""
    terms = dict.fromkeys(step_report.TERMS, 0.0) | {"rest": 70.0, "experts": 130.0}
    profile = {"terms_ms": terms, "outside_ops_ms": 20.0}
    modes = {
        m: {"step_time_s": {"median": 0.25, "min": 0.24, "max": 0.26, "rounds": [0.25]}}
        | {"profile": profile}
        for m in step_cases.MODES
    }
    return {"cases": {"softmax": {"modes": modes}}}


def test_the_picture_says_round_and_keeps_its_legend_off_the_title():
    """One case of one round: the panel said "(1 rounds)", and the legend, at the figure's
    top right, lay over the two-line title."""
    fig = step_report.figure(_one_round_report(), "busiest rank's")
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    (ax,) = fig.axes
    assert ax.get_title() == "softmax (1 round)"
    (legend,) = fig.legends
    title = fig._suptitle.get_window_extent(renderer)
    assert not legend.get_window_extent(renderer).overlaps(title)
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels[0] == "median step (unprofiled), min-max" and "experts" in labels


def _check_profiled_run(workdir: pathlib.Path, ranks: int) -> None:
    """A balanced 4-step run of ``ranks`` pinned ranks with --profile_steps=1: the last step is
    marked and left out of the median with the compiling one; each rank wrote its terms, which
    with what lies outside the ops make its profiled step, every stage of the layer among them;
    the traces are removed."""
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [bool(r.get("profiled")) for r in records] == [False, False, False, True]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["timed_steps"] == 2  # steps 2 and 3: not the compiling one, not the traced
    assert summary["median_step_time_s"] == pytest.approx(
        np.median([r["step_time"] for r in records[1:3]]), abs=1e-5
    )
    for rank in range(ranks):
        terms = json.loads((workdir / f"terms_rank{rank}.json").read_text())
        assert terms["steps"] == 1 and terms["rank"] == rank
        split = terms["terms_s"]
        assert sum(split.values()) + terms["outside_ops_s"] == pytest.approx(terms["wall_s"])
        for term in ("rest", "experts", "exchange", "bookkeeping", "planner"):
            assert split[term] > 0, (rank, term)
        assert split["ideal_assignment"] == 0
        assert 0 < terms["collectives_s"]["exchange"] <= split["exchange"]
    rank0 = json.loads((workdir / "terms_rank0.json").read_text())
    assert rank0["wall_s"] == pytest.approx(records[-1]["step_time"], rel=1e-3)
    assert not (workdir / "profile").exists()


@pytest.mark.slow
def test_tiny_run_reports_four_modes_from_its_rounds(tmp_path):
    # The step split into terms needs a device per process: pinned ranks.
    pinned = 2 if len(os.sched_getaffinity(0)) >= 2 else 0
    args = ["--rounds=1", "--steps=4", f"--profile_steps={1 if pinned else 0}", "--batch_size=8"]
    args.append(f"--pinned_ranks={pinned}")
    proc = _bench([*args, f"--train_flags={TINY}", f"--run_dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "a timing reference" in proc.stdout
    assert ("balanced - ideal by term" in proc.stdout) == bool(pinned)
    report = json.loads((tmp_path / "bench_step.json").read_text())
    assert (tmp_path / "bench_step.png").stat().st_size > 0
    case = report["cases"]["softmax"]
    assert list(case["modes"]) == list(step_cases.MODES)
    (raw,) = case["rounds"]
    for name, (a, b, scale) in step_report.RATIOS.items():
        want = raw[a]["step_time_s"] / raw[b]["step_time_s"] * scale
        assert case["ratios"][name]["median"] == pytest.approx(want)
    for mode, summary in case["modes"].items():
        assert summary["step_time_s"]["median"] == raw[mode]["step_time_s"]
        assert summary["losses"] == raw[mode]["losses"]  # 4 steps: all logged
    balanced, plain = raw["balanced"]["losses"], raw["plain"]["losses"]
    np.testing.assert_allclose(list(balanced.values()), list(plain.values()), rtol=1e-5)
    assert case["loss_max_abs_diff_balanced_plain"] == max(
        abs(balanced[s] - plain[s]) for s in plain
    )
    assert all(v == 1.0 for v in case["modes"]["ideal"]["imbalance_before"])
    assert case["modes"]["plain"]["dropped_pairs"] == 0
    # Each mode's step split into terms from its profiled last step: the terms and what lies
    # outside the ops make the profiled wall time; only balanced moves replicas, only the ideal
    # runs the even assignment.
    for mode, summary in case["modes"].items():
        if not pinned:
            assert summary["profile"] is None
            continue
        profile = summary["profile"]
        total = sum(profile["terms_ms"].values()) + profile["outside_ops_ms"]
        assert total == pytest.approx(profile["wall_ms"]), mode
        assert profile["terms_ms"]["experts"] > 0 and profile["terms_ms"]["rest"] > 0
        assert (profile["terms_ms"]["ideal_assignment"] > 0) == (mode == "ideal")
        if mode != "balanced":
            assert profile["terms_ms"]["replica_transfer"] == 0, mode
    if pinned:  # the trainer's own files of a profiled run: what the report above read
        _check_profiled_run(tmp_path / "softmax" / "round0" / "balanced", pinned)
    assert sorted(case["gap_to_ideal_ms"]) == sorted(m for m in step_cases.MODES if m != "ideal")
    tiny = dataclasses.replace(preset("moe_heavy").model, **TINY_MODEL)
    assert report["flop_shares"] == pytest.approx(step.flop_shares(tiny, 32))
    assert (report["calibration"] is not None) == bool(pinned)
    assert report["command"].endswith(f"--run_dir={tmp_path}") and "--rounds=1" in report["command"]
    # --report_only reads the same runs back: the same figures, nothing trained; a round that
    # is not there is an error. Both in one process (`program_runs.run_each`).
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("summary.json")}
    (tmp_path / "bench_step.json").unlink()
    again, missing = run_each(
        "experiments.bench.step",
        [
            [*args, "--report_only", f"--train_flags={TINY}", f"--run_dir={tmp_path}"],
            ["--report_only", "--rounds=2", f"--run_dir={tmp_path}"],
        ],
    )
    assert again["code"] == 0, again["stderr"][-3000:]
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("summary.json")} == before
    reread = json.loads((tmp_path / "bench_step.json").read_text())
    assert reread["cases"]["softmax"]["modes"] == case["modes"]
    assert reread["cases"]["softmax"]["gap_to_ideal_ms"] == case["gap_to_ideal_ms"]
    assert missing["code"] == 1 and "no finished run in" in missing["stderr"]
