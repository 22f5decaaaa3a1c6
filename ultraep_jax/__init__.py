"""ultraep_jax: exact-load, real-time expert load balancing for MoE training in JAX.

Axis legend, used in docstrings (``[R, E]``) and as suffixes of array names (``loads_RE``):

  B batch    L sequence   D model width   F expert hidden width   T tokens on a device (B * L)
  E experts  K choices per token (top-k)  N pairs on a device (T * K)
  R ranks on the EP axis  E_m = E / R master experts per rank (M in suffixes)
  S spare slots per rank  G = E_m + S local groups per rank   I = E + R * S expert instances
  C receive-buffer rows per rank (the capacity)   P weights of one expert, flattened
"""

from ultraep_jax import reroute
from ultraep_jax.config import BalancerConfig
from ultraep_jax.expert_parallel import ExpertParallel, MoEStats, routed_experts
from ultraep_jax.layer import MoE, RouterBias
from ultraep_jax.planner import Plan, plan
from ultraep_jax.routers import Routing, SigmoidTopK, SoftmaxTopK, update_bias
from ultraep_jax.stats import imbalance

__all__ = [
    "BalancerConfig",
    "ExpertParallel",
    "MoE",
    "MoEStats",
    "Plan",
    "imbalance",
    "plan",
    "reroute",
    "routed_experts",
    "Routing",
    "RouterBias",
    "SigmoidTopK",
    "SoftmaxTopK",
    "update_bias",
]
__version__ = "0.1.0"
