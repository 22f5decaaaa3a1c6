"""The configuration: what the planner may do (`BalancerConfig`), where routed experts run
(`ExpertParallel`: mesh, axes, sizes, capacity) and how (`Execution`: planner, kernel,
communication backend, transfer chunks, activation); what each name, "auto" included, is on a
platform (`resolve`: the one resolver). Its modules import no kernel or collective
(the package's `__init__`, which an import of this runs first, loads the stages; not Flax)."""

from ultraep_jax.config.balancer import (
    DEFAULT_MIN_TOKENS_PER_RANK,
    MAX_FANOUT,
    MAX_MIN_TOKENS_PER_REPLICA,
    MAX_SLOTS_PER_RANK,
    BalancerConfig,
)
from ultraep_jax.config.execution import Execution
from ultraep_jax.config.expert_parallel import TENSOR_AXIS_NAMES, ExpertParallel

__all__ = [
    "DEFAULT_MIN_TOKENS_PER_RANK",
    "MAX_FANOUT",
    "MAX_MIN_TOKENS_PER_REPLICA",
    "MAX_SLOTS_PER_RANK",
    "BalancerConfig",
    "Execution",
    "ExpertParallel",
    "TENSOR_AXIS_NAMES",
]
