"""ultraep_jax: exact-load, real-time expert load balancing for MoE training in JAX.

Axis legend, used in docstrings (``[R, E]``) and as suffixes of array names (``loads_RE``):

  B batch    L sequence   D model width   F expert hidden width   T tokens on a device (B * L)
  E experts  K choices per token (top-k)  N pairs on a device (T * K)
  R ranks on the EP axis  E_m = E / R master experts per rank (M in suffixes)
  S spare slots per rank  G = E_m + S local groups per rank   I = E + R * S expert instances
  C receive-buffer rows per rank (the capacity)   P weights of one expert, flattened

The stages, one subpackage each, in the order the data takes (`core.routed_experts_local`):
`planning` (loads -> plan), `dispatch` (where each pair goes; the combine), `comm` (the
exchanges), `replicas` (the replica weights), `experts` (the kernels); `config` says where and how.
"""

import importlib
from typing import TYPE_CHECKING

from ultraep_jax import remat
from ultraep_jax.base.activations import ACTIVATIONS, ClampedSwiGLU
from ultraep_jax.config import TENSOR_AXIS_NAMES, BalancerConfig, Execution, ExpertParallel
from ultraep_jax.core import routed_experts_local
from ultraep_jax.dispatch import reroute
from ultraep_jax.exporting import export
from ultraep_jax.ideal import force_balanced
from ultraep_jax.over_mesh import routed_experts
from ultraep_jax.planning.plan_type import Plan
from ultraep_jax.planning.planner import plan
from ultraep_jax.routers import Routing, SigmoidTopK, SoftmaxTopK, TopKSoftmax, update_bias
from ultraep_jax.stats import MoEStats, imbalance

if TYPE_CHECKING:  # imported on first use (`__getattr__`); here for type checkers and editors
    from ultraep_jax.layer import MoE, RouterBias


def __getattr__(name: str):
    """`MoE` and `RouterBias`, imported on first use: their module loads Flax (0.4-0.5 s of
    import, against 60-70 ms for every other module of the package), which a program that uses
    the configuration or the functions alone need not load. Any other name is a submodule's."""
    if name in ("MoE", "RouterBias"):
        from ultraep_jax import layer

        value = getattr(layer, name)
    else:
        try:
            value = importlib.import_module(f"ultraep_jax.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"ultraep_jax.{name}":
                raise
            raise AttributeError(f"module 'ultraep_jax' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


#: The public names, listed once.
__all__ = [
    "ACTIVATIONS",
    "TENSOR_AXIS_NAMES",
    "BalancerConfig",
    "ClampedSwiGLU",
    "Execution",
    "ExpertParallel",
    "export",
    "force_balanced",
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
    "TopKSoftmax",
    "update_bias",
]
__version__ = "0.1.0"
