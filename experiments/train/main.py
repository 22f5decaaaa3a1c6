"""Train a small MoE language model with exact-load expert balancing fused into the jitted step.

    python -m experiments.train                       # 8 simulated CPU devices, stdlib text
    python -m experiments.train --balance=none --workdir=runs/none
    python -m experiments.train --data='books/*.txt' --steps=2000
    python -m experiments.train --preset=deepseek_v3 --steps=100   # in runs/deepseek_v3
    # EP=2 as two processes pinned to a core each (the wall clock is the busiest rank's):
    python -m experiments.train --pinned_ranks=2 --workdir=runs/pinned
    # two processes x 4 CPU devices on one machine:
    python -m experiments.train --num_processes=2 --process_id=0 --cpu_devices=4 \\
        --coordinator_address=127.0.0.1:12345 &
    python -m experiments.train --num_processes=2 --process_id=1 --cpu_devices=4 \\
        --coordinator_address=127.0.0.1:12345

Writes into ``--workdir`` (printed at the start and at the end; default ``runs/default``, or
``runs/<preset>`` with another ``--preset``, plus ``-<flag>=<value>`` for each model flag given):
``config.json`` (the run's flags), ``metrics.jsonl`` (one record per step), orbax checkpoints
under ``checkpoints/``, and at the end ``metrics.png`` and ``summary.json`` (final losses,
imbalance before/after balancing, dropped pairs, replicas, step time without each start's
compiling step, flags).

Every field of `TrainConfig` is a flag of the same name, and so is every field of its ``model``
(`models.moe_lm.ModelConfig`: ``--vocab_size``, ``--d_model``, ``--num_layers``, ``--num_heads``,
``--d_ff``, ``--num_experts``, ``--top_k``, ``--max_seq_len``); ``--helpshort`` lists them.

Rerunning with the same ``--workdir`` continues from the last checkpoint. The model's flags fix
the shape of the checkpointed state and must then be the same as in ``config.json``; the others
may change (``--steps`` and the intervals silently, the rest, ``--seq_len`` up to
``--max_seq_len`` included, with a note). A workdir already at ``--steps`` is left alone: raise
``--steps`` to train further.

Ctrl-C (SIGINT) or SIGTERM: the run finishes the current step (the message names it), saves a
checkpoint, the metrics, the plot and the summary, says where they are and exits with code 130
(SIGINT) or 143 (SIGTERM); rerunning the same command continues from there. A second Ctrl-C quits
at once; a second SIGTERM is ignored (`timeout` signals the process, then its whole process
group). ``timeout --preserve-status -s TERM 600 python -m experiments.train`` exits with the run's
143 (without ``--preserve-status``, timeout's own 124). A background job started from a shell
script (``python -m experiments.train &``) starts with SIGINT ignored and keeps it so: stop it
with SIGTERM (``kill PID``).

Problems with the flags (unparsable ones included), the data or the workdir end with one line
``error: ...`` (exit code 2); ``--help`` and ``--helpshort`` exit 0.
"""

from __future__ import annotations

import signal
import sys

from absl import flags, logging

from experiments.lab import cli, dataclass_flags
from experiments.lab.devices import force_cpu_devices
from experiments.lab.pinned_ranks import keep_freed_memory, launch_pinned_ranks, start_distributed
from experiments.lab.program import fail, run_main
from experiments.lab.training.config import MODEL_FIELDS, TrainConfig, default_workdir
from models.presets import PRESETS, preset

# Fields whose flag is text that a parser turns into the value (auto, none or a number).
_PARSERS = {"capacity_factor": cli.parse_capacity_factor}
dataclass_flags.define_flags(TrainConfig, _PARSERS)
_DEFAULT_PRESET = "tiny"
flags.DEFINE_enum(
    "preset",
    _DEFAULT_PRESET,
    sorted(PRESETS),
    "Model preset (models/presets.py): its ModelConfig and spare slots per rank are the defaults "
    "that the model flags and --slots_per_rank given on the command line override.",
)
flags.DEFINE_integer(
    "cpu_devices", 8, "Simulated CPU devices per process when there is no accelerator."
)
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process).")
flags.DEFINE_integer("num_processes", 1, "Processes (multi-process).")
flags.DEFINE_integer("process_id", 0, "This process's index (multi-process).")
flags.DEFINE_integer(
    "pinned_ranks",
    0,
    "Run as this many processes started by this command, one CPU device each, each pinned to a "
    "core of its own and at real-time priority where the system allows it (so that the step time "
    "is the busiest rank's, not the total work); they print a calibration line (ranks with equal "
    "work at once / one alone). 0: one process.",
)
_VERBOSE_RANKS = cli.define_verbose_ranks()

FLAGS = flags.FLAGS


def config_from_flags() -> TrainConfig:
    """The run's configuration: the flags given on the command line over the defaults, and over
    the ``--preset``'s model and spare slots; without ``--workdir``, the model's own
    (`default_workdir`). ValueError names a bad flag."""
    chosen = preset(FLAGS.preset)
    given = dataclass_flags.given_values(TrainConfig, _PARSERS)
    given.setdefault("slots_per_rank", chosen.slots_per_rank)
    if "workdir" not in given:
        named = None if FLAGS.preset == _DEFAULT_PRESET else FLAGS.preset
        given["workdir"] = default_workdir(named, {k: given[k] for k in MODEL_FIELDS if k in given})
    return TrainConfig.from_flat(given, chosen.model)


def _start_jax():
    """Sets up devices before JAX first touches a backend."""
    force_cpu_devices(FLAGS.cpu_devices)
    start_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)


def main(argv):
    """Trains with the configuration of the flags; exits 2 with one line ``error: ...`` when the
    flags, the data or the workdir cannot be used, 130 / 143 when stopped by SIGINT / SIGTERM."""
    # Orbax logs every checkpoint step at INFO; keep the run's own output readable.
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.pinned_ranks and FLAGS.num_processes == 1:  # this process only starts the ranks
        try:
            code = launch_pinned_ranks(
                FLAGS.pinned_ranks, "experiments.train", sys.argv[1:], _VERBOSE_RANKS.value
            )
            sys.exit(code)
        except ValueError as err:
            fail(err)
    if FLAGS.num_processes > 1:
        keep_freed_memory()  # a pinned rank: time the step, not the page faults
    try:
        try:  # bad flags end with one line, not a traceback
            cfg = config_from_flags()
            _start_jax()
            import jax

            from experiments.lab.training import data

            cfg.check_devices(jax.device_count())
            cfg.check_process(jax.local_device_count())
            data.corpus_files(cfg.data)
        except (ValueError, TypeError) as err:
            fail(err)
        from experiments.train import trainer

        try:
            result = trainer.run(cfg, calibrate=bool(FLAGS.pinned_ranks))
        except trainer.RunError as err:
            fail(err)
    except KeyboardInterrupt:  # before the run's own handler is in place
        print("interrupted before training started", file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGINT)
    if result["stopped_by"] in ("SIGINT", "SIGTERM"):
        sys.exit(128 + signal.Signals[result["stopped_by"]])
    if result["stopped_by"]:
        sys.exit(128 + signal.SIGINT)


if __name__ == "__main__":
    run_main(main)
