"""What the programs around the library (experiments/, models/: benchmarks, the simulator, the
replay, the GPU runbook) use from inside it, in one table: each name is re-exported from its home
here, so that a program never reaches into a private or internal module and a move inside the
library changes this table, not the programs. Names are imported when first used (importing this
module loads no kernel, Pallas or Flax module).

Argument checks   `check_int` (one-line TypeError/ValueError naming the value)
Layout            `Layout` (the instance layout of an EP group)
Native planner    `cpu_library` (loads and registers the CPU handler; raises ImportError when the
                  package was installed without building ffi/), `has_cuda_handler`,
                  `library_path` (a native library of the install, or None)
Planner oracle    `exact_plan_exists`, `random_cases` (`ultraep_jax.oracle`: a MILP, needs scipy)
Plan and dispatch `masters_only_plan`, `group_counts`, `plan_dispatch`, `to_groups`,
                  `from_groups`, `combine` (what the layer computes for each rank)
Exchanges         `Exchange`, `ragged_exchange` (the token exchange)
Replicas          `relay_schedule`, `static_hops`, `send_copies`, `hop_copies` (the relay
                  schedule and what it sends, ffi/TRANSFER.md), `fetch_replica_experts`,
                  `experts_with_replicas`
Expert kernels    `local_experts`, `grouped_glu`, `grouped_matmul` (Pallas, Triton),
                  `grouped_matmul_mgpu`, `MgpuTiles` (JAX's Mosaic GPU kernels)

These are the stages' own functions: their docstrings (at their homes) say what they take and
give; they may change with the layer they serve, and the CHANGELOG says when.
"""

import importlib

#: Each name, with the module it lives in.
_HOMES = {
    "check_int": "ultraep_jax._ops",
    "Layout": "ultraep_jax.base.layout",
    "cpu_library": "ultraep_jax.planning.native",
    "has_cuda_handler": "ultraep_jax.planning.native",
    "library_path": "ultraep_jax.planning.native",
    "exact_plan_exists": "ultraep_jax.oracle",
    "random_cases": "ultraep_jax.oracle",
    "masters_only_plan": "ultraep_jax.planning.loads",
    "group_counts": "ultraep_jax.dispatch",
    "plan_dispatch": "ultraep_jax.dispatch",
    "to_groups": "ultraep_jax.dispatch",
    "from_groups": "ultraep_jax.dispatch",
    "combine": "ultraep_jax.dispatch",
    "Exchange": "ultraep_jax.comm.exchange",
    "ragged_exchange": "ultraep_jax.comm",
    "relay_schedule": "ultraep_jax.replicas.relay",
    "static_hops": "ultraep_jax.replicas.relay",
    "send_copies": "ultraep_jax.replicas.relay",
    "hop_copies": "ultraep_jax.replicas.relay",
    "fetch_replica_experts": "ultraep_jax.replicas.transfer",
    "experts_with_replicas": "ultraep_jax.replicas.streaming",
    "local_experts": "ultraep_jax.experts.registry",
    "grouped_glu": "ultraep_jax.experts.registry",
    "grouped_matmul": "ultraep_jax.experts.gmm_pallas",
    "grouped_matmul_mgpu": "ultraep_jax.experts.gmm_mgpu",
    "MgpuTiles": "ultraep_jax.experts.gmm_mgpu",
}


def __getattr__(name: str):
    """The name ``name``, imported from its home (`_HOMES`) on first use."""
    if name not in _HOMES:
        raise AttributeError(f"module 'ultraep_jax.tools' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOMES))


__all__ = list(_HOMES)
