"""The model of a trained workdir on a mesh, its jitted prefill and greedy decode.

`experiments.train` writes ``config.json`` (the flags, flat) and orbax checkpoints of the model
and optimizer state; `restore` rebuilds the model of that configuration with any balancer and
reads the newest checkpoint into it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from experiments.lab.training.build import TENSOR_AXIS, place_on_mesh
from experiments.lab.training.checkpoints import Checkpoints
from experiments.lab.training.config import MODEL_FIELDS, TrainConfig
from experiments.lab.training.workdir import CHECKPOINT_DIR, CONFIG_FILE, RunError
from models.moe_lm import MoELM, MoESettings


def read_train_config(workdir: str) -> tuple[pathlib.Path, TrainConfig]:
    """(absolute workdir, the configuration its training run saved).

    Raises:
      RunError: one line naming ``workdir`` when it is missing or holds no training run.
    """
    path = pathlib.Path(workdir).expanduser().absolute()
    if not path.exists():
        raise RunError(f"--workdir={workdir} does not exist")
    if not path.is_dir():
        raise RunError(f"--workdir={workdir} is a file, not a folder written by experiments.train")
    config = path / CONFIG_FILE
    if not config.is_file() or not (path / CHECKPOINT_DIR).is_dir():
        raise RunError(
            f"--workdir={workdir} holds no {CONFIG_FILE} and {CHECKPOINT_DIR}/: not a folder "
            f"written by experiments.train"
        )
    try:
        saved = json.loads(config.read_text())
        if not isinstance(saved, dict):
            raise TypeError("not a JSON object")
        # Fields of earlier versions that this one does not know say nothing about the model.
        known = {f.name for f in dataclasses.fields(TrainConfig)} | set(MODEL_FIELDS)
        return path, TrainConfig.from_flat({k: v for k, v in saved.items() if k in known})
    except (OSError, ValueError, TypeError) as err:
        raise RunError(f"cannot read {config}: {err}") from None


def restore(
    train_cfg: TrainConfig, workdir: pathlib.Path, mesh, settings: MoESettings | None = None
) -> tuple[nnx.State, int]:
    """(the model's state from the workdir's newest checkpoint, its step), placed on ``mesh`` as
    a model of ``settings`` (default: plain EP) lays it out: the experts' hidden width over its
    ``tensor_axis``, if any, whatever split the run that saved it used.

    Raises:
      RunError: the workdir holds no checkpoint, or one of another model shape.
    """
    settings = MoESettings() if settings is None else settings
    model = MoELM(train_cfg.model, mesh, settings, rngs=nnx.Rngs(train_cfg.seed))
    place_on_mesh(model, mesh)
    # A checkpoint holds the optimizer's state too; orbax restores the tree as saved.
    optimizer = nnx.Optimizer(model, optax.adamw(train_cfg.learning_rate), wrt=nnx.Param)
    place_on_mesh(optimizer, mesh)
    checkpoints = Checkpoints(workdir, every=1)
    try:
        if checkpoints.latest_step() is None:
            raise RunError(f"--workdir={workdir} holds no checkpoint yet")
        step = checkpoints.restore(model, optimizer)
    finally:
        checkpoints.close()
    return nnx.state(model), step


def build(train_cfg: TrainConfig, mesh, state, settings: MoESettings) -> MoELM:
    """The workdir's model whose MoE layers run as ``settings`` say (balancer or plain EP,
    buffer, tensor axis, execution), holding ``state`` (from `restore` with the same tensor axis;
    the settings change no parameter)."""
    model = MoELM(train_cfg.model, mesh, settings, rngs=nnx.Rngs(0))
    place_on_mesh(model, mesh)
    nnx.update(model, state)
    return model


def on_mesh(mesh, a: np.ndarray, split: bool) -> jax.Array:
    """``a`` (the same on every process) as a global array: rows split over the mesh axes that
    split tokens (every axis but "tensor", whose ranks see the same tokens), or replicated."""
    spec = P(tuple(n for n in mesh.axis_names if n != TENSOR_AXIS)) if split else P()
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])


def _last_logp(logits, lengths):
    """float32 [B, V]: log-probabilities at each row's last token (row 0's first for empty
    rows)."""
    last = jnp.maximum(lengths - 1, 0)
    at = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    return jax.nn.log_softmax(at.astype(jnp.float32), axis=-1)


def prefill_step(model: MoELM, mesh):
    """jitted ``(tokens [B, T], token_mask [B, T], lengths [B]) -> (next-token ids int32 [B],
    their log-probabilities float32 [B], the MoE stats [layers, ...])``, results replicated (so
    that every process can read them)."""
    graphdef, state = nnx.split(model)
    replicated = NamedSharding(mesh, P())

    @functools.partial(jax.jit, out_shardings=replicated)
    def step(state, tokens, mask, lengths):
        logits, stats = nnx.merge(graphdef, state)(tokens, mask)
        logp = _last_logp(logits, lengths)
        return jnp.argmax(logp, axis=-1).astype(jnp.int32), jnp.max(logp, axis=-1), stats

    return functools.partial(step, state)


def greedy_step(model: MoELM, mesh, new_tokens: int):
    """jitted ``(tokens [B, W], lengths [B]) -> (tokens, lengths)``: ``new_tokens`` greedy steps,
    each appending every non-empty row's most likely next token until the row fills the window
    W. The model keeps no KV cache, so each step runs the whole window (masked past each row's
    length); results replicated."""
    graphdef, state = nnx.split(model)
    replicated = NamedSharding(mesh, P())

    @functools.partial(jax.jit, out_shardings=replicated)
    def run(state, tokens, lengths):
        B, W = tokens.shape
        rows = jnp.arange(B)

        def body(_, carry):
            tokens, lengths = carry
            mask = jnp.arange(W)[None, :] < lengths[:, None]
            logits, _ = nnx.merge(graphdef, state)(tokens, mask)
            nxt = jnp.argmax(_last_logp(logits, lengths), axis=-1).astype(tokens.dtype)
            room = (lengths > 0) & (lengths < W)
            at = jnp.minimum(lengths, W - 1)
            tokens = tokens.at[rows, at].set(jnp.where(room, nxt, tokens[rows, at]))
            return tokens, lengths + room.astype(lengths.dtype)

        return jax.lax.fori_loop(0, new_tokens, body, (tokens, lengths))

    return functools.partial(run, state)


def decode_balancer(balancer: uep.BalancerConfig | None, tokens_per_rank: int):
    """The balancer of the decode steps: ``balancer`` with its fallback threshold above the
    steps' ``tokens_per_rank``, so that they compile plain EP. Without a KV cache each step runs
    the whole window (327 tokens per rank for the shipped prompts, above the default threshold)
    to predict one token per row; a cached decode step would route those new tokens alone, a
    few per rank, which is what the fallback is for. None stays None."""
    if balancer is None:
        return None
    threshold = max(balancer.min_tokens_per_rank, tokens_per_rank + 1)
    return dataclasses.replace(balancer, min_tokens_per_rank=threshold)
