"""The rest of the training step: the trainer's whole step with every routed-experts layer
replaced by nothing, timed as the trainer times a step.

`experiments.bench.rates` times the routed-experts layer (`uep.MoE`: router, dispatch, the
token all-to-alls, the experts, combine, forward + backward) on its own; what a training step of
`experiments.train` adds to its layers is the rest: the embedding, every block's norms and
attention, the final norm, the LM head and the loss, forward + backward, the gradient
all-reduce of the replicated parameters between the ranks, the AdamW update of every parameter
(the experts' included: they stay in the model, with zero gradients) and the host's step
(``nnx.jit``'s dispatch, reading the loss and the stats back). So the step model charges a
step as rest + one `layer_seconds` per layer without counting any part twice.

Shapes: B sequences of S tokens over R ranks, T = B x S / R tokens per rank.
"""

from __future__ import annotations

import time

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from experiments.lab.training import build, layer_stats
from experiments.lab.training.config import TrainConfig
from models.moe_lm import ModelConfig


class WithoutRoutedExperts(nnx.Module):
    """A block's `uep.MoE` replaced by nothing: output 0 and zero stats of the layer's shapes.
    Keeps the layer (its parameters stay in the model, so the optimizer updates them as in the
    real step); the layer's own time is what `experiments.bench.rates` times."""

    def __init__(self, layer: uep.MoE, stats: uep.MoEStats):
        self.layer = layer
        self.shapes = tuple((a.shape, a.dtype) for a in jax.tree.leaves(stats))
        self.treedef = jax.tree.structure(stats)

    def __call__(self, x: jax.Array, token_mask=None) -> tuple[jax.Array, uep.MoEStats]:
        zeros = [jax.numpy.zeros(s, d) for s, d in self.shapes]
        return jax.numpy.zeros_like(x), jax.tree.unflatten(self.treedef, zeros)


def rest_model(model_cfg: ModelConfig, batch_size: int, seq_len: int, seed: int = 0):
    """(model, optimizer, batch): the trainer's model of ``model_cfg`` (plain EP over every
    device, as `build.build_model` places it) with each block's layer swapped for
    `WithoutRoutedExperts`, its AdamW optimizer, and a random batch int32 [B, S + 1] split over
    the devices as the trainer splits it."""
    cfg = TrainConfig(
        balance="none", batch_size=batch_size, seq_len=seq_len, model=model_cfg, seed=seed
    )
    mesh = build.make_mesh(1, jax.device_count(), 1)
    model = build.build_model(cfg, mesh)
    rows = np.random.default_rng(seed).integers(
        0, model_cfg.vocab_size, size=(batch_size, seq_len + 1), dtype=np.int32
    )
    sharding = NamedSharding(mesh, P(("data", "expert")))
    batch = jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])
    x = jax.make_array_from_callback(
        (batch_size, seq_len, model_cfg.d_model),
        sharding,
        lambda index: np.zeros((batch_size, seq_len, model_cfg.d_model), np.float32)[index],
    )
    for block in model.blocks:
        _, stats = block.moe(x)  # once, outside the step: the stats' shapes
        block.moe = WithoutRoutedExperts(block.moe, stats)
    optimizer = nnx.Optimizer(model, optax.adamw(cfg.learning_rate), wrt=nnx.Param)
    build.place_on_mesh(optimizer, mesh)
    return model, optimizer, batch


def rest_seconds(model_cfg: ModelConfig, batch_size: int, seq_len: int, repeats: int) -> dict:
    """The rest's step on this run's ranks (every process runs it): ``seconds`` (median over
    ``repeats`` steps after one that compiles) and ``samples``, each timed as the trainer times
    a step (the jitted step, the loss read back, `layer_stats.layer_record` of the stats)."""
    model, optimizer, batch = rest_model(model_cfg, batch_size, seq_len)
    step = nnx.jit(build.train_step)
    samples = []
    for i in range(repeats + 1):
        begin = time.perf_counter()
        loss, stats = step(model, optimizer, batch)
        float(loss)
        layer_stats.layer_record(stats)
        if i:  # the first compiles
            samples.append(time.perf_counter() - begin)
    return {"seconds": float(np.median(samples)), "samples": samples}
