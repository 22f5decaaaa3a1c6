"""The whole training step against the force-balanced ideal: balanced, plain dropless and plain at
a capped buffer, one model trained from the same seed and data in each mode.

        python -m experiments.bench.step --pinned_ranks=2            # about 10 minutes
        python -m experiments.bench.step --pinned_ranks=2 --train_cases=softmax,sigmoid --rounds=7
        python -m experiments.bench.step --pinned_ranks=2 --train_cases=skewed   # its own text
        python -m experiments.bench.step --pinned_ranks=2 --data='corpus/*.txt' --run_dir=runs/a

Every run is ``python -m experiments.train --pinned_ranks=N`` with its workdir
``<run_dir>/<case>/round<r>/<mode>``, the model of ``--preset`` (default ``moe_heavy``),
``--steps`` steps and one of four modes:

  ideal       --balance=ideal: the force-balanced ideal (every expert the same pairs from every
              rank, 1.05x buffers); a timing reference whose loss is not a model's
  balanced    --balance=ultraep (1.05x buffers)
  plain       --balance=none (dropless: worst-case buffers)
  plain@1.25  --balance=none --capacity_factor=1.25 (fixed-buffer EP: drops the pairs beyond it)

in ``--rounds`` alternated rounds (the order rotates each round, so that a machine slowing down
slows every mode alike). For each training case of ``--train_cases`` (a router on a text):

  softmax     the softmax router on ``--data`` (default: the trainer's corpus, the standard
              library's .py files)
  sigmoid     DeepSeek-V3's sigmoid router with the aux-loss-free bias, on ``--data``
  skewed      the softmax router on a mix of its own (`step_cases.CASE_DATA`): the standard
              library's top-level modules ``s[t-z]*.py``, stat.py to sysconfig.py, of which 40
              steps of 32 x 128 bytes read stat, statistics, string, stringprep (Unicode
              tables), struct and most of subprocess. On this text the router, as it trains,
              sends 76 % / 84 % of its pairs per layer to one EP2 rank (max/mean 1.52 / 1.68
              plain; the whole corpus: 1.22 / 1.35), the largest of the mixes tried
              (docs/results.md: found by measuring, not predicted); ``--data`` with it is an
              error

it reports each mode's busiest-rank median step time (the median over
rounds of each run's median step, with the rounds' min-max), tokens/s, pairs dropped, per-layer
max/mean rank load before -> after (mean over steps), the loss at the same steps; then balanced's
% of the ideal, x over plain and over plain@1.25, and plain's % of the ideal (the headroom), each
the median of per-round ratios; the largest |loss| difference between balanced and plain (the
same math: 0 up to rounding); the experts' share of the step's FLOPs; the calibration line.
With ``--profile_steps=N`` (default 3) each run's last N steps are traced on every rank
(`experiments.train` ``--profile_steps``) and split into terms (`experiments.lab.step_terms`:
planner, bookkeeping, replica transfer, exchange, experts, rest; the mean of the ranks): the
report prints each mode's terms and its gap to the ideal by term. Writes
``<run_dir>/bench_step.json`` and ``<run_dir>/bench_step.png`` (per case, each mode's profiled
step as bars stacked by term, its median unprofiled step as a dot with the rounds' min-max).
``--pinned_ranks=0`` runs each mode on 8 simulated devices in one process (their clock is the
total work of all ranks, not the busiest one's), with ``--profile_steps=0``: a process's profile
adds its devices' work up, so only pinned ranks (a device each) split the step.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import shlex
import shutil
import subprocess
import sys

from absl import flags

from experiments.bench.step_report import (
    calibration_summary,
    case_report,
    mean_terms,
    plot,
    print_case,
)
from experiments.lab import cli
from experiments.lab.output_files import write_json
from experiments.lab.program import run_main
from experiments.lab.records import read_metrics
from experiments.lab.step_cases import CASES, CORPUS_BYTES, MODES, case_data
from experiments.lab.stepmodel.layer import expert_fwd_flops
from experiments.lab.training.config import (
    IDEAL_NOTE,
    MODEL_FIELDS,
    check_profile_devices,
    check_profile_steps,
)
from experiments.lab.training.data import default_corpus_root
from models.moe_lm import ModelConfig

#: Flags the benchmark sets itself: --train_flags may not give them.
_OWN_FLAGS = (
    "balance",
    "capacity_factor",
    "workdir",
    "pinned_ranks",
    "steps",
    "profile_steps",
    "preset",
    "router",
    "data",
)

cli.define_step_case_flags(modes=MODES, cases=["softmax"], rounds=5)
_PROFILE = flags.DEFINE_integer(
    "profile_steps",
    3,
    "The last steps of each run traced to split the step into terms (experiments.train "
    "--profile_steps; left out of the median step time); at most --steps - 2, and only with "
    "--pinned_ranks (one device per process). 0: no split.",
)
_TRAIN_FLAGS = flags.DEFINE_string(
    "train_flags", "", "More experiments.train flags for every run, e.g. '--d_model=64 --top_k=4'."
)
_OUT = flags.DEFINE_string(
    "run_dir", "runs/bench_step", "Run folder (the runs, the JSON, the PNG)."
)
_REPORT_ONLY = flags.DEFINE_bool(
    "report_only",
    False,
    "Train nothing: report the runs already in --run_dir (of the same --train_cases, --modes and "
    "--rounds), e.g. to render a finished benchmark again with this program's report.",
)
#: The flags the JSON records as the run's settings.
_SETTINGS = (
    "pinned_ranks",
    "rounds",
    "steps",
    "profile_steps",
    "preset",
    "batch_size",
    "seed",
    "data",
    "modes",
    "train_cases",
    "train_flags",
)
FLAGS = flags.FLAGS


def _check_train_flags(text: str) -> bool:
    taken = [a for a in shlex.split(text) if a.lstrip("-").split("=")[0] in _OWN_FLAGS]
    if taken:
        raise flags.ValidationError(f"sets {', '.join(taken)}, which the benchmark sets itself")
    return True


def _check_profile(values: dict) -> bool:
    """``--profile_steps`` in the trainer's range (`check_profile_steps`), and only where each
    run's processes hold one device each (`check_profile_devices`: ``--pinned_ranks``; with 0
    the trainer runs 8 simulated devices in one process)."""
    try:
        check_profile_steps(values["profile_steps"], values["steps"])
        check_profile_devices(values["profile_steps"], 1 if values["pinned_ranks"] else 8)
    except ValueError as err:
        raise flags.ValidationError(str(err)) from None
    return True


flags.register_validator("train_flags", _check_train_flags)
flags.register_multi_flags_validator(["steps", "profile_steps", "pinned_ranks"], _check_profile)


def clock_text() -> str:
    """Whose clock the step times are: the busiest pinned rank's, or simulated devices' total."""
    return "busiest rank's" if FLAGS.pinned_ranks else "8 simulated devices' (total work)"


def rotated(names: list[str], offset: int) -> list[str]:
    """``names`` rotated left by ``offset`` (round r runs the modes in this order)."""
    k = offset % len(names)
    return names[k:] + names[:k]


def train_command(case: str, mode: str, workdir: pathlib.Path) -> list[str]:
    """The trainer's command line for one run of ``mode`` in ``case``."""
    steps = FLAGS.steps
    cmd = [sys.executable, "-m", "experiments.train", f"--pinned_ranks={FLAGS.pinned_ranks}"]
    cmd += [f"--workdir={workdir}", f"--preset={FLAGS.preset}", f"--steps={steps}"]
    cmd += [f"--batch_size={FLAGS.batch_size}", f"--seed={FLAGS.seed}", "--eval_batches=1"]
    cmd += [f"--profile_steps={_PROFILE.value}"]
    # Evaluate and checkpoint only after the last step.
    cmd += [f"--eval_every={steps}", f"--checkpoint_every={steps}", f"--print_every={steps}"]
    data = case_data(case, FLAGS.data, default_corpus_root())
    cmd += [f"--max_corpus_bytes={CORPUS_BYTES}"] + ([f"--data={data}"] if data else [])
    return cmd + [*CASES[case], *MODES[mode], *shlex.split(_TRAIN_FLAGS.value)]


def read_run(workdir: pathlib.Path) -> tuple[dict, dict]:
    """One finished run's figures (``step_time_s``, the busiest rank's median step;
    ``tokens_per_s``; ``dropped_pairs``; per-layer mean max/mean ``imbalance_before`` /
    ``_after`` [L]; ``losses`` by step; ``calibration``; ``terms``, the ranks' profiles averaged
    (`step_report.mean_terms`; None unprofiled)) and its flat configuration."""
    summary = json.loads((workdir / "summary.json").read_text())
    records = read_metrics(workdir / "metrics.jsonl")
    run = {
        "step_time_s": summary["median_step_time_s"],
        "tokens_per_s": summary["median_tokens_per_s"],
        "dropped_pairs": summary["dropped_pairs"],
        "imbalance_before": summary["imbalance_before"]["mean"],
        "imbalance_after": summary["imbalance_after"]["mean"],
        "losses": {str(r["step"]): r["loss"] for r in records},
        "calibration": summary.get("calibration"),
        "terms": mean_terms(
            [json.loads(p.read_text()) for p in sorted(workdir.glob("terms_rank*.json"))]
        ),
    }
    return run, summary["config"]


def run_one(case: str, mode: str, workdir: pathlib.Path) -> tuple[dict, dict]:
    """Trains ``mode`` in ``case`` afresh in ``workdir`` (its earlier run removed); `read_run`.
    RuntimeError with the run's last error line when it fails."""
    shutil.rmtree(workdir, ignore_errors=True)
    proc = subprocess.run(train_command(case, mode, workdir), capture_output=True, text=True)
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        raise RuntimeError(f"{case} {mode} in {workdir} failed (exit {proc.returncode}): {last}")
    return read_run(workdir)


def read_finished(case: str, mode: str, workdir: pathlib.Path) -> tuple[dict, dict]:
    """`read_run` of a run already in ``workdir`` (``--report_only``); RuntimeError naming it
    when it has no summary."""
    if not (workdir / "summary.json").exists():
        raise RuntimeError(f"{case} {mode}: no finished run in {workdir} (--report_only)")
    return read_run(workdir)


def run_rounds(out: pathlib.Path) -> tuple[dict[str, list[dict]], dict]:
    """Every case's rounds (each ``{mode: read_run figures}``), the modes rotated each round,
    and the first run's configuration; trained afresh, or read back with ``--report_only``."""
    modes, cases, rounds = list(FLAGS.modes), list(FLAGS.train_cases), FLAGS.rounds
    results, config = {case: [] for case in cases}, None
    for r in range(rounds):
        for case in cases:
            runs = {}
            for mode in rotated(modes, r):
                workdir = out / case / f"round{r}" / mode
                runs[mode], config = (read_finished if _REPORT_ONLY.value else run_one)(
                    case, mode, workdir
                )
                print(
                    f"round {r + 1}/{rounds} {case} {mode}: "
                    f"{runs[mode]['step_time_s'] * 1e3:.1f} ms/step, "
                    f"{runs[mode]['tokens_per_s']:.0f} tok/s",
                    flush=True,
                )
            results[case].append({mode: runs[mode] for mode in modes})
    return results, config


def flop_shares(model: ModelConfig, seq_len: int) -> dict[str, float]:
    """Each part's share of the step's FLOPs (forward per token; the backward is 2x every part's
    forward, so the shares are the step's): attention (projections + the T x T core the model
    computes in full), router, routed experts (top_k SwiGLU rows), shared expert, LM head."""
    d, layers = model.d_model, model.num_layers
    flops = {
        "attention": layers * (8.0 * d * d + 4.0 * seq_len * d),
        "router": layers * 2.0 * d * model.num_experts,
        "experts": layers * expert_fwd_flops(model.top_k, d, model.d_ff),
        "shared_expert": layers * expert_fwd_flops(1, d, model.shared_d_ff),
        "head": 2.0 * d * model.vocab_size,
    }
    total = sum(flops.values())
    return {name: value / total for name, value in flops.items()}


def main(argv):
    """Runs the rounds, prints the report, writes the JSON and the PNG."""
    if len(argv) > 1:
        print(f"error: unexpected arguments: {' '.join(argv[1:])}", file=sys.stderr)
        sys.exit(2)
    out = pathlib.Path(_OUT.value)
    ideal = "ideal" in FLAGS.modes
    if ideal:
        print(IDEAL_NOTE, flush=True)
    try:
        results, config = run_rounds(out)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    model = ModelConfig(**{k: config[k] for k in MODEL_FIELDS})
    report = {
        "command": shlex.join(["python", "-m", "experiments.bench.step", *sys.argv[1:]]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "settings": {name: FLAGS[name].value for name in _SETTINGS},
        "flop_shares": flop_shares(model, config["seq_len"]),
        "cases": {
            case: {
                "data": case_data(case, FLAGS.data, default_corpus_root()),
                **case_report(rounds),
            }
            for case, rounds in results.items()
        },
        "calibration": calibration_summary(results),
        "note": IDEAL_NOTE if ideal else None,
    }
    shares = ", ".join(f"{k} {v:.1%}" for k, v in report["flop_shares"].items() if v)
    print(f"\nthe step's FLOPs by part (from the shapes): {shares}", flush=True)
    for case, data in report["cases"].items():
        print_case(case, data, clock_text(), FLAGS.rounds)
    if report["calibration"]:
        print(report["calibration"]["line"])
    json_path, png_path = out / "bench_step.json", out / "bench_step.png"
    write_json(json_path, report)
    plot(report, png_path, clock_text())
    print(f"wrote {json_path} and {png_path}")
    if ideal:
        print(IDEAL_NOTE)


if __name__ == "__main__":
    run_main(main)
