"""What a training run builds, shared with the programs that run its model: the run's mesh
(`make_mesh`), its MoE layers' settings (`moe_settings`), the model placed on the mesh
(`build_model`, `place_on_mesh`) and one training step (`train_step`, for ``nnx.jit``)."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from experiments.lab.training.config import TrainConfig, balancer_options, execution_of
from models.moe_lm import MoELM, MoESettings, next_token_loss

__all__ = ["TENSOR_AXIS", "build_model", "make_mesh", "moe_settings", "place_on_mesh", "train_step"]

#: The mesh axis that splits the experts' hidden width with ``--tensor_size`` > 1.
TENSOR_AXIS = "tensor"


def make_mesh(data_size: int, ep_size: int, tensor_size: int) -> jax.sharding.Mesh:
    """The run's mesh, every axis Auto: (data, expert), and a trailing "tensor" axis when
    ``tensor_size`` > 1 (neighbouring devices share the tokens of one EP rank)."""
    shape, names = (data_size, ep_size), ("data", "expert")
    if tensor_size > 1:
        shape, names = (*shape, tensor_size), (*names, TENSOR_AXIS)
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def moe_settings(cfg: TrainConfig, mesh) -> MoESettings:
    """How the run's MoE layers run on ``mesh`` (`MoESettings`): balanced with ``cfg``'s
    balancer flags (``--slots_per_rank`` ... ``--max_fanout``, ``--ranks_per_domain``), plain,
    or the force-balanced ideal; ``cfg``'s buffer; the experts' hidden width over "tensor" when
    the mesh has that axis; ``--planner`` and ``--transfer_chunks``."""
    balancer = None
    if cfg.balance == "ultraep":
        balancer = uep.BalancerConfig(
            num_experts=cfg.model.num_experts,
            ep_size=mesh.shape["expert"],
            slots_per_rank=cfg.slots_per_rank,
            min_tokens_per_replica=cfg.min_tokens_per_replica,
            balance_eps=cfg.balance_eps,
            min_tokens_per_rank=cfg.min_tokens_per_rank,
            **balancer_options(cfg.max_fanout, cfg.ranks_per_domain),
        )
    return MoESettings(
        balancer,
        cfg.capacity_factor,
        force_balanced=cfg.balance == "ideal",
        tensor_axis=TENSOR_AXIS if TENSOR_AXIS in mesh.axis_names else None,
        execution=execution_of(cfg.planner, cfg.transfer_chunks),
    )


def build_model(cfg: TrainConfig, mesh) -> MoELM:
    """The model of ``cfg`` (`moe_settings`) with every parameter on ``mesh`` (experts split over
    "expert", their hidden width over "tensor" when the mesh has that axis)."""
    model = MoELM(cfg.model, mesh, moe_settings(cfg, mesh), rngs=nnx.Rngs(cfg.seed))
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


def train_step(model, optimizer, batch):
    """One AdamW step of next-token loss on ``batch`` int32 [B, S + 1]: (loss, stats)."""
    (loss, stats), grads = nnx.value_and_grad(next_token_loss, has_aux=True)(model, batch)
    optimizer.update(model, grads)
    model.update_router_biases(stats)  # DeepSeek-V3's bias step from this step's exact loads
    return loss, stats
