"""The compile-time benchmark's minimal EP (`experiments.bench.minimal_ep`) computes the layer it
stands for: where no expert overflows its buffer it equals the dense reference; the relay
schedule's compile-time benchmark runs."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.bench.minimal_ep import minimal_ep
from tests.helpers import expert_mesh
from tests.references.moe import reference_moe


def test_minimal_ep_equals_dense_reference_without_overflow():
    D, F, E, K = 16, 8, 8, 2
    mesh = expert_mesh(8)
    T = 8 * 16  # 16 tokens per rank: 32 pairs, 4 per expert against a buffer of 5
    rng = np.random.default_rng(0)
    t = np.arange(T)
    ids = np.stack([(2 * t + j + t // 16) % E for j in range(K)], axis=1).astype(np.int32)
    for rank in range(8):  # balanced on every rank, so nothing is dropped
        assert np.bincount(ids[16 * rank : 16 * (rank + 1)].ravel(), minlength=E).max() <= 5
    x = rng.normal(size=(T, D)).astype(np.float32)
    w = rng.uniform(size=(T, K)).astype(np.float32)
    params = tuple(
        (rng.normal(size=s) / np.sqrt(s[1])).astype(np.float32)
        for s in ((E, D, F), (E, D, F), (E, F, D))
    )
    split = NamedSharding(mesh, P("expert"))
    put = lambda a: jax.device_put(jnp.asarray(a), split)  # noqa: E731
    got = jax.jit(lambda *a: minimal_ep(*a, mesh, num_experts=E, top_k=K))(
        put(x), put(ids), put(w), tuple(put(p) for p in params)
    )
    keep = np.ones((1, T, K), bool)
    want = reference_moe(x[None], ids[None], w[None], params, keep)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_compile_relay_times_each_variant(tmp_path):
    """`experiments.bench.compile_relay` runs and times the schedule alone, under vmap and under
    lax.map (one row each)."""
    out = tmp_path / "relay.json"
    cmd = [sys.executable, "-m", "experiments.bench.compile_relay", "--ep_sizes=4",
           "--fanouts=1", "--repeats=1", "--batch=2", f"--json_out={out}"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=pathlib.Path(__file__).resolve().parents[2], timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["plain", "vmap", "lax.map"]
    assert all(r["ep_size"] == 4 and r["compile_s"] > 0 for r in rows)
