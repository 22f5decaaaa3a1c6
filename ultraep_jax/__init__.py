"""ultraep_jax: exact-load, real-time expert load balancing for MoE training in JAX."""

from ultraep_jax import reroute
from ultraep_jax.config import BalancerConfig
from ultraep_jax.moe import MoE, MoEStats
from ultraep_jax.planner import Plan, plan
from ultraep_jax.stats import imbalance

__all__ = ["BalancerConfig", "MoE", "MoEStats", "Plan", "plan", "imbalance", "reroute"]
__version__ = "0.1.0"
