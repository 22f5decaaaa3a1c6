"""ultraep_jax: exact-load, real-time expert load balancing for MoE training in JAX.

Axis legend, used in docstrings (``[R, E]``) and as suffixes of array names (``loads_RE``):

  B batch    L sequence   D model width   F expert hidden width   T tokens on a device (B * L)
  E experts  K choices per token (top-k)  N pairs on a device (T * K)
  R ranks on the EP axis  E_m = E / R master experts per rank (M in suffixes)
  S spare slots per rank  G = E_m + S local groups per rank   I = E + R * S expert instances
  C receive-buffer rows per rank (the capacity)   P weights of one expert, flattened
"""

from ultraep_jax import remat, reroute
from ultraep_jax.activations import ACTIVATIONS
from ultraep_jax.config import TENSOR_AXIS_NAMES, BalancerConfig, ExpertParallel
from ultraep_jax.core import routed_experts_local
from ultraep_jax.expert_parallel import routed_experts
from ultraep_jax.layer import MoE, RouterBias
from ultraep_jax.planner import Plan, plan
from ultraep_jax.routers import Routing, SigmoidTopK, SoftmaxTopK, update_bias
from ultraep_jax.stats import MoEStats, imbalance

__all__ = [
    "ACTIVATIONS",
    "TENSOR_AXIS_NAMES",
    "BalancerConfig",
    "ExpertParallel",
    "MoE",
    "MoEStats",
    "Plan",
    "imbalance",
    "plan",
    "remat",
    "reroute",
    "routed_experts",
    "routed_experts_local",
    "Routing",
    "RouterBias",
    "SigmoidTopK",
    "SoftmaxTopK",
    "update_bias",
]
__version__ = "0.1.0"
