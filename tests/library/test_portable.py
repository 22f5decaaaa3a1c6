"""The portable planner (`planning.portable`: the C++ core's plans in JAX) against the native
handler bit for bit, its selection by lowering platform, the layer running it on 8 CPU devices,
and the balanced training step's export for TPU and ROCm with jax.export's default checks. (The
NumPy reference suite runs it too: tests/library/test_plan_vs_reference.py; the traces:
tests/experiments/test_portable_workloads.py.)"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ultraep_jax as uep
from tests import helpers
from tests.helpers import layer_cases
from tests.helpers.planner_cases import FIELDS, balancer, batched_plans, random_loads
from tests.references.planner import reference_plan
from ultraep_jax.planning import native as _native
from ultraep_jax.planning import planner as _planner
from ultraep_jax.planning import portable

CFG = uep.BalancerConfig(16, 8, slots_per_rank=2, min_tokens_per_replica=4)


@pytest.mark.parametrize(
    "R, E, S, F, K, eps, g, capacity",
    [
        (8, 32, 2, 100, 1, 0.01, 2, None),
        pytest.param(8, 16, 1, 10, 0, 0.0, 4, None, marks=pytest.mark.slow),
        pytest.param(4, 16, 3, 50, 7, 0.05, None, 1.0, marks=pytest.mark.slow),
        (16, 64, 2, 1024, 1, 0.0, 4, 1.02),
    ],
)
def test_portable_equals_native_on_random_batches(R, E, S, F, K, eps, g, capacity):
    rng = np.random.default_rng(R + E + S)
    kinds = ("uniform", "hot", "zipf", "one", "equal")
    batch = np.stack([random_loads(rng, R, E, k, s) for k in kinds for s in (7, 1000, 200_000)])
    mean = -(-int(batch[1].sum(dtype=np.int64)) // R)
    cap = None if capacity is None else int(capacity * mean)
    cfg = balancer(S, F, K, eps, g)
    native, portable = (
        batched_plans(cfg, batch, cap, planner="native"),
        batched_plans(cfg, batch, cap, planner="portable"),
    )
    for name in FIELDS:
        np.testing.assert_array_equal(portable[name], native[name], err_msg=name)
    assert (portable["slot_expert"] >= 0).sum() > 0
    want = reference_plan(batch[1], S, F, eps, K, capacity=cap or 0, ranks_per_domain=g)
    np.testing.assert_array_equal(portable["rank_load"][1], want["rank_load"])


def test_bad_loads_give_minus_one_everywhere():
    # What the CUDA handler writes where it cannot raise: the portable planner never reaches
    # the host, so a negative load (or a total above int32) yields no valid plan.
    loads = np.ones((8, 16), np.int32)
    loads[3, 5] = -1
    plan = uep.plan(loads, CFG, planner="portable")
    for name in FIELDS:
        assert (np.asarray(getattr(plan, name)) == -1).all(), name
    big = np.zeros((8, 16), np.int32)
    big[:, 0] = 2**31 - 1
    assert (np.asarray(uep.plan(big, CFG, planner="portable").rank_load) == -1).all()


@pytest.mark.parametrize("eps", [0.01, 0.003, 1e17, 1e300, 5e-324, 2.0**-1030, float("inf")])
def test_scalar_args_carry_eps_bit_for_bit(eps):
    # eps travels traced as its 64 bits (two int32 words); F, K and the capacity clamp at
    # 2^31 - 1, where no int32 total reaches them.
    exact, capped, values = portable.scalar_args(2**40, 7, eps, 3)
    with jax.enable_x64(True):
        sc = portable.Scalars(exact, capped, jnp.asarray(values))
        got = np.asarray(jax.jit(lambda: sc.eps)())
        assert (int(sc.F), int(sc.K), int(sc.capacity)) == (2**31 - 1, 7, 3)
    assert got.dtype == np.float64
    assert got.tobytes() == np.float64(eps).tobytes()
    assert (exact, capped) == (False, True)
    assert portable.scalar_args(1, 1, -0.0, 0)[:2] == (True, False)


def test_floors_tolerance_and_capacity_share_one_compiled_planner():
    # F, K, eps (not exact mode) and the capacity are traced: the test suites' many floors and
    # tolerances at one size compile the portable planner once without a capacity, once with.
    loads = random_loads(np.random.default_rng(3), 4, 8, "hot", 1000)
    mean = -(-int(loads.sum(dtype=np.int64)) // 4)
    _planner._portable_jit.clear_cache()  # (other tests may have planned these sizes)
    cases = [(1, 0, 0.01, None), (5, 7, 0.25, None), (64, 1, 1e17, None)]
    cases += [(1, 0, 0.01, mean), (50, 3, 0.05, mean + 40)]
    for F, K, eps, cap in cases:
        want = reference_plan(loads, 2, F, eps, K, capacity=cap or 0)
        got = uep.plan(loads, balancer(2, F, K, eps), cap, planner="portable")
        for name in FIELDS:
            np.testing.assert_array_equal(getattr(got, name), want[name], err_msg=name)
    assert _planner._portable_jit._cache_size() == 2


@pytest.mark.parametrize(
    "planner, error", [("fast", ValueError), (None, TypeError), (1, TypeError)]
)
def test_bad_planner_name_raises_one_line(planner, error):
    """An unknown name is a ValueError; a value of another type (None included) a TypeError, as
    for the library's other arguments."""
    helpers.assert_raises_one_line(
        error,
        "planner must be one of",
        uep.plan,
        np.ones((8, 16), np.int32),
        CFG,
        planner=planner,
    )
    helpers.assert_raises_one_line(error, "planner must be one of", uep.Execution, planner=planner)


def test_portable_validates_as_the_core():
    # The same checks, before anything runs, whichever planner.
    for planner in ("native", "portable"):
        helpers.assert_raises_one_line(
            ValueError,
            "not divisible",
            uep.plan,
            np.ones((3, 16), np.int32),
            uep.BalancerConfig(),
            planner=planner,
        )
        helpers.assert_raises_one_line(
            ValueError, "capacity", uep.plan, np.ones((8, 16), np.int32), CFG, 0, planner=planner
        )


def _export_plan(platform: str, **kw):
    fn = jax.jit(lambda l: uep.plan(l, CFG, **kw))
    return jax.export.export(fn, platforms=[platform])(jax.ShapeDtypeStruct((8, 16), jnp.int32))


@pytest.mark.parametrize("platform", ["tpu", "rocm"])
def test_auto_plans_portably_for_tpu_and_rocm_with_default_checks(platform):
    text = _export_plan(platform).mlir_module()
    assert "ultraep_plan" not in text and "callback" not in text


def test_auto_follows_the_lowering_platform_and_the_cuda_handler(monkeypatch):
    assert (
        "ultraep_plan"
        in jax.jit(lambda l: uep.plan(l, CFG))
        .lower(jax.ShapeDtypeStruct((8, 16), jnp.int32))
        .as_text()
    )
    monkeypatch.setattr(_native, "has_cuda_handler", lambda: False)
    text = _export_plan("cuda").mlir_module()  # default checks: no custom call left
    assert "ultraep_plan" not in text
    # Asked for, the missing handler is one line of ours (it was XLA's error naming the call).
    with pytest.raises(ValueError, match="this install has no CUDA planner handler"):
        _export_plan("cuda", planner="native")


# -- the layer ------------------------------------------------------------------------------


# In test_moe's test process (pytest-xdist), whose cache of `layer_cases.run_case` (the reference
# and the native layer: three compiles of a layer step) then serves this test too.
@pytest.mark.xdist_group("test_moe")
@pytest.mark.parametrize("case", layer_cases.SKEWED[:2], ids=lambda c: c.id)
def test_layer_with_portable_planner_equals_dense_reference_and_native(case):
    res = layer_cases.run_case(case)
    mesh = helpers.make_mesh(case.mesh)
    layer = layer_cases.build_layer(
        mesh,
        case.num_experts,
        case.top_k,
        res["balancer"],
        None,
        res["params"],
        planner="portable",
    )
    x = helpers.place_batch(mesh, res["x"])
    y, stats, gx, gp = layer_cases.layer_value_and_grads(layer, x, jnp.asarray(res["cotangent"]))
    ref_y, ref_gx, ref_gp = res["ref"]
    layer_cases.assert_close(y, ref_y, "portable y")
    layer_cases.assert_close(gx, ref_gx, "portable d/dx")
    for name in layer_cases.PARAM_NAMES:
        layer_cases.assert_close(gp[name], ref_gp[name], f"portable d/d{name}")
    n_y, n_stats, n_gx, n_gp = res["balanced"]  # the layer with the native planner
    assert stats["replicas"] > 0
    np.testing.assert_array_equal(y, n_y)
    np.testing.assert_array_equal(gx, n_gx)
    for name in layer_cases.PARAM_NAMES:
        np.testing.assert_array_equal(gp[name], n_gp[name], err_msg=name)
    for name, value in n_stats.items():
        np.testing.assert_array_equal(stats[name], value, err_msg=name)


def _training_step_export(platform: str):
    """The balanced layer's training step (loss and gradients, EP8, 2 slots), built on abstract
    GPUs, exported for ``platform`` by `uep.export` ("auto" resolved for ``platform``) with
    jax.export's default safety checks, less one: JAX's own
    ``ragged_all_to_all`` has no export compatibility guarantee in this JAX (as in the CUDA export
    of tests/library/test_moe.py); every other custom call, the planner's among them, is refused."""
    mesh = helpers.gpu_mesh((8,), ("expert",))
    balancer = layer_cases.balancer_config(mesh, 8, slots=2)
    layer = nnx.eval_shape(lambda: layer_cases.build_layer(mesh, 8, 2, balancer, 1.25))
    x = helpers.abstract_batch(mesh, (8, 8, layer_cases.D), jnp.float32)
    fn, params, rest = layer_cases.pure_forward(layer)

    def loss(params, rest, x):
        y, _ = fn(params, rest, x)
        return jnp.sum(y * y)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 2)))
    ragged = jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")
    return uep.export(step, platforms=[platform], disabled_checks=[ragged])(params, rest, x)


@pytest.mark.parametrize("platform", ["tpu", "rocm"])
def test_balanced_training_step_exports_for_tpu_and_rocm(platform):
    exported = _training_step_export(platform)
    assert exported.platforms == (platform,)
    text = exported.mlir_module()
    assert "ultraep_plan" not in text and "callback" not in text
    assert "triton" not in text and "mosaic" not in text.lower()  # no CUDA-only kernel
    assert layer_cases.RAGGED_OP.search(text)  # JAX's own ragged_all_to_all
    assert "ragged_dot" in text


def test_readme_layer_on_cpu_devices_exports_for_tpu_with_default_checks():
    """docs/usage.md's layer on `jax.make_mesh`'s CPU devices: its step plans natively when lowered
    for the CPU and portably when exported for TPU by `uep.export` (its "auto" planner was resolved
    to the native handler when the layer was built, and the export ended in an error); no custom
    call but JAX's own ragged all-to-all, whose check alone is disabled."""
    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    layer = uep.MoE(
        d_model=8,
        d_ff=8,
        num_experts=8,
        top_k=2,
        mesh=mesh,
        balancer=uep.BalancerConfig(slots_per_rank=2, min_tokens_per_replica=8),
        capacity_factor=1.05,
        rngs=nnx.Rngs(0),
    )
    graph, params = nnx.split(layer)

    @jax.jit
    def step(params, x):
        return jax.grad(lambda p: jnp.mean(nnx.merge(graph, p)(x)[0] ** 2))(params)

    x = jax.ShapeDtypeStruct((64, 32, 8), jnp.float32)  # enough tokens to balance (not compiled)
    calls = re.compile(r"custom_call @(\w+)")
    assert "ultraep_plan" in calls.findall(step.lower(params, x).as_text())
    ragged = jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")
    exported = uep.export(step, platforms=["tpu"], disabled_checks=[ragged])(params, x)
    assert set(calls.findall(exported.mlir_module())) == {"ragged_all_to_all"}


@pytest.mark.parametrize(
    "platform_mesh, match",
    [
        ("cuda", r"^planner='native': this install has no CUDA planner handler"),
        ("tpu", r"^planner='native': no native planner handler exists for 'tpu' devices"),
    ],
)
def test_native_planner_where_no_handler_is_one_line_before_xla(monkeypatch, platform_mesh, match):
    """A layer asked for the native planner on devices with no handler for it (CUDA without the
    CUDA handler; TPU) says so while tracing, instead of XLA's unregistered-custom-call error when
    the step compiles; "auto" plans portably there."""
    monkeypatch.setattr(_native, "has_cuda_handler", lambda: False)
    if platform_mesh == "cuda":
        mesh = helpers.gpu_expert_mesh(8)
    else:
        tpu = jax.sharding.AbstractDevice(device_kind="TPU v5", num_cores=None, platform="tpu")
        mesh = jax.sharding.AbstractMesh((8,), ("expert",), abstract_device=tpu)
    balancer = uep.BalancerConfig(min_tokens_per_replica=1, min_tokens_per_rank=0)
    S = jax.ShapeDtypeStruct
    x, ids, w = S((64, 8), jnp.float32), S((64, 2), jnp.int32), S((64, 2), jnp.float32)
    params = (S((8, 8, 16), jnp.float32), S((8, 8, 16), jnp.float32), S((8, 16, 8), jnp.float32))
    for planner, raises in (("native", True), ("auto", False)):
        ep = uep.ExpertParallel(
            mesh, 8, balancer, comm_backend="ragged", expert_kernel="ragged_dot", planner=planner
        )
        fn = functools.partial(uep.routed_experts, ep=ep)
        if raises:
            helpers.assert_raises_one_line(ValueError, match, jax.eval_shape, fn, x, ids, w, params)
        else:
            jax.eval_shape(fn, x, ids, w, params)
