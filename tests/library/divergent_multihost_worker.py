"""One of two JAX processes (4 CPU devices each, gloo collectives) that are the two EP groups
of a data=2 x expert=4 mesh: process g holds the tokens of data row g. Process 1's tokens are all
padding (``token_mask``), so the groups' plans differ (group 0 replicates, group 1 has no
replica: `test_divergent_plans.py`'s "masked_group"), the case that hung before the replica
weights were typed varying over "data" ahead of the plan's branch. The balanced layer's value
and gradients must finish, and each process compares what it holds (its rows of y and d/dx,
every parameter's gradient, the stats) with the single-process run of the same case, which the
test computed and checked against plain EP and the dense reference.

    python tests/library/divergent_multihost_worker.py COORDINATOR_ADDRESS PROCESS_ID RESULTS

RESULTS: an .npz of the single-process run (`tests.helpers.divergent.save_run`).
Run by `test_divergent_plans.py`; exits 0 when every check passes."""

from __future__ import annotations

import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def place_rows(mesh, value: np.ndarray) -> jax.Array:
    """``value`` [B, ...] (the same in both processes) split over the batch as
    `helpers.place_batch` splits it, each process filling only its own devices' shards."""
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def held(a: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """(values, bool mask of the entries this process holds) of ``a``, global shape."""
    out, seen = np.zeros(a.shape, a.dtype), np.zeros(a.shape, bool)
    for shard in a.addressable_shards:
        out[shard.index], seen[shard.index] = np.asarray(shard.data), True
    return out, seen


def main(address: str, process_id: int, results: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, 2, process_id)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    from tests.helpers import divergent as dp
    from tests.helpers import layer_cases as lc

    mesh = dp.divergent_mesh("data")
    for g in range(dp.GROUPS):  # data row g is process g's devices
        assert {d.process_index for d in mesh.devices[g]} == {g}, mesh.devices

    case = dp.DIVERGENCES["masked_group"]
    x, params, cot, mask = case.inputs()
    rows = slice(process_id * dp.BATCH // dp.GROUPS, (process_id + 1) * dp.BATCH // dp.GROUPS)
    assert mask[rows].all() if process_id == 0 else not mask[rows].any()
    loads = dp.group_loads(x, params["router_kernel"], mask)
    plans = dp.group_plans(loads, case.balancer, dp.CAPACITY)
    dp.assert_plans_differ(case.name, loads, plans, case.balancer)

    y, stats, gx, grads = dp.layer_arrays(
        "data", case.balancer, x, params, cot, mask, place=place_rows
    )
    stats = lc.to_numpy_stats(jax.tree.map(lambda a: held(a)[0], stats))
    dp.assert_stats_of_groups(stats, loads, plans, case.balancer)
    want_y, want_stats, want_gx, want_grads = dp.load_run(results)
    for name, value in stats.items():
        lc.assert_close(value, want_stats[name], f"process {process_id}: stats.{name}")
    for what, got, want in (("y", y, want_y), ("d/dx", gx, want_gx)):
        value, seen = held(got)
        assert seen[rows].all() and seen.sum() == seen[rows].sum(), what
        lc.assert_close(value[rows], want[rows], f"process {process_id}: {what}")
    for name in lc.PARAM_NAMES:
        value, seen = held(grads[name])
        assert seen.all(), name
        lc.assert_close(value, want_grads[name], f"process {process_id}: d/d{name}")
    print(f"process {process_id}: ok")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
