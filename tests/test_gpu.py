"""GPU-only tests: the CUDA planner handler, the grouped-matmul kernel, the MoE layer on one GPU.

They skip without a GPU. conftest.py defaults JAX_PLATFORMS to "cpu", so on a GPU machine run

    JAX_PLATFORMS=cuda,cpu python -m pytest tests/test_gpu.py -q
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import ultraep_jax as uep
from ultraep_jax import _native, gmm

pytestmark = pytest.mark.skipif(
    jax.devices()[0].platform != "gpu",
    reason=(
        f"needs a GPU (default device platform is {jax.devices()[0].platform!r}; on a GPU machine "
        "set JAX_PLATFORMS=cuda,cpu, since conftest.py defaults it to cpu)"
    ),
)


def _random_loads(rng, n, R, E):
    """int32 [n, R, E]: skewed loads (a random Zipf-like popularity per matrix), some zeros."""
    out = np.empty((n, R, E), np.int32)
    for i in range(n):
        p = rng.permutation(E) + 1.0
        p = p ** -rng.uniform(0.0, 2.0)
        p /= p.sum()
        out[i] = rng.multinomial(int(rng.integers(0, 4096)), p, size=R)
    return out


def test_cuda_planner_equals_cpu_planner():
    if not _native.has_cuda_handler():
        pytest.skip("the CUDA planner handler was not built into this install (no nvcc?)")
    cfg = uep.BalancerConfig(num_experts=64, ep_size=8, slots_per_rank=2, min_tokens_per_replica=16)
    loads = _random_loads(np.random.default_rng(0), 200, cfg.ep_size, cfg.num_experts)
    planner = jax.jit(jax.vmap(lambda l: uep.plan(l, cfg)))
    on_cpu = planner(jax.device_put(loads, jax.devices("cpu")[0]))
    on_gpu = planner(jax.device_put(loads, jax.devices("gpu")[0]))
    assert next(iter(on_gpu.rank_load.devices())).platform == "gpu"
    for name, a, b in zip(
        ("slot_expert", "slot_quota", "master_quota", "rank_load"),
        jax.tree.leaves(on_cpu),
        jax.tree.leaves(on_gpu),
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("sizes", [[128] * 8, [900, 0, 3, 77, 0, 40, 4, 0]])
def test_grouped_matmul_equals_ragged_dot_on_gpu(dtype, sizes):
    rng = np.random.default_rng(1)
    M, K, N, G = 1100, 256, 384, len(sizes)  # M not a multiple of the tile; rows past the total
    lhs = jnp.asarray(rng.normal(size=(M, K)), dtype)
    rhs = jnp.asarray(rng.normal(size=(G, K, N)) / np.sqrt(K), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    cot = jnp.asarray(rng.normal(size=(M, N)), jnp.float32)

    def loss(mm, lhs, rhs):
        return jnp.sum(mm(lhs, rhs, gs).astype(jnp.float32) * cot)

    def ours(lhs, rhs, gs):
        return gmm.grouped_matmul(lhs, rhs, gs)

    def ref(lhs, rhs, gs):
        return jax.lax.ragged_dot(
            lhs.astype(jnp.float32), rhs.astype(jnp.float32), gs, precision="highest"
        )

    out = jax.jit(ours)(lhs, rhs, gs)
    assert out.dtype == dtype
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref(lhs, rhs, gs)), rtol=tol, atol=tol
    )
    assert not np.any(np.asarray(out[sum(sizes) :], np.float32))
    got = jax.jit(jax.grad(lambda l, r: loss(ours, l, r), argnums=(0, 1)))(lhs, rhs)
    want = jax.jit(jax.grad(lambda l, r: loss(ref, l, r), argnums=(0, 1)))(lhs, rhs)
    for g, w in zip(got, want):
        w = np.asarray(w, np.float32)
        scale = float(np.max(np.abs(w))) or 1.0
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=tol, atol=tol * scale)


def test_moe_layer_forward_backward_on_one_gpu_with_balancer():
    mesh = Mesh(np.array(jax.devices("gpu")[:1]), ("expert",))
    E = 8
    balancer = uep.BalancerConfig(
        num_experts=E, ep_size=1, slots_per_rank=2, min_tokens_per_replica=16
    )
    layer = uep.MoE(
        d_model=128,
        d_ff=256,
        num_experts=E,
        top_k=2,
        mesh=mesh,
        balancer=balancer,
        capacity_factor=None,
        rngs=nnx.Rngs(0),
    )
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    x = jax.device_put(
        jax.random.normal(jax.random.key(0), (4, 128, 128), jnp.float32), jax.devices("gpu")[0]
    )

    def loss(params, x):
        y, stats = nnx.merge(graphdef, params, rest)(x)
        return jnp.mean(jnp.square(y)), stats

    (value, stats), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, x
    )
    assert np.isfinite(float(value))
    assert int(stats.dropped) == 0
    assert int(jnp.sum(stats.expert_load)) == 4 * 128 * 2
    for leaf in jax.tree.leaves(grads):
        assert np.all(np.isfinite(np.asarray(leaf)))
