r"""The whole training step, balanced against the force-balanced ideal, trained side by side in
one pair of pinned ranks.

    python -m experiments.bench.step_pair        # bench.step's three cases, 40 steps, 3 rounds
    python -m experiments.bench.step_pair --train_cases=skewed --steps=20 --rounds=1

`experiments.bench.step` trains each mode as a run of its own, in processes of its own; where a
machine's runs differ by tens of percent from one start to the next (cores shared with other
machines, the processes' placement), that noise hides a gap of a few percent. Here both models of a
case (``--modes``, default the ideal and balanced; `experiments.bench.step`'s modes and cases and
their flags, `experiments.lab.step_cases`) are built in the same ``--pinned_ranks`` processes from
the same seed and train on the same batches, one step of each in turn (the order rotating each
step), each step timed as the trainer times it (the jitted step, the loss read back, the layers'
figures read back). The first step of each model compiles and is left out. Per case and round: each
mode's median step, and every other mode's step over balanced's as the median over steps of that
ratio (the ideal's: balanced's percentage of the ideal; plain's: balanced's speed-up); over rounds,
the median of those. The processes are the same for both modes, so what differs between them is
their programs.
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import numpy as np
import optax
from absl import flags
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.lab import cli, step_cases
from experiments.lab.concurrency import concurrency_check, concurrency_line
from experiments.lab.output_files import write_json
from experiments.lab.pinned_ranks import keep_freed_memory, launch_pinned_ranks, start_distributed
from experiments.lab.program import fail, run_main
from experiments.lab.training import build, data, layer_stats
from experiments.lab.training.config import TrainConfig
from models.presets import preset

FLAGS = flags.FLAGS
cli.define_step_case_flags(modes=["ideal", "balanced"], cases=step_cases.CASES, rounds=3)
_JSON = cli.define_json_out()
_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID = cli.define_rank_flags()


def case_config(case: str, mode: str) -> TrainConfig:
    """The trainer's configuration of ``mode`` in ``case``, as `bench.step` runs it."""
    chosen = preset(FLAGS.preset)
    flat = (*step_cases.CASES[case], *step_cases.MODES[mode])
    given = dict(flag[2:].split("=", 1) for flag in flat)
    values = {
        **given,
        "steps": FLAGS.steps,
        "batch_size": FLAGS.batch_size,
        "seed": FLAGS.seed,
        "max_corpus_bytes": step_cases.CORPUS_BYTES,
        "data": step_cases.case_data(case, FLAGS.data, data.default_corpus_root()),
        "slots_per_rank": chosen.slots_per_rank,
    }
    if "capacity_factor" in values:
        values["capacity_factor"] = cli.parse_capacity_factor(values["capacity_factor"])
    return TrainConfig.from_flat(values, chosen.model)


def _trainer(cfg: TrainConfig, mesh):
    """(step(batch) -> seconds, the layers' figures): one model of ``cfg`` on ``mesh`` with its
    optimizer, stepped as the trainer steps it."""
    model = build.build_model(cfg, mesh)
    optimizer = nnx.Optimizer(model, optax.adamw(cfg.learning_rate), wrt=nnx.Param)
    build.place_on_mesh(optimizer, mesh)
    jitted = nnx.jit(build.train_step)

    def step(batch):
        begin = time.perf_counter()
        loss, stats = jitted(model, optimizer, batch)
        float(loss)
        record = layer_stats.layer_record(stats)
        return time.perf_counter() - begin, record

    return step


def run_case(case: str) -> dict:
    """One round of ``case``: every mode's step times (seconds, the compiling first left out)
    and the last step's max/mean per layer before and after balancing."""
    cfgs = {mode: case_config(case, mode) for mode in FLAGS.modes}
    first = next(iter(cfgs.values()))
    mesh = build.make_mesh(*first.check_devices(jax.device_count()))
    corpus = data.load_corpus(data.corpus_files(first.data), first.max_corpus_bytes)
    train, _ = data.split_corpus(corpus, first.eval_fraction, seq_len=first.seq_len)
    sharding = NamedSharding(mesh, P(("data", "expert")))
    steppers = {mode: _trainer(cfg, mesh) for mode, cfg in cfgs.items()}
    times = {mode: [] for mode in cfgs}
    records = {}
    for i in range(first.steps):
        rows = data.train_batch(train, i, first.batch_size, first.seq_len)
        batch = jax.make_array_from_callback(rows.shape, sharding, lambda at, r=rows: r[at])
        modes = list(cfgs)
        order = modes[i % len(modes) :] + modes[: i % len(modes)]  # each mode first in turn
        for mode in order:
            seconds, records[mode] = steppers[mode](batch)
            if i:  # the first step compiles
                times[mode].append(seconds)
    return {"times": times, "last": records}


def over_balanced(times: dict) -> dict[str, float]:
    """Every other mode's step over balanced's, the median over steps of the same step's ratio
    (the ideal's: balanced's fraction of the ideal; plain's: balanced's speed-up over it)."""
    if "balanced" not in times:
        return {}
    bal = np.asarray(times["balanced"])
    return {m: float(np.median(np.asarray(t) / bal)) for m, t in times.items() if m != "balanced"}


def summarize(case: str, rounds: list[dict]) -> dict:
    """A case's rounds: each mode's median step per round (ms), and every other mode's step
    over balanced's per round (`over_balanced`) with the median over rounds."""
    modes = list(rounds[0]["times"])
    medians = {m: [1e3 * statistics.median(r["times"][m]) for r in rounds] for m in modes}
    ratios = [over_balanced(r["times"]) for r in rounds]
    per_mode = {m: [r[m] for r in ratios] for m in ratios[0]}
    return {
        "case": case,
        "step_ms": medians,
        "last_step": rounds[-1]["last"],
        "over_balanced": per_mode,
        "over_balanced_median": {m: statistics.median(v) for m, v in per_mode.items()},
    }


def report(cases: list[dict], calibration: dict) -> list[str]:
    """The readable lines."""
    lines = [concurrency_line(calibration)]
    for c in cases:
        steps = ", ".join(
            f"{m} {statistics.median(v):.1f} ms [{min(v):.1f}-{max(v):.1f}]"
            for m, v in c["step_ms"].items()
        )
        lines.append(f"case {c['case']}: median step over rounds {steps}")
        for mode, rec in c["last_step"].items():
            before = " ".join(f"{v:.2f}" for v in rec["imbalance_before"])
            after = " ".join(f"{v:.2f}" for v in rec["imbalance_after"])
            lines.append(f"  {mode:9s} max/mean per layer at the last step {before} -> {after}")
        for mode, ratio in c["over_balanced_median"].items():
            rounds = c["over_balanced"][mode]
            if mode == "ideal":
                what = f"balanced % of ideal: {100 * ratio:.1f}"
                each = ", ".join(f"{100 * v:.1f}" for v in rounds)
            else:
                what = f"balanced over {mode}: {ratio:.3f}x"
                each = ", ".join(f"{v:.3f}" for v in rounds)
            lines.append(
                f"  {what} (per round: {each}; each the median over steps of {mode} / balanced)"
            )
    return lines


def main(argv):
    """Starts the pinned rank processes, or (as one of them) trains the cases; the first prints
    and writes ``--json_out``."""
    if len(argv) > 1:
        fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if _NUM_PROCESSES.value == 1:
        if not FLAGS.pinned_ranks:
            fail("--pinned_ranks=0: this benchmark times pinned ranks only (use 2 or more)")
        # The rank processes parse these flags again on one core each: --pinned_ranks=0 there
        # passes the check of the cores (they never launch).
        argv = [*sys.argv[1:], "--pinned_ranks=0"]
        try:
            code = launch_pinned_ranks(FLAGS.pinned_ranks, "experiments.bench.step_pair", argv)
        except ValueError as err:
            fail(err)
        sys.exit(code)
    keep_freed_memory()
    start_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    first = case_config(FLAGS.train_cases[0], FLAGS.modes[0])
    rows = first.model.top_k * first.batch_size * first.seq_len // jax.device_count()
    calibration = concurrency_check(rows, first.model.d_model, first.model.d_ff)
    cases = []
    for case in FLAGS.train_cases:
        rounds = [run_case(case) for _ in range(FLAGS.rounds)]
        cases.append(summarize(case, rounds))
        if jax.process_index() == 0:
            print("\n".join(report(cases[-1:], calibration)[1:]), flush=True)
    if jax.process_index() == 0:
        print(concurrency_line(calibration))
        if _JSON.value:
            write_json(_JSON.value, {"calibration": calibration, "cases": cases})


if __name__ == "__main__":
    run_main(main)
