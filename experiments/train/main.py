"""Train a small MoE language model with exact-load expert balancing fused into the jitted step.

    python -m experiments.train                       # 8 simulated CPU devices, stdlib text
    python -m experiments.train --balance=none --workdir=runs/none
    python -m experiments.train --data='books/*.txt' --steps=2000
    # two processes x 4 CPU devices on one machine:
    python -m experiments.train --num_processes=2 --process_id=0 --cpu_devices=4 \\
        --coordinator_address=127.0.0.1:12345 &
    python -m experiments.train --num_processes=2 --process_id=1 --cpu_devices=4 \\
        --coordinator_address=127.0.0.1:12345

Writes into ``--workdir`` (printed at the start and at the end): ``config.json`` (the run's flags),
``metrics.jsonl`` (one record per step), orbax checkpoints under ``checkpoints/``, and at the end
``metrics.png`` and ``summary.json`` (final losses, imbalance before/after balancing, dropped
pairs, replicas, step time, flags).

Rerunning with the same ``--workdir`` continues from the last checkpoint. The flags that fix the
shape or meaning of the model (``--d_model``, ``--num_layers``, ``--num_heads``, ``--d_ff``,
``--num_experts``, ``--top_k``, ``--seq_len``) must then be the same as in ``config.json``; the
others may change (``--steps`` and the intervals silently, the rest with a note). A workdir already
at ``--steps`` is left alone: raise ``--steps`` to train further.

Ctrl-C (SIGINT) or SIGTERM: the run finishes the current step, saves a checkpoint, the metrics,
the plot and the summary, says where they are and exits with code 130 (SIGINT) or 143
(SIGTERM); rerunning the same command continues from there. A second Ctrl-C quits at once.

Problems with the flags, the data or the workdir end with one line ``error: ...`` (exit code 2).
"""

from __future__ import annotations

import os
import signal
import sys

from absl import app, flags, logging

from experiments.train.config import TrainConfig, parse_capacity_factor

_D = TrainConfig.__dataclass_fields__

flags.DEFINE_string(
    "workdir", "runs/default", "Output folder (created if needed); rerun with it to continue."
)
flags.DEFINE_string("balance", _D["balance"].default, "Expert load balancing: none or ultraep.")
flags.DEFINE_integer("steps", _D["steps"].default, "Training steps (total, across resumes).")
flags.DEFINE_string(
    "data",
    None,
    "Text files: a path, folder or glob (default: the Python standard library's source files).",
)
flags.DEFINE_integer("max_corpus_bytes", _D["max_corpus_bytes"].default, "Corpus size cap.")
flags.DEFINE_float("eval_fraction", _D["eval_fraction"].default, "Held-out tail of the corpus.")
flags.DEFINE_integer("eval_batches", _D["eval_batches"].default, "Batches per evaluation.")
flags.DEFINE_integer("batch_size", _D["batch_size"].default, "Global batch (sequences).")
flags.DEFINE_integer("seq_len", _D["seq_len"].default, "Sequence length (bytes).")
flags.DEFINE_integer("d_model", _D["d_model"].default, "Model width.")
flags.DEFINE_integer("num_layers", _D["num_layers"].default, "Transformer blocks.")
flags.DEFINE_integer("num_heads", _D["num_heads"].default, "Attention heads.")
flags.DEFINE_integer("d_ff", _D["d_ff"].default, "Expert hidden width.")
flags.DEFINE_integer("num_experts", _D["num_experts"].default, "Experts per MoE layer.")
flags.DEFINE_integer("top_k", _D["top_k"].default, "Experts per token.")
flags.DEFINE_integer("slots_per_rank", _D["slots_per_rank"].default, "Replica slots per rank.")
flags.DEFINE_integer(
    "min_tokens_per_replica",
    _D["min_tokens_per_replica"].default,
    "Least tokens a replica carries.",
)
flags.DEFINE_float("balance_eps", _D["balance_eps"].default, "Balance tolerance over the mean.")
flags.DEFINE_string(
    "capacity_factor",
    _D["capacity_factor"].default,
    "Receive buffer per rank as a multiple of the pairs it routes; pairs beyond it are dropped. "
    "auto: 1.05 with --balance=ultraep (room for the balanced load), dropless with none; "
    "none: dropless (worst-case buffers); or a number.",
)
flags.DEFINE_float("learning_rate", _D["learning_rate"].default, "AdamW learning rate.")
flags.DEFINE_integer("seed", _D["seed"].default, "Initialisation seed.")
flags.DEFINE_integer("ep_size", 0, "Devices on the expert axis (0: all); the rest is data.")
flags.DEFINE_integer("checkpoint_every", _D["checkpoint_every"].default, "Checkpoint interval.")
flags.DEFINE_integer("eval_every", _D["eval_every"].default, "Eval interval.")
flags.DEFINE_integer("print_every", _D["print_every"].default, "Progress line interval.")
flags.DEFINE_bool(
    "profile_loads",
    False,
    "Record per-step, per-layer expert and rank loads before/after balancing to "
    "<workdir>/loads.jsonl.",
)
flags.DEFINE_integer(
    "cpu_devices", 8, "Simulated CPU devices per process when there is no accelerator."
)
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process).")
flags.DEFINE_integer("num_processes", 1, "Processes (multi-process).")
flags.DEFINE_integer("process_id", 0, "This process's index (multi-process).")

FLAGS = flags.FLAGS


def _config() -> TrainConfig:
    """The run's configuration from the flags (ValueError naming a bad flag)."""
    capacity = parse_capacity_factor(FLAGS.capacity_factor)
    names = [f for f in _D if f != "capacity_factor"]
    return TrainConfig(capacity_factor=capacity, **{n: getattr(FLAGS, n) for n in names})


def _start_jax():
    """Sets up devices before JAX first touches a backend."""
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # Only the host (CPU) platform reads this; on an accelerator it changes nothing.
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={FLAGS.cpu_devices}"
        )
    import jax

    if FLAGS.num_processes > 1:
        if not FLAGS.coordinator_address:
            raise ValueError("--coordinator_address is required with --num_processes > 1")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)


def _fail(message) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def main(argv):
    # Orbax logs every checkpoint step at INFO; keep the run's own output readable.
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        try:  # bad flags end with one line, not a traceback
            cfg = _config()
            _start_jax()
            import jax

            from experiments.train import data

            cfg.check_devices(jax.device_count())
            data.corpus_files(cfg.data)
        except ValueError as err:
            _fail(err)
        from experiments.train import trainer

        try:
            result = trainer.run(cfg)
        except trainer.RunError as err:
            _fail(err)
    except KeyboardInterrupt:  # before the run's own handler is in place
        print("interrupted before training started", file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGINT)
    if result["stopped_by"] in ("SIGINT", "SIGTERM"):
        sys.exit(128 + signal.Signals[result["stopped_by"]])
    if result["stopped_by"]:
        sys.exit(128 + signal.SIGINT)


if __name__ == "__main__":
    app.run(main)
