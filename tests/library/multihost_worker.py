"""One of two JAX processes (4 CPU devices each, gloo collectives) that call `uep.routed_experts`
on global arrays spanning both processes' devices, eagerly and under `jit`. Each process compares
the rows it holds with the dense one-device reference of the whole batch, and checks that an id
outside [0, E) in its own tokens raises the one-line error; a jitted function that closes over
such an array gets JAX's own error.

    python tests/library/multihost_worker.py COORDINATOR_ADDRESS PROCESS_ID

Run by `test_multihost.py`; exits 0 when every check passes."""

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

import ultraep_jax as uep  # noqa: E402

B, L, D, F, E, K = 16, 4, 8, 16, 8, 2


def global_array(mesh, spec, value: np.ndarray) -> jax.Array:
    """``value`` (the same on every process) as one array over the whole mesh, each process
    filling only its own devices' shards."""
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def local_rows(a: jax.Array) -> dict[tuple, np.ndarray]:
    """This process's shards of ``a`` by their index's (start, stop) over the leading axis."""
    return {(s.index[0].start, s.index[0].stop): np.asarray(s.data) for s in a.addressable_shards}


def main(address: str, process_id: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, 2, process_id)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    from tests.references.moe import reference_moe

    rng = np.random.default_rng(0)  # the same values in both processes
    x = rng.normal(size=(B, L, D)).astype(np.float32)
    experts = np.stack([rng.permutation(E)[:K] for _ in range(B * L)]).reshape(B, L, K)
    experts = experts.astype(np.int32)
    weights = rng.uniform(size=(B, L, K)).astype(np.float32)
    params = tuple(
        (rng.normal(size=s) / np.sqrt(s[1])).astype(np.float32)
        for s in ((E, D, F), (E, D, F), (E, F, D))
    )
    want = np.asarray(reference_moe(x, experts, weights, params, np.ones((B, L, K), bool)))

    mesh = jax.make_mesh((8,), ("expert",))
    balancer = uep.BalancerConfig(slots_per_rank=1, min_tokens_per_replica=1, min_tokens_per_rank=0)
    ep = uep.ExpertParallel(mesh, E, balancer, capacity_factor=None)
    tokens, split = P("expert"), P("expert")
    gx, ge, gw = (global_array(mesh, tokens, a) for a in (x, experts, weights))
    gp = tuple(global_array(mesh, split, p) for p in params)
    assert not ge.is_fully_addressable

    def check(y, what):
        rows = local_rows(y)
        assert len(rows) == 4, what
        for (start, stop), got in rows.items():
            np.testing.assert_allclose(got, want[start:stop], rtol=1e-5, atol=1e-5, err_msg=what)

    y, stats = uep.routed_experts(gx, ge, gw, gp, ep)  # eager
    check(y, "eager call")
    assert int(stats.dropped.sum()) == 0
    jitted = jax.jit(lambda x, e, w, p: uep.routed_experts(x, e, w, p, ep)[0])
    check(jitted(gx, ge, gw, gp), "jit")
    # Closing over such an array is JAX's own error (pass it as an argument); the id check used
    # to fail first, trying to fetch the values.
    closed = jax.jit(lambda x, w, p: uep.routed_experts(x, ge, w, p, ep)[0])
    try:
        closed(gx, gw, gp)
    except RuntimeError as err:
        assert str(err).startswith("Closing over jax.Array that spans non-addressable"), err
    else:
        raise AssertionError("closing over a global array of two processes compiled")
    mask = global_array(mesh, tokens, np.ones((B, L), bool))
    check(uep.routed_experts(gx, ge, gw, gp, ep, mask)[0], "eager call with a token mask")

    # An id outside [0, E) among this process's own real tokens: the one-line error, here.
    bad = experts.copy()
    bad[process_id * B // 2, 0, 0] = E
    try:
        uep.routed_experts(gx, global_array(mesh, tokens, bad), gw, gp, ep)
    except ValueError as err:
        assert str(err) == f"routed_experts: experts must be in [0, {E}), got 0..{E}", err
    else:
        raise AssertionError("an id outside [0, E) was not reported")
    print(f"process {process_id}: ok")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
