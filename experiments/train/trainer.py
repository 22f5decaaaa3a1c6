"""The training loop: model, data, one jitted train step, metrics, checkpoints, plot.

Its parts: `experiments.lab.training` (the config, data, mesh and model, the run's files and
checkpoints, each step's layer records, which other programs share) and, beside it, `.stop`
(SIGINT / SIGTERM) and `.summary` (what the whole run reports).
"""

from __future__ import annotations

import pathlib
import signal
import time

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.lab import program, records
from experiments.lab.concurrency import concurrency_check, concurrency_line
from experiments.lab.output_files import write_json
from experiments.lab.training import data
from experiments.lab.training.build import build_model, make_mesh, place_on_mesh, train_step
from experiments.lab.training.checkpoints import Checkpoints
from experiments.lab.training.config import IDEAL_NOTE, TrainConfig, one_ep_rank_note
from experiments.lab.training.layer_stats import layer_record, load_profile
from experiments.lab.training.workdir import (
    CONFIG_FILE,
    METRICS_FILE,
    PLOT_FILE,
    PROFILE_FILE,
    SUMMARY_FILE,
    RunError,
    append_json_line,
    check_saved_config,
    check_workdir,
    files_written,
    keep_records_up_to,
    open_workdir,
    workdir_contents,
)
from experiments.train import plot, summary
from experiments.train.step_profile import StepProfile
from experiments.train.stop import StopRequest, in_worker_thread
from models.moe_lm import next_token_loss

__all__ = ["RunError", "run"]


def fallback_note(cfg: TrainConfig, num_devices: int) -> str:
    """`program.fallback_note` when ``cfg`` balances but its batch gives each rank fewer tokens
    than ``--min_tokens_per_rank``, else "". ``num_devices``: the devices tokens are split over
    (the tensor ranks of an EP rank share its tokens)."""
    if cfg.balance != "ultraep":
        return ""
    per_rank = cfg.batch_size * cfg.seq_len // num_devices
    return program.fallback_note(per_rank, cfg.min_tokens_per_rank, "the MoE layers run")


def _mesh_text(mesh) -> str:
    """``data=2 x expert=4`` for a mesh's axes."""
    return " x ".join(f"{name}={size}" for name, size in mesh.shape.items())


def _eval_step(model, batch):
    return next_token_loss(model, batch)[0]


def _load_data(cfg: TrainConfig) -> tuple[list[pathlib.Path], np.ndarray, np.ndarray]:
    """The corpus files and the (train, eval) bytes; RunError naming the data when unusable."""
    source = "the default corpus" if cfg.data is None else f"--data={cfg.data}"
    try:
        files = data.corpus_files(cfg.data)
        corpus = data.load_corpus(files, cfg.max_corpus_bytes)
        train_bytes, eval_bytes = data.split_corpus(corpus, cfg.eval_fraction, seq_len=cfg.seq_len)
    except ValueError as err:
        hint = "; use more text or a smaller --seq_len" if "too small" in str(err) else ""
        raise RunError(f"{source}: {err}{hint}") from None
    return files, train_bytes, eval_bytes


def run(cfg: TrainConfig, calibrate: bool = False) -> dict:
    """Trains for ``cfg.steps`` steps, continuing from the latest checkpoint in the workdir.

    Writes ``config.json`` at the start (and checks it against ``cfg`` when resuming),
    ``metrics.jsonl`` every step, checkpoints, and at the end ``metrics.png`` and
    ``summary.json``. SIGINT / SIGTERM stop the run after the current step with all of these
    written (see `StopRequest`). A workdir already at ``cfg.steps`` is left as it is.
    ``calibrate`` (ranks as pinned processes) first times equal work on every process at once
    against one alone (`concurrency.concurrency_check`), prints it and keeps it in the summary.

    Returns:
      The summary written to ``summary.json`` (see `summary.summarize_run`) plus ``step`` (the
      last step trained), ``steps``, ``finished`` and ``stopped_by`` (the name of the signal that
      stopped the run early, else None). Processes other than the first, and a run that found
      its workdir already finished, return only those four.

    Raises:
      RunError: the data, the workdir or its checkpoints cannot be used (a one-line message).
      ValueError: the devices do not fit ``cfg`` (`TrainConfig.check_devices`,
        `TrainConfig.check_process`; one line), before anything is written.
    """
    lead = jax.process_index() == 0
    data_size, ep_size, tensor_size = cfg.check_devices(jax.device_count())
    cfg.check_process(jax.local_device_count())
    check_workdir(cfg)
    corpus = _load_data(cfg)
    workdir = open_workdir(cfg)
    checkpoints = Checkpoints(workdir, cfg.checkpoint_every)
    stop = StopRequest()
    stop.install()
    try:
        calibration = None
        if calibrate:
            token_devices = jax.device_count() // tensor_size
            rows = cfg.model.top_k * cfg.batch_size * cfg.seq_len // token_devices
            d_ff = cfg.model.d_ff // tensor_size
            calibration = concurrency_check(rows, cfg.model.d_model, d_ff)
            if lead:
                print(concurrency_line(calibration), flush=True)
        return in_worker_thread(
            lambda: _run(
                cfg,
                corpus,
                workdir,
                checkpoints,
                stop,
                lead,
                (data_size, ep_size, tensor_size),
                calibration,
            )
        )
    finally:
        checkpoints.close()
        stop.restore()


def _nothing_to_train(cfg: TrainConfig, workdir, latest: int, lead: bool) -> dict:
    """The result of a run whose workdir already holds ``--steps`` (said on the lead process)."""
    if lead:
        print(
            f"{workdir} already holds step {latest} of --steps={cfg.steps}: nothing to "
            f"train; raise --steps to train further",
            flush=True,
        )
    return {"step": latest, "steps": cfg.steps, "finished": True, "stopped_by": None}


def _open_run(cfg: TrainConfig, workdir, mesh, start: int, changed, num_files: int, size: int):
    """The lead process's start: the config written, records past ``start`` dropped, and the
    run's first lines (the workdir, changed flags, the data and mesh, the notes)."""
    write_json(workdir / CONFIG_FILE, cfg.to_json())
    keep_records_up_to(workdir / METRICS_FILE, start)
    keep_records_up_to(workdir / PROFILE_FILE, start)
    print(f"workdir {workdir}: {workdir_contents(cfg)}", flush=True)
    if changed:
        print(f"note: resuming with changed flags: {', '.join(changed)}", flush=True)
    print(
        f"{cfg.balance}: {num_files} files, {size} train bytes, "
        f"{jax.device_count()} devices as {_mesh_text(mesh)}, "
        f"capacity factor {summary.capacity_text(cfg.capacity_factor)}, "
        f"{'resuming after' if start else 'starting at'} step {start}",
        flush=True,
    )
    token_devices = mesh.shape["data"] * mesh.shape["expert"]
    notes = (
        one_ep_rank_note(cfg, mesh.shape["expert"], jax.device_count()),
        fallback_note(cfg, token_devices),
        cfg.balance == "ideal" and IDEAL_NOTE,
    )
    for note in notes:
        if note:
            print(note, flush=True)


def _batch_placer(mesh):
    """rows int [B, S + 1] -> the global batch over the mesh's (data, expert) devices."""
    batch_sharding = NamedSharding(mesh, P(("data", "expert")))

    def global_batch(rows: np.ndarray) -> jax.Array:
        # Every process holds the whole batch; each device takes its block. With a tensor axis
        # the processes of one EP rank's tensor ranks take the same rows.
        return jax.make_array_from_callback(rows.shape, batch_sharding, lambda index: rows[index])

    return global_batch


def _step_record(cfg: TrainConfig, step: int, start: int, loss, stats, begin: float):
    """(record, seconds): one step's ``metrics.jsonl`` record, its time counted from ``begin``
    to its figures read back."""
    record = {"step": step, "balance": cfg.balance, "loss": float(loss)}
    record.update(layer_record(stats))
    elapsed = time.perf_counter() - begin
    record["step_time"] = round(elapsed, 5)
    record["tokens_per_s"] = round(cfg.batch_size * cfg.seq_len / elapsed, 1)
    if step == start + 1:  # its time includes compiling the step: the summary leaves it out
        record["compiling"] = True
    return record, elapsed


def _log_step(cfg: TrainConfig, workdir, record: dict, stats, start: int) -> None:
    """The lead process's step: its record (and its loads with --profile_loads) appended, and
    the progress line every --print_every steps, at the first and at the last."""
    step = record["step"]
    append_json_line(workdir / METRICS_FILE, record)
    if cfg.profile_loads:
        append_json_line(workdir / PROFILE_FILE, load_profile(step, stats))
    if step % cfg.print_every == 0 or step == cfg.steps or step == start + 1:
        print(summary.progress_line(record), flush=True)


def _stopped_by(step: int, cfg: TrainConfig, stop) -> str | None:
    """What ended the run before ``--steps``: this process's signal or another's; None."""
    if step < cfg.steps and stop.signum is not None:
        return signal.Signals(stop.signum).name
    if step < cfg.steps:  # another process was signalled
        return "signal on another process"
    return None


def _run(cfg, corpus, workdir, checkpoints, stop, lead, mesh_shape, calibration) -> dict:
    latest = checkpoints.latest_step() or 0
    changed = check_saved_config(workdir, cfg) if latest else []
    if latest >= cfg.steps:
        return _nothing_to_train(cfg, workdir, latest, lead)
    files, train_bytes, eval_bytes = corpus

    mesh = make_mesh(*mesh_shape)
    model = build_model(cfg, mesh)
    optimizer = nnx.Optimizer(model, optax.adamw(cfg.learning_rate), wrt=nnx.Param)
    place_on_mesh(optimizer, mesh)
    start = checkpoints.restore(model, optimizer)
    if lead:
        _open_run(cfg, workdir, mesh, start, changed, len(files), train_bytes.size)
    global_batch = _batch_placer(mesh)
    eval_set = [
        global_batch(b)
        for b in data.eval_batches(eval_bytes, cfg.batch_size, cfg.seq_len, cfg.eval_batches)
    ]
    jitted_step = nnx.jit(train_step)
    eval_step = nnx.jit(_eval_step)
    step = saved = start
    profile = StepProfile(workdir, cfg.steps, cfg.profile_steps, start)
    while step < cfg.steps and stop.begins(step + 1):
        step += 1
        batch = global_batch(data.train_batch(train_bytes, step - 1, cfg.batch_size, cfg.seq_len))
        profiled = profile.starts(step)
        begin = time.perf_counter()
        loss, stats = jitted_step(model, optimizer, batch)
        record, elapsed = _step_record(cfg, step, start, loss, stats, begin)
        if profiled:  # traced: slower, left out of the summary's median too
            record["profiled"] = True
            profile.ended(step, elapsed)
        if eval_set and (step % cfg.eval_every == 0 or step == cfg.steps):
            record["eval_loss"] = float(np.mean([float(eval_step(model, b)) for b in eval_set]))
        if lead:
            _log_step(cfg, workdir, record, stats, start)
        if checkpoints.save(step, model, optimizer):
            saved = step
    profile.finish(lambda: jitted_step.lower(model, optimizer, batch).compile().as_text())
    if step > saved:  # the last step, or the step a stop request ended on
        checkpoints.save(step, model, optimizer, force=True)
    checkpoints.wait()
    result = {"step": step, "steps": cfg.steps, "finished": step >= cfg.steps}
    result["stopped_by"] = _stopped_by(step, cfg, stop)
    if not lead:
        return result
    return _report(cfg, workdir, result, start, calibration)


def _report(
    cfg: TrainConfig, workdir: pathlib.Path, result: dict, start: int, calibration: dict | None
) -> dict:
    """Writes the plot and ``summary.json``, prints the summary, how the run ended and its files;
    returns ``result`` with the summary's figures."""
    metrics = workdir / METRICS_FILE
    if metrics.exists() and records.read_step_records(metrics):
        plot.plot_metrics(metrics, workdir / PLOT_FILE)
        result = {**summary.summarize_run(records.read_metrics(metrics), cfg, workdir), **result}
        if calibration is not None:
            result["calibration"] = calibration
        write_json(workdir / SUMMARY_FILE, result)
        print(plot.summarize(metrics), flush=True)
        if calibration is not None and result.get("median_step_time_s") is not None:
            print(
                f"median step {result['median_step_time_s'] * 1e3:.1f} ms on "
                f"{calibration['processes']} pinned ranks; {concurrency_line(calibration)}",
                flush=True,
            )
    step, stopped_by = result["step"], result["stopped_by"]
    if stopped_by and step == start:
        print(f"stopped by {stopped_by} before training a step; nothing new to save", flush=True)
    elif stopped_by:
        print(
            f"stopped by {stopped_by} after step {step} of {cfg.steps}; checkpoint saved: "
            f"rerun the same command to continue",
            flush=True,
        )
    print(files_written(cfg, workdir, step), flush=True)
    return result
