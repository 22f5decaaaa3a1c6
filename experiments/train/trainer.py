"""The training loop: model, data, one jitted train step, metrics, checkpoints, plot."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import threading
import time

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from experiments.train import data, plot
from experiments.train.config import TrainConfig
from models.moe_lm import ModelConfig, MoELM, next_token_loss


def build_model(cfg: TrainConfig, mesh) -> MoELM:
    """The model of ``cfg`` with every parameter on ``mesh`` (experts split over "expert")."""
    model_cfg = ModelConfig(
        d_model=cfg.d_model,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        d_ff=cfg.d_ff,
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        max_seq_len=cfg.seq_len,
    )
    balancer = None
    if cfg.balance == "ultraep":
        balancer = uep.BalancerConfig(
            num_experts=cfg.num_experts,
            ep_size=mesh.shape["expert"],
            slots_per_rank=cfg.slots_per_rank,
            min_tokens_per_replica=cfg.min_tokens_per_replica,
            balance_eps=cfg.balance_eps,
        )
    model = MoELM(model_cfg, mesh, balancer, cfg.capacity_factor, rngs=nnx.Rngs(cfg.seed))
    place_on_mesh(model, mesh)
    return model


def place_on_mesh(obj, mesh):
    """Puts every array of an nnx object on ``mesh``: those already split over it stay, the rest
    are replicated (so jit sees one device set, also after a checkpoint restore)."""
    replicated = NamedSharding(mesh, P())

    def on_mesh(a):
        if isinstance(a.sharding, NamedSharding) and a.sharding.mesh.devices.size == mesh.size:
            return a
        return jax.device_put(a, replicated)

    nnx.update(obj, jax.tree.map(on_mesh, nnx.state(obj)))


def _train_step(model, optimizer, batch):
    (loss, stats), grads = nnx.value_and_grad(next_token_loss, has_aux=True)(model, batch)
    optimizer.update(model, grads)
    return loss, stats


def _eval_step(model, batch):
    return next_token_loss(model, batch)[0]


class _Checkpoints:
    """Orbax checkpoints of the model and optimizer state under ``<workdir>/checkpoints``."""

    def __init__(self, workdir: pathlib.Path, every: int):
        self._dir = (workdir / CHECKPOINT_DIR).absolute()
        self._manager = ocp.CheckpointManager(
            self._dir,
            options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every),
            item_handlers=ocp.StandardCheckpointHandler(),  # lets item_metadata read shapes
        )

    def latest_step(self) -> int | None:
        """The step of the newest checkpoint, None when there is none."""
        return self._manager.latest_step()

    def restore(self, model, optimizer) -> int:
        """Restores the latest checkpoint into model and optimizer; returns its step (0: none).

        Raises:
          RunError: the checkpoint does not fit the model and optimizer (another model shape).
        """
        step = self._manager.latest_step()
        if step is None:
            return 0
        state = {
            "model": nnx.to_pure_dict(nnx.state(model)),
            "opt": nnx.to_pure_dict(nnx.state(optimizer)),
        }
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        mismatches = self._mismatches(step, abstract)
        if mismatches:
            more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
            raise RunError(
                f"the checkpoint of step {step} in {self._dir} does not fit this model: "
                f"{mismatches[0]}{more}; resume with the flags that wrote it or choose another "
                f"--workdir"
            )
        try:
            restored = self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
        except (ValueError, KeyError, TypeError) as err:
            # The first sentence of orbax's message (it names the shapes) is enough.
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            reason = reason.split(". ")[0][:200]
            raise RunError(
                f"the checkpoint of step {step} in {self._dir} does not fit this model "
                f"({reason}); resume with the flags that wrote it or choose another --workdir"
            ) from None
        for obj, key in ((model, "model"), (optimizer, "opt")):
            target = nnx.state(obj)
            nnx.replace_by_pure_dict(target, restored[key])
            nnx.update(obj, target)
        return step

    def _mismatches(self, step: int, abstract) -> list[str]:
        """How the arrays saved at ``step`` differ from ``abstract`` (missing, extra, or of
        another shape), checked on the checkpoint's metadata before restoring anything."""
        try:
            saved = self._manager.item_metadata(step)
        except Exception:  # noqa: BLE001 (unreadable metadata: restoring will say what is wrong)
            return []
        if saved is None:
            return []

        def shapes(tree) -> dict[str, tuple]:
            return {
                "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): tuple(
                    leaf.shape
                )
                for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
                if hasattr(leaf, "shape")
            }

        have, want = shapes(saved), shapes(abstract)
        out = []
        for name in sorted(have.keys() | want.keys()):
            if name not in have:
                out.append(f"{name} is not in the checkpoint")
            elif name not in want:
                out.append(f"the checkpoint holds {name}, which this model does not have")
            elif have[name] != want[name]:
                out.append(f"{name} is {have[name]} there, {want[name]} here")
        return out

    def save(self, step: int, model, optimizer, force: bool = False) -> bool:
        """Saves (in the background) when ``step`` is on the interval or ``force``; returns
        whether it saves."""
        state = {
            "model": nnx.to_pure_dict(nnx.state(model)),
            "opt": nnx.to_pure_dict(nnx.state(optimizer)),
        }
        return self._manager.save(step, args=ocp.args.StandardSave(state), force=force)

    def wait(self):
        """Blocks until every save started so far is on disk."""
        self._manager.wait_until_finished()

    def close(self):
        self._manager.wait_until_finished()
        self._manager.close()


def _layer_record(stats: list[uep.MoEStats]) -> dict:
    stats = jax.device_get(stats)
    return {
        "imbalance_before": [round(float(s.imbalance_before), 5) for s in stats],
        "imbalance_after": [round(float(s.imbalance_after), 5) for s in stats],
        "dropped": [int(s.dropped) for s in stats],
        "replicas": [int(s.replicas) for s in stats],
    }


def _load_profile(step: int, stats: list[uep.MoEStats]) -> dict:
    """Per-layer loads of one step for `<workdir>/loads.jsonl` (the load profiler)."""
    stats = jax.device_get(stats)
    return {
        "step": step,
        "layers": [
            {
                "expert_load": np.asarray(s.expert_load).tolist(),
                "rank_load_before": np.asarray(s.rank_load_before).tolist(),
                "rank_load_after": np.asarray(s.rank_load_after).tolist(),
                "replicas": int(s.replicas),
                "dropped": int(s.dropped),
            }
            for s in stats
        ],
    }


def _keep_records_up_to(path: pathlib.Path, step: int):
    """Drops records past ``step`` (written after the checkpoint a resumed run starts from), and
    any line a killed run left half-written."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record["step"] <= step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))


# --------------------------------------------------------------------------------------------
# Workdir, saved configuration, stop requests
# --------------------------------------------------------------------------------------------


class RunError(ValueError):
    """A problem with the run's inputs (data, workdir, checkpoints) that the user can fix; the
    message is one line. `experiments.train` prints it as ``error: ...``."""


def _check_workdir(cfg: TrainConfig) -> pathlib.Path:
    """The absolute workdir; RunError when it is a file (checked before anything is written)."""
    workdir = pathlib.Path(cfg.workdir).expanduser().absolute()
    if workdir.exists() and not workdir.is_dir():
        raise RunError(f"--workdir={cfg.workdir} is a file, not a folder; choose another --workdir")
    return workdir


def _open_workdir(cfg: TrainConfig) -> pathlib.Path:
    """The absolute workdir, created if needed; RunError when it cannot be used."""
    workdir = _check_workdir(cfg)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunError(f"cannot create --workdir={cfg.workdir}: {err.strerror or err}") from None
    if not os.access(workdir, os.W_OK | os.X_OK):
        raise RunError(f"--workdir={cfg.workdir} is not writable")
    return workdir


def _check_saved_config(workdir: pathlib.Path, cfg: TrainConfig) -> list[str]:
    """Compares ``cfg`` with the workdir's ``config.json`` (when there is one).

    Returns the changed flags that do not block resuming; raises RunError naming the flags whose
    change makes the workdir's checkpoints unusable.
    """
    path = workdir / CONFIG_FILE
    if not path.exists():
        return []
    try:
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict):
            raise TypeError("not a JSON object")
    except (OSError, ValueError, TypeError) as err:
        raise RunError(f"cannot read {path}: {err}") from None
    blocking, changed = cfg.compare_saved(saved)
    if blocking:
        raise RunError(
            f"--workdir={cfg.workdir} holds checkpoints of a different model: "
            f"{', '.join(blocking)}; resume with the same values or choose another --workdir"
        )
    return changed


def _write_json(path: pathlib.Path, obj):
    """Writes ``obj`` as indented JSON, atomically (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


class StopRequest:
    """Turns SIGINT / SIGTERM into a request to stop after the current step.

    The first signal sets `signum` (the loop then saves a checkpoint, the metrics, the plot and
    the summary, and ends) and puts both signals back to their default action, so a second one
    ends the process at once, whatever it is doing.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def __call__(self, signum, frame=None):
        del frame
        self.signum = signum
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        name = signal.Signals(signum).name
        # os.write, not print: a handler may run in the middle of another print.
        os.write(
            2,
            f"\n{name}: stopping after this step to save a checkpoint, the metrics and the plot "
            f"(press Ctrl-C again to quit at once without saving)\n".encode(),
        )

    def install(self):
        """Installs the handler (only the main thread can; elsewhere this does nothing)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self)

    def restore(self):
        """Puts back the handlers that `install` replaced."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed(self) -> bool:
        """Whether to stop now: on several processes, when any of them got a signal (they all
        must stop at the same step, or the others would wait for it in the next step)."""
        local = self.signum is not None
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        return bool(np.max(multihost_utils.process_allgather(np.int32(local))))


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
SUMMARY_FILE = "summary.json"
PROFILE_FILE = "loads.jsonl"
CHECKPOINT_DIR = "checkpoints"


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


def run(cfg: TrainConfig) -> dict:
    """Trains for ``cfg.steps`` steps, continuing from the latest checkpoint in the workdir.

    Writes ``config.json`` at the start (and checks it against ``cfg`` when resuming),
    ``metrics.jsonl`` every step, checkpoints, and at the end ``metrics.png`` and
    ``summary.json``. SIGINT / SIGTERM stop the run after the current step with all of these
    written (see `StopRequest`). A workdir already at ``cfg.steps`` is left as it is.

    Returns:
      The summary written to ``summary.json`` (see `summarize_run`) plus ``step`` (the last step
      trained), ``steps``, ``finished`` and ``stopped_by`` (the name of the signal that stopped
      the run early, else None). Processes other than the first, and a run that found its
      workdir already finished, return only those four.

    Raises:
      RunError: the data, the workdir or its checkpoints cannot be used (a one-line message).
    """
    lead = jax.process_index() == 0
    data_size, ep_size = cfg.check_devices(jax.device_count())
    _check_workdir(cfg)
    corpus = _load_data(cfg)
    workdir = _open_workdir(cfg)
    checkpoints = _Checkpoints(workdir, cfg.checkpoint_every)
    stop = StopRequest()
    stop.install()
    try:
        return _in_worker_thread(
            lambda: _run(cfg, corpus, workdir, checkpoints, stop, lead, data_size, ep_size)
        )
    finally:
        checkpoints.close()
        stop.restore()


def _in_worker_thread(fn):
    """Calls ``fn`` in another thread while the main thread waits, and returns its result (or
    raises its exception).

    Python runs signal handlers in the main thread between bytecodes only: a main thread busy in
    a long XLA call (compiling a step can take a minute) would answer Ctrl-C only when the call
    returns. Waiting here instead, it answers at once (the message, and a second Ctrl-C ends the
    process). Off the main thread (no handlers there), ``fn`` simply runs here.
    """
    if threading.current_thread() is not threading.main_thread():
        return fn()
    outcome = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as err:  # noqa: BLE001 (re-raised in the caller's thread)
            outcome["error"] = err

    worker = threading.Thread(target=target, name="train-loop", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _run(cfg, corpus, workdir, checkpoints, stop, lead, data_size, ep_size) -> dict:
    latest = checkpoints.latest_step() or 0
    changed = _check_saved_config(workdir, cfg) if latest else []
    if latest >= cfg.steps:
        if lead:
            print(
                f"{workdir} already holds step {latest} of --steps={cfg.steps}: nothing to "
                f"train; raise --steps to train further",
                flush=True,
            )
        return {"step": latest, "steps": cfg.steps, "finished": True, "stopped_by": None}
    files, train_bytes, eval_bytes = corpus

    mesh = jax.make_mesh(
        (data_size, ep_size), ("data", "expert"), axis_types=(AxisType.Auto, AxisType.Auto)
    )
    model = build_model(cfg, mesh)
    optimizer = nnx.Optimizer(model, optax.adamw(cfg.learning_rate), wrt=nnx.Param)
    place_on_mesh(optimizer, mesh)
    start = checkpoints.restore(model, optimizer)
    metrics = workdir / METRICS_FILE
    profile = workdir / PROFILE_FILE
    if lead:
        _write_json(workdir / CONFIG_FILE, cfg.to_json())
        _keep_records_up_to(metrics, start)
        _keep_records_up_to(profile, start)
        print(f"workdir {workdir}: {_workdir_contents(cfg)}", flush=True)
        if changed:
            print(f"note: resuming with changed flags: {', '.join(changed)}", flush=True)
        print(
            f"{cfg.balance}: {len(files)} files, {train_bytes.size} train bytes, "
            f"{jax.device_count()} devices as data={data_size} x expert={ep_size}, "
            f"capacity factor {_capacity_text(cfg.capacity_factor)}, "
            f"{'resuming after' if start else 'starting at'} step {start}",
            flush=True,
        )

    batch_sharding = NamedSharding(mesh, P(("data", "expert")))

    def global_batch(rows: np.ndarray) -> jax.Array:
        local = data.process_slice(rows, jax.process_index(), jax.process_count())
        return jax.make_array_from_process_local_data(batch_sharding, local, rows.shape)

    eval_set = [
        global_batch(b)
        for b in data.eval_batches(eval_bytes, cfg.batch_size, cfg.seq_len, cfg.eval_batches)
    ]
    train_step = nnx.jit(_train_step)
    eval_step = nnx.jit(_eval_step)
    step = saved = start
    while step < cfg.steps and not stop.agreed():
        step += 1
        batch = global_batch(data.train_batch(train_bytes, step - 1, cfg.batch_size, cfg.seq_len))
        begin = time.perf_counter()
        loss, stats = train_step(model, optimizer, batch)
        record = {"step": step, "balance": cfg.balance, "loss": float(loss), **_layer_record(stats)}
        elapsed = time.perf_counter() - begin
        record["step_time"] = round(elapsed, 5)
        record["tokens_per_s"] = round(cfg.batch_size * cfg.seq_len / elapsed, 1)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            record["eval_loss"] = float(np.mean([float(eval_step(model, b)) for b in eval_set]))
        if lead:
            with metrics.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if cfg.profile_loads:
                with profile.open("a") as f:
                    f.write(json.dumps(_load_profile(step, stats)) + "\n")
            if step % cfg.print_every == 0 or step == cfg.steps or step == start + 1:
                print(_progress_line(record), flush=True)
        if checkpoints.save(step, model, optimizer):
            saved = step
    if step > saved:  # the last step, or the step a stop request ended on
        checkpoints.save(step, model, optimizer, force=True)
    checkpoints.wait()
    stopped_by = None
    if step < cfg.steps and stop.signum is not None:
        stopped_by = signal.Signals(stop.signum).name
    elif step < cfg.steps:  # another process was signalled
        stopped_by = "signal on another process"
    result = {"step": step, "steps": cfg.steps, "finished": step >= cfg.steps}
    result["stopped_by"] = stopped_by
    if not lead:
        return result
    if metrics.exists() and plot.read_step_records(metrics):
        plot.plot_metrics(metrics, workdir / PLOT_FILE)
        summary = {**summarize_run(plot.read_metrics(metrics), cfg, workdir), **result}
        _write_json(workdir / SUMMARY_FILE, summary)
        print(plot.summarize(metrics), flush=True)
    else:
        summary = result
    if stopped_by and step == start:
        print(f"stopped by {stopped_by} before training a step; nothing new to save", flush=True)
    elif stopped_by:
        print(
            f"stopped by {stopped_by} after step {step} of {cfg.steps}; checkpoint saved: "
            f"rerun the same command to continue",
            flush=True,
        )
    print(_files_written(cfg, workdir, step), flush=True)
    return summary


def _capacity_text(capacity_factor: float | None) -> str:
    return "none (dropless)" if capacity_factor is None else f"{capacity_factor:g}"


def _workdir_contents(cfg: TrainConfig) -> str:
    """What the run writes in its workdir (for the line printed at the start)."""
    during = [CONFIG_FILE, METRICS_FILE] + ([PROFILE_FILE] if cfg.profile_loads else [])
    return (
        f"{', '.join(during)} and {CHECKPOINT_DIR}/ as it goes, "
        f"{PLOT_FILE} and {SUMMARY_FILE} at the end"
    )


def _files_written(cfg: TrainConfig, workdir: pathlib.Path, step: int) -> str:
    """The closing lines: every file of the run, with what it holds."""
    rows = [
        (CONFIG_FILE, "the run's flags (checked when resuming)"),
        (METRICS_FILE, "one JSON record per step"),
        (PLOT_FILE, "loss and max/mean rank load per layer"),
        (SUMMARY_FILE, "final losses, imbalance, dropped pairs, replicas, step time, flags"),
    ]
    if cfg.profile_loads:
        rows.append((PROFILE_FILE, "per-step, per-layer loads (experiments.train.viewer)"))
    rows.append((CHECKPOINT_DIR + "/", f"step {step}; rerun with this --workdir to continue"))
    rows = [(name, what) for name, what in rows if (workdir / name).exists()]
    width = max(len(name) for name, _ in rows)
    return "\n".join([f"files in {workdir}:"] + [f"  {n:<{width}}  {w}" for n, w in rows])


def summarize_run(records: list[dict], cfg: TrainConfig, workdir: pathlib.Path) -> dict:
    """The figures of ``summary.json`` from the metrics records of every step so far.

    Keys: ``final_loss`` and ``final_eval_loss`` (with ``final_eval_step``); per layer, the mean
    and max over steps of the max/mean rank load before and after balancing
    (``imbalance_before`` / ``imbalance_after`` = ``{"mean": [L], "max": [L]}``);
    ``dropped_pairs`` (total over steps and layers); ``mean_replicas`` (replicas summed over
    layers, mean over steps) and ``mean_replicas_per_layer``; ``median_step_time_s`` and
    ``median_tokens_per_s`` (the median, because the first step of each start includes
    compilation); ``metrics_steps`` (steps with a record); ``workdir``; ``config``.
    """
    last = records[-1]
    evals = [r for r in records if r.get("eval_loss") is not None]

    def per_layer(key: str) -> np.ndarray:
        return np.asarray([r[key] for r in records if key in r], dtype=np.float64)

    summary = {
        "workdir": str(workdir),
        "balance": cfg.balance,
        "final_loss": last["loss"],
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "final_eval_step": evals[-1]["step"] if evals else None,
    }
    for key in ("imbalance_before", "imbalance_after"):
        values = per_layer(key)
        summary[key] = {
            "mean": [round(float(v), 5) for v in values.mean(axis=0)] if values.size else [],
            "max": [round(float(v), 5) for v in values.max(axis=0)] if values.size else [],
        }
    replicas = per_layer("replicas")
    summary["dropped_pairs"] = int(per_layer("dropped").sum())
    summary["mean_replicas"] = round(float(replicas.sum(axis=1).mean()), 3) if replicas.size else 0
    summary["mean_replicas_per_layer"] = (
        [round(float(v), 3) for v in replicas.mean(axis=0)] if replicas.size else []
    )
    times = [r["step_time"] for r in records if "step_time" in r]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    summary["median_step_time_s"] = round(float(np.median(times)), 5) if times else None
    summary["median_tokens_per_s"] = round(float(np.median(speeds)), 1) if speeds else None
    summary["metrics_steps"] = len(records)
    summary["config"] = cfg.to_json()
    return summary


def _progress_line(r: dict) -> str:
    layers = " ".join(
        f"{b:.2f}->{a:.2f}" for b, a in zip(r["imbalance_before"], r["imbalance_after"])
    )
    line = (
        f"step {r['step']:5d}  loss {r['loss']:.4f}  {r['tokens_per_s']:8.0f} tok/s  "
        f"max/mean per layer {layers}  dropped {sum(r['dropped'])}  "
        f"replicas {sum(r['replicas'])}"
    )
    if "eval_loss" in r:
        line += f"  eval {r['eval_loss']:.4f}"
    return line
