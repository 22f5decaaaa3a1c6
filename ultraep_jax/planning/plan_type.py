"""`Plan`: what the planner gives for one load matrix (`planning.planner.plan`), in a module of
its own so that the stages that read a plan (dispatch, `planning.loads`, routers) import its type,
not the planner."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
    """A balancing plan for one load matrix (a pytree; leading batch axes appear under `vmap`).

    Attributes:
        slot_expert: int32 [R, S], the logical expert held in each spare slot, -1 when empty.
        slot_quota: int32 [R, S], tokens that replica processes (0 when empty).
        master_quota: int32 [E], tokens each expert's master keeps.
        rank_load: int32 [R], tokens each rank processes after balancing.

    For every expert, ``master_quota[e]`` plus the quotas of its replicas equals
    ``sum_r loads[r, e]``.
    """

    slot_expert: jax.Array
    slot_quota: jax.Array
    master_quota: jax.Array
    rank_load: jax.Array

    @property
    def num_replicas(self) -> jax.Array:
        """int32 []: replica instances in the plan (filled slots)."""
        return jnp.sum(self.slot_expert >= 0, axis=(-2, -1), dtype=jnp.int32)
