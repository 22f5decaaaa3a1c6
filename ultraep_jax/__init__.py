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

#: The public names, listed here once (`__all__` is this table's keys), each with the module it
#: lives in (None: a submodule of that name). They are imported when first used, so that importing
#: part of the package (such as `ultraep_jax.config`) loads neither Flax nor any kernel module.
_HOMES = {
    "ACTIVATIONS": "ultraep_jax.base.activations",
    "TENSOR_AXIS_NAMES": "ultraep_jax.config",
    "BalancerConfig": "ultraep_jax.config",
    "ClampedSwiGLU": "ultraep_jax.base.activations",
    "Execution": "ultraep_jax.config",
    "ExpertParallel": "ultraep_jax.config",
    "force_balanced": "ultraep_jax.ideal",
    "MoE": "ultraep_jax.layer",
    "MoEStats": "ultraep_jax.stats",
    "Plan": "ultraep_jax.planning.planner",
    "imbalance": "ultraep_jax.stats",
    "plan": "ultraep_jax.planning.planner",
    "remat": None,
    "reroute": "ultraep_jax.dispatch",
    "routed_experts": "ultraep_jax.over_mesh",
    "routed_experts_local": "ultraep_jax.core",
    "Routing": "ultraep_jax.routers",
    "RouterBias": "ultraep_jax.layer",
    "SigmoidTopK": "ultraep_jax.routers",
    "SoftmaxTopK": "ultraep_jax.routers",
    "TopKSoftmax": "ultraep_jax.routers",
    "update_bias": "ultraep_jax.routers",
}


def __getattr__(name: str):
    """The public name ``name``, imported from its home (`_HOMES`) on first use; any other name
    is a submodule's."""
    home = _HOMES.get(name)
    try:
        value = importlib.import_module(f"ultraep_jax.{name}" if home is None else home)
    except ModuleNotFoundError as e:
        if e.name != f"ultraep_jax.{name}":
            raise
        raise AttributeError(f"module 'ultraep_jax' has no attribute {name!r}") from None
    if home is not None:
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOMES))


__all__ = list(_HOMES)
__version__ = "0.1.0"
