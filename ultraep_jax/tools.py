"""`ultraep_jax.tools`: the library's internal functions that the programs around it
(experiments/, models/: benchmarks, the simulator, the replay, the GPU runbook) call, re-exported
from their homes. A program imports only `ultraep_jax`, `ultraep_jax.config` and this module
(tests/test_imports.py checks it), so it never reaches into a private or internal module, and a
move inside the library changes these imports, not the programs. Importing it loads no Pallas,
Mosaic, tokamax or Flax module (the kernel modules import theirs when a kernel is traced).

Argument checks   `check_int` (one-line TypeError/ValueError naming the value)
Layout            `Layout` (the instance layout of an EP group)
Native planner    `cpu_library` (loads and registers the CPU handler; raises ImportError when the
                  package was installed without building ffi/), `has_cuda_handler`,
                  `library_path` (a native library of the install, or None)
Planner oracle    `exact_plan_exists`, `random_cases` (`ultraep_jax.oracle`: a MILP, needs scipy)
Plan and dispatch `masters_only_plan`, `group_counts`, `plan_dispatch`, `to_groups`,
                  `from_groups`, `combine` (what the layer computes for each rank)
Exchanges         `Exchange`, `exchange_by_backend` (the token exchange, by backend)
Replicas          `relay_schedule`, `static_hops`, `send_copies`, `hop_copies` (the relay
                  schedule and what it sends, ffi/TRANSFER.md), `fetch_replica_experts`,
                  `experts_with_replicas`
Expert kernels    `local_experts`, `grouped_glu`, `grouped_matmul_mgpu`, `MgpuTiles` (JAX's
                  Mosaic GPU kernels), `grouped_matmul_tokamax` (tokamax's ragged dot)
XLA:GPU, no GPU   `compile_only_mesh`, `compile_only_devices` (compile-only GPUs of the CUDA
                  plugin, one node or nodes of 8: `topology_name`), `target_config`,
                  `cuda_plugin`, `DEVICE_KINDS` (`ultraep_jax.deviceless`)

These are the stages' own functions: their docstrings (at their homes) say what they take and
give; they may change with the layer they serve, and the CHANGELOG says when.
"""

from ultraep_jax.base.arguments import check_int
from ultraep_jax.base.layout import Layout
from ultraep_jax.comm import exchange_by_backend
from ultraep_jax.comm.exchange import Exchange
from ultraep_jax.deviceless import (
    DEVICE_KINDS,
    compile_only_devices,
    compile_only_mesh,
    cuda_plugin,
    target_config,
    topology_name,
)
from ultraep_jax.dispatch import combine, from_groups, group_counts, plan_dispatch, to_groups
from ultraep_jax.experts.gmm_mgpu import MgpuTiles, grouped_matmul_mgpu
from ultraep_jax.experts.gmm_tokamax import grouped_matmul_tokamax
from ultraep_jax.experts.registry import grouped_glu, local_experts
from ultraep_jax.oracle import exact_plan_exists, random_cases
from ultraep_jax.planning.loads import masters_only_plan
from ultraep_jax.planning.native import cpu_library, has_cuda_handler, library_path
from ultraep_jax.replicas.relay import hop_copies, relay_schedule, send_copies, static_hops
from ultraep_jax.replicas.streaming import experts_with_replicas
from ultraep_jax.replicas.transfer import fetch_replica_experts

__all__ = [
    "check_int",
    "Layout",
    "cpu_library",
    "has_cuda_handler",
    "library_path",
    "exact_plan_exists",
    "random_cases",
    "masters_only_plan",
    "group_counts",
    "plan_dispatch",
    "to_groups",
    "from_groups",
    "combine",
    "Exchange",
    "exchange_by_backend",
    "relay_schedule",
    "static_hops",
    "send_copies",
    "hop_copies",
    "fetch_replica_experts",
    "experts_with_replicas",
    "local_experts",
    "grouped_glu",
    "grouped_matmul_mgpu",
    "MgpuTiles",
    "grouped_matmul_tokamax",
    "compile_only_mesh",
    "compile_only_devices",
    "target_config",
    "cuda_plugin",
    "DEVICE_KINDS",
    "topology_name",
]
