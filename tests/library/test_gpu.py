"""The GPU path: the CUDA planner handler, JAX's Mosaic GPU kernels, the MoE layer on one GPU.

The tests marked ``needs_gpu`` skip without a GPU. conftest.py defaults JAX_PLATFORMS to "cpu",
so on a GPU machine run

    JAX_PLATFORMS=cuda,cpu python -m pytest tests/library/test_gpu.py -q

The others run everywhere (CI has no GPU): they export the balanced training step for CUDA with
`jax.export` and check every custom call and collective it contains.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import ultraep_jax as uep
from tests.helpers import abstract_batch, gpu_expert_mesh, needs_gpu
from tests.helpers.planner_cases import KERNELS, PLANNER_CASES, skewed_load_batch
from ultraep_jax.config import resolve
from ultraep_jax.experts import gmm_mgpu
from ultraep_jax.planning import native as _native
from ultraep_jax.replicas import relay

needs_hopper = pytest.mark.skipif(
    not gmm_mgpu.is_hopper(), reason="needs an H100/H200 (Mosaic GPU)"
)


@needs_gpu
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("case", list(PLANNER_CASES))
def test_cuda_planner_equals_cpu_planner(case, kernel):
    """Either CUDA kernel (the core on one thread, or the parallel form) against the CPU core."""
    if not _native.has_cuda_handler():
        pytest.skip("the CUDA planner handler was not built into this install (ULTRAEP_BUILD_CUDA)")
    kwargs, (n, R, E, tokens, exponent) = PLANNER_CASES[case]
    cfg = uep.BalancerConfig(**kwargs)
    loads = skewed_load_batch(np.random.default_rng(0), n, R, E, tokens, exponent)
    on_cpu = jax.jit(jax.vmap(lambda x: uep.plan(x, cfg)))(
        jax.device_put(loads, jax.devices("cpu")[0])
    )
    planner = jax.jit(jax.vmap(lambda x: uep.plan(x, cfg, parallel=KERNELS[kernel])))
    on_gpu = planner(jax.device_put(loads, jax.devices("gpu")[0]))
    assert next(iter(on_gpu.rank_load.devices())).platform == "gpu"
    for name, a, b in zip(
        ("slot_expert", "slot_quota", "master_quota", "rank_load"),
        jax.tree.leaves(on_cpu),
        jax.tree.leaves(on_gpu),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@needs_gpu
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_cuda_planner_negative_load_gives_minus_one(kernel):
    if not _native.has_cuda_handler():
        pytest.skip("the CUDA planner handler was not built into this install (ULTRAEP_BUILD_CUDA)")
    cfg = uep.BalancerConfig(num_experts=16, ep_size=4, slots_per_rank=2, min_tokens_per_replica=4)
    loads = skewed_load_batch(np.random.default_rng(2), 3, 4, 16)
    loads[1, 2, 5] = -1
    planner = jax.jit(jax.vmap(lambda x: uep.plan(x, cfg, parallel=KERNELS[kernel])))
    plans = planner(jax.device_put(loads, jax.devices()[0]))
    for leaf in jax.tree.leaves(plans):
        assert np.all(np.asarray(leaf)[1] == -1)
    assert np.all(np.asarray(plans.rank_load)[[0, 2]] >= 0)


def _gmm_inputs(dtype, sizes, M=1100, K=256, N=384, seed=1):
    rng = np.random.default_rng(seed)
    G = len(sizes)
    lhs = jnp.asarray(rng.normal(size=(M, K)), dtype)
    rhs = jnp.asarray(rng.normal(size=(G, K, N)) / np.sqrt(K), dtype)
    cot = jnp.asarray(rng.normal(size=(M, N)), jnp.float32)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), cot


def _ref(lhs, rhs, gs):
    return jax.lax.ragged_dot(
        lhs.astype(jnp.float32), rhs.astype(jnp.float32), gs, precision="highest"
    )


def _check_against_ragged_dot(mm, dtype, sizes, tol):
    """Forward, rows past the total, and both gradients of ``mm`` against float32 ragged_dot
    of the same inputs."""
    lhs, rhs, gs, cot = _gmm_inputs(dtype, sizes)

    def loss(mm, lhs, rhs):
        return jnp.sum(mm(lhs, rhs, gs).astype(jnp.float32) * cot)

    out = jax.jit(mm)(lhs, rhs, gs)
    assert out.dtype == dtype
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(_ref(lhs, rhs, gs)), rtol=tol, atol=tol
    )
    total = min(int(np.sum(sizes)), lhs.shape[0])
    assert not np.any(np.asarray(out[total:], np.float32))
    got = jax.jit(jax.grad(lambda a, b: loss(mm, a, b), argnums=(0, 1)))(lhs, rhs)
    want = jax.jit(jax.grad(lambda a, b: loss(_ref, a, b), argnums=(0, 1)))(lhs, rhs)
    for g, w in zip(got, want, strict=True):
        w = np.asarray(w, np.float32)
        scale = float(np.max(np.abs(w))) or 1.0
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=tol, atol=tol * scale)


SIZES = {
    "balanced": [128] * 8,
    "ragged_rows_past_total": [900, 0, 3, 77, 0, 40, 4, 0],
    "sum_above_rows": [600, 0, 700, 1, 0, 0, 0, 0],
}


@needs_gpu
@needs_hopper
@pytest.mark.parametrize("sizes", list(SIZES))
def test_grouped_matmul_mgpu_equals_ragged_dot_on_gpu(sizes):
    _check_against_ragged_dot(gmm_mgpu.grouped_matmul_mgpu, jnp.bfloat16, SIZES[sizes], 2e-2)


def test_mgpu_unsupported_names_the_reason():
    assert gmm_mgpu.mgpu_unsupported((64, 256), (2, 256, 384), jnp.bfloat16) is None
    assert "float32" in gmm_mgpu.mgpu_unsupported((64, 256), (2, 256, 384), jnp.float32)
    assert "N=100" in gmm_mgpu.mgpu_unsupported((64, 256), (2, 256, 100), jnp.bfloat16)
    assert "K=96" in gmm_mgpu.mgpu_unsupported((64, 96), (2, 96, 128), jnp.bfloat16)


def _layer(mesh, E, D, F, dtype, kernel, balancer=True, max_fanout=2):
    cfg = uep.BalancerConfig(
        num_experts=E,
        ep_size=mesh.shape["expert"],
        slots_per_rank=2,
        min_tokens_per_replica=16,
        max_fanout=max_fanout,
        min_tokens_per_rank=0,
    )
    return uep.MoE(
        d_model=D,
        d_ff=F,
        num_experts=E,
        top_k=2,
        mesh=mesh,
        balancer=cfg if balancer else None,
        capacity_factor=None,
        param_dtype=dtype,
        expert_kernel=kernel,
        rngs=nnx.Rngs(0),
    )


def _layer_value_and_grads(layer, x):
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, x):
        y, stats = nnx.merge(graphdef, params, rest)(x)
        return jnp.mean(jnp.square(y.astype(jnp.float32))), (y, stats)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)


@pytest.fixture
def one_gpu_mesh():
    """The first GPU as the one rank of the "expert" axis."""
    return Mesh(np.array(jax.devices("gpu")[:1]), ("expert",))


@needs_gpu
def test_moe_layer_forward_backward_on_one_gpu_with_balancer(one_gpu_mesh):
    layer = _layer(one_gpu_mesh, 8, 128, 256, jnp.float32, "auto")
    x = jax.device_put(
        jax.random.normal(jax.random.key(0), (4, 128, 128), jnp.float32), jax.devices("gpu")[0]
    )
    (value, (_, stats)), grads = _layer_value_and_grads(layer, x)
    assert np.isfinite(float(value))
    assert int(stats.dropped) == 0
    assert int(jnp.sum(stats.expert_load)) == 4 * 128 * 2
    for leaf in jax.tree.leaves(grads):
        assert np.all(np.isfinite(np.asarray(leaf)))


@needs_gpu
@pytest.mark.parametrize("kernel", ["auto", "tokamax", "mgpu"])
def test_moe_layer_bf16_kernels_equal_ragged_dot(kernel, one_gpu_mesh):
    """The layer with each GPU expert kernel against the same layer with XLA's ragged_dot (the
    routing is the same code, so only the experts' matmuls differ), values and gradients."""
    if kernel == "mgpu" and not gmm_mgpu.is_hopper():
        pytest.skip("needs an H100/H200 (Mosaic GPU)")
    if kernel == "tokamax" and not resolve.tokamax_installed():
        pytest.skip("tokamax is not installed (its extra: Python >= 3.12)")
    x = jax.device_put(
        jax.random.normal(jax.random.key(0), (4, 128, 256), jnp.bfloat16), jax.devices("gpu")[0]
    )
    layer = _layer(one_gpu_mesh, 8, 256, 384, jnp.bfloat16, kernel)
    (v, (y, _)), g = _layer_value_and_grads(layer, x)
    (v_ref, (y_ref, _)), g_ref = _layer_value_and_grads(
        _layer(one_gpu_mesh, 8, 256, 384, jnp.bfloat16, "ragged_dot"), x
    )
    np.testing.assert_allclose(float(v), float(v_ref), rtol=2e-2)
    y, y_ref = np.asarray(y, np.float32), np.asarray(y_ref, np.float32)
    assert np.linalg.norm(y - y_ref) <= 2e-2 * np.linalg.norm(y_ref)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 3e-2 * np.linalg.norm(b) + 1e-6


# -- the balanced training step exported for CUDA (runs everywhere) ----------------------------

CUSTOM_CALL = re.compile(r"stablehlo\.custom_call\s*@([\w$.]+)")
# Kernels that may appear in the CUDA step: the planner, JAX's Mosaic GPU kernels where "auto"
# picks its Hopper kernels (on a Hopper host: they read its GPU when lowered), and
# ragged_all_to_all; no Pallas Triton kernel (that backend is deprecated by JAX, and our Pallas
# kernel on it is gone).
ALLOWED_CALLS = {"ultraep_plan", "mosaic_gpu_v2", "ragged_all_to_all"}
#: How XLA's ragged_dot appears in the exported module ("auto" off Hopper).
RAGGED_DOT_OP = re.compile(r'"?chlo\.ragged_dot"?\s*%|stablehlo\.composite "chlo\.ragged_dot"')


def _expert_kernels(text: str, calls: list[str]) -> int:
    """The experts' grouped matmuls in an exported module: Mosaic GPU calls and ragged_dots."""
    return calls.count("mosaic_gpu_v2") + len(RAGGED_DOT_OP.findall(text))


def _exported_training_step(balanced: bool, max_fanout: int = 0):
    # Abstract H100s, also on a GPU machine: export needs no GPU, only the GPU's kind.
    mesh = gpu_expert_mesh(4, 2)
    E, D, F = 8, 128, 128
    layer = nnx.eval_shape(
        lambda: _layer(
            mesh, E, D, F, jnp.bfloat16, "auto", balancer=balanced, max_fanout=max_fanout
        )
    )
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def step(params, x):
        # A layer inside a model: the gradient flows to the parameters and to the input.
        def loss(params, x):
            y, _ = nnx.merge(graphdef, params, rest)(x)
            return jnp.mean(jnp.square(y.astype(jnp.float32)))

        value, (grads, dx) = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), dx

    x = abstract_batch(mesh, (8, 64, D), jnp.bfloat16)
    exported = jax.export.export(
        jax.jit(step),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(n) for n in ALLOWED_CALLS],
    )(params, x)
    assert exported.platforms == ("cuda",)
    return exported.mlir_module()


@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "plain"])
def test_cuda_training_step_custom_calls_and_ragged_all_to_all_count(balanced):
    text = _exported_training_step(balanced)
    calls = CUSTOM_CALL.findall(text)
    assert set(calls) <= ALLOWED_CALLS, set(calls) - ALLOWED_CALLS
    assert "callback" not in text
    assert not [c for c in calls if "triton" in c.lower()]  # no Pallas Triton call
    # One planner call per step (forward only: its outputs are integers, no gradient) where this
    # install built the CUDA handler; the portable planner, no custom call, otherwise.
    assert calls.count("ultraep_plan") == (1 if balanced and _native.has_cuda_handler() else 0)
    # Experts: 3 grouped matmuls forward, 2 kernels each backward (d_lhs, d_rhs) = 9, for the
    # masters and again for the replica slots.
    assert _expert_kernels(text, calls) == (18 if balanced else 9)
    # ragged_all_to_all: tokens out and back, forward and their transposes backward (4); the
    # replica weights forward and the gradients' way back to the masters (2).
    assert calls.count("ragged_all_to_all") == (6 if balanced else 4)


def test_cuda_training_step_relays_the_replica_weights_hop_by_hop():
    """With the relay (max_fanout=2 at EP4: 2 hops), one ragged all-to-all per hop for the
    weights and one per hop for their gradients, beside the tokens' 4."""
    text = _exported_training_step(True, max_fanout=2)
    calls = CUSTOM_CALL.findall(text)
    assert not [c for c in calls if "triton" in c.lower()]  # no Pallas Triton call
    assert calls.count("ultraep_plan") == (1 if _native.has_cuda_handler() else 0)
    assert _expert_kernels(text, calls) == 18
    assert calls.count("ragged_all_to_all") == 4 + 2 * relay.static_hops(4, 2) == 8
