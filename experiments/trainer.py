"""The training loop: model, data, one jitted train step, metrics, checkpoints, plot."""

from __future__ import annotations

import json
import pathlib
import time

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from experiments import data, plot
from experiments.train_config import TrainConfig
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
        self._manager = ocp.CheckpointManager(
            (workdir / "checkpoints").absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every),
        )

    def restore(self, model, optimizer) -> int:
        """Restores the latest checkpoint into model and optimizer; returns its step (0: none)."""
        step = self._manager.latest_step()
        if step is None:
            return 0
        state = {
            "model": nnx.to_pure_dict(nnx.state(model)),
            "opt": nnx.to_pure_dict(nnx.state(optimizer)),
        }
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
        for obj, key in ((model, "model"), (optimizer, "opt")):
            target = nnx.state(obj)
            nnx.replace_by_pure_dict(target, restored[key])
            nnx.update(obj, target)
        return step

    def save(self, step: int, model, optimizer, force: bool = False):
        state = {
            "model": nnx.to_pure_dict(nnx.state(model)),
            "opt": nnx.to_pure_dict(nnx.state(optimizer)),
        }
        self._manager.save(step, args=ocp.args.StandardSave(state), force=force)

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


def _keep_records_up_to(metrics: pathlib.Path, step: int):
    """Drops records past ``step`` (written after the checkpoint a resumed run starts from)."""
    if not metrics.exists():
        return
    kept = [
        line
        for line in metrics.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] <= step
    ]
    metrics.write_text("".join(line + "\n" for line in kept))


def run(cfg: TrainConfig) -> dict:
    """Trains for ``cfg.steps`` steps (continuing from the latest checkpoint in the workdir);
    returns the last metrics record."""
    workdir = pathlib.Path(cfg.workdir)
    lead = jax.process_index() == 0
    data_size, ep_size = cfg.check_devices(jax.device_count())
    mesh = jax.make_mesh(
        (data_size, ep_size), ("data", "expert"), axis_types=(AxisType.Auto, AxisType.Auto)
    )
    files = data.corpus_files(cfg.data)
    train_bytes, eval_bytes = data.split_corpus(
        data.load_corpus(files, cfg.max_corpus_bytes), cfg.eval_fraction, seq_len=cfg.seq_len
    )

    model = build_model(cfg, mesh)
    optimizer = nnx.Optimizer(model, optax.adamw(cfg.learning_rate), wrt=nnx.Param)
    place_on_mesh(optimizer, mesh)
    checkpoints = _Checkpoints(workdir, cfg.checkpoint_every)
    start = checkpoints.restore(model, optimizer)
    metrics = workdir / "metrics.jsonl"
    profile = workdir / "loads.jsonl"
    if lead:
        workdir.mkdir(parents=True, exist_ok=True)
        _keep_records_up_to(metrics, start)
        _keep_records_up_to(profile, start)
        print(
            f"{cfg.balance}: {len(files)} files, {train_bytes.size} train bytes, "
            f"{jax.device_count()} devices as data={data_size} x expert={ep_size}, "
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
    record = {}
    for step in range(start + 1, cfg.steps + 1):
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
        checkpoints.save(step, model, optimizer, force=step == cfg.steps)
    checkpoints.close()
    if lead and metrics.exists():
        plot.plot_metrics(metrics, workdir / "metrics.png")
        print(plot.summarize(metrics), flush=True)
    return record


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
