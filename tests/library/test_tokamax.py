"""tokamax's ragged dot as an expert kernel (`experts.gmm_tokamax`; the ``tokamax`` extra, Python
>= 3.12): on CPU through its XLA implementation, the grouped matmul and the layer with
``expert_kernel="tokamax"`` against `jax.lax.ragged_dot` and the dense reference, values and
gradients; lowered for TPU on this CPU host, its Mosaic TPU kernels, forward and both transposed
products, with no XLA ragged_dot left; for CUDA, what happens on a host without a GPU. Skipped
where tokamax is not installed (the Python 3.11 line), unless ``ULTRAEP_REQUIRE_TOKAMAX``
is set."""

from __future__ import annotations

import collections
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from tests import helpers
from tests.helpers import layer_cases
from tests.references.moe import HIGHEST
from ultraep_jax.config import resolve

#: Set where tokamax must be installed (CI's MaxText line, whose requirements bring it): its
#: absence then fails this file instead of skipping it.
REQUIRE_ENV = "ULTRAEP_REQUIRE_TOKAMAX"
if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
    import tokamax  # an ImportError fails the file
else:
    tokamax = pytest.importorskip("tokamax")

from ultraep_jax.experts import gmm_tokamax  # noqa: E402  (after the skip)

CALLS = re.compile(r"custom_call\s*@([\w$.]+)")
RAGGED_DOT_OP = re.compile(r'"?chlo\.ragged_dot"?\s*%|stablehlo\.composite "chlo\.ragged_dot"')


def _inputs(M, K, N, sizes, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.normal(size=(M, K)), dtype)
    rhs = jnp.asarray(rng.normal(size=(len(sizes), K, N)) / np.sqrt(K), dtype)
    cot = jnp.asarray(rng.normal(size=(M, N)), jnp.float32)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), cot


def test_grouped_matmul_equals_ragged_dot_on_cpu():
    """Values (rows past the groups' total exactly zero) and both gradients, against
    `jax.lax.ragged_dot` at full precision: empty groups, rows past the total."""
    lhs, rhs, sizes, cot = _inputs(40, 16, 24, [10, 0, 17, 5])

    def loss(mm, lhs, rhs):
        return jnp.sum(jnp.sin(mm(lhs, rhs, sizes)) * cot)

    def ours(lhs, rhs, sizes):
        return gmm_tokamax.grouped_matmul_tokamax(lhs, rhs, sizes, platform="cpu")

    def reference(lhs, rhs, sizes):
        return jax.lax.ragged_dot(
            lhs, rhs, sizes, precision=HIGHEST, preferred_element_type=jnp.float32
        )

    out = jax.jit(ours)(lhs, rhs, sizes)
    assert out.dtype == jnp.float32 and not np.any(np.asarray(out[32:]))
    np.testing.assert_allclose(out, reference(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.grad(lambda a, b: loss(ours, a, b), argnums=(0, 1)))(lhs, rhs)
    want = jax.jit(jax.grad(lambda a, b: loss(reference, a, b), argnums=(0, 1)))(lhs, rhs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert gmm_tokamax.implementations("cpu", lhs.shape, rhs.shape, "cpu") == ("xla",) * 3


def test_layer_with_tokamax_equals_dense_reference():
    """The balanced layer (ep8, E=8, top-2, 2 slots) with ``expert_kernel="tokamax"`` on CPU
    (tokamax's XLA implementation, each stack as its grouped matmuls): y and the gradients of
    x and every parameter equal the dense one-device reference's."""
    rng = np.random.default_rng(0)
    mesh = helpers.make_mesh("ep8")
    x, params = layer_cases.make_inputs(rng, 8, 8, 8, 2, skew=True)
    cot = rng.normal(size=x.shape).astype(np.float32)
    ref_y, ref_gx, ref_gp = layer_cases.reference_value_and_grads(
        jnp.asarray(x), {k: jnp.asarray(v) for k, v in params.items()}, cot, 2
    )
    balancer = layer_cases.balancer_config(mesh, 8, slots=2)
    layer = layer_cases.build_layer(mesh, 8, 2, balancer, None, params, expert_kernel="tokamax")
    y, stats, gx, gp = layer_cases.layer_value_and_grads(
        layer, helpers.place_batch(mesh, x), jnp.asarray(cot)
    )
    assert stats["replicas"] > 0  # the slots' stack ran too
    layer_cases.assert_close(y, ref_y, "y")
    layer_cases.assert_close(gx, ref_gx, "d/dx")
    for name in layer_cases.PARAM_NAMES:
        layer_cases.assert_close(gp[name], ref_gp[name], f"d/d{name}")


#: A layer case on the dp2 x ep4 mesh: the expert weights enter invariant over "data", the rows
#: vary over it.
DATA_CASE = layer_cases.Case("dp2ep4", 8, 2, 8, 12, slots=2, skew=True, seed=3)


@pytest.mark.xdist_group("tokamax_dp2ep4")  # one process: `run_case` computes the case once
@pytest.mark.parametrize("key", ["balanced", "plain"])
def test_layer_with_tokamax_on_a_data_axis_equals_references(key):
    """The layer (balanced, and plain expert parallelism) with ``expert_kernel="tokamax"`` on
    the dp2 x ep4 mesh: `jax.value_and_grad` runs (the weights' cotangent, varying over "data"
    inside the kernel's rule, is summed over it outside), and y and the gradients of x and
    every parameter equal the dense reference's and the layer's with the tiled kernel."""
    case = layer_cases.run_case(DATA_CASE)
    ref_y, ref_gx, ref_gp = case["ref"]
    tiled_y, tiled_stats, tiled_gx, tiled_gp = case[key]
    mesh = helpers.make_mesh(DATA_CASE.mesh)
    balancer = case["balancer"] if key == "balanced" else None
    layer = layer_cases.build_layer(
        mesh, 8, 2, balancer, None, case["params"], expert_kernel="tokamax"
    )
    y, stats, gx, gp = layer_cases.layer_value_and_grads(
        layer, helpers.place_batch(mesh, case["x"]), jnp.asarray(case["cotangent"])
    )
    assert (stats["replicas"] > 0) == (key == "balanced") == (tiled_stats["replicas"] > 0)
    for want, what in ((ref_y, "reference"), (tiled_y, "tiled")):
        layer_cases.assert_close(y, want, f"y vs {what}")
    for want, what in ((ref_gx, "reference"), (tiled_gx, "tiled")):
        layer_cases.assert_close(gx, want, f"d/dx vs {what}")
    for name in layer_cases.PARAM_NAMES:
        for want, what in ((ref_gp, "reference"), (tiled_gp, "tiled")):
            layer_cases.assert_close(gp[name], want[name], f"d/d{name} vs {what}")


def _export_on_abstract_mesh(fn, platform, device_kind, M=256, K=128, N=256, G=4):
    """``fn(lhs, rhs, sizes)``'s value and gradients, inside a shard_map over 2 abstract devices
    of ``device_kind``, exported for ``platform`` with Mosaic's custom calls allowed: (the
    module's text, its custom calls counted)."""
    device = AbstractDevice(device_kind=device_kind, num_cores=None, platform=platform)
    mesh = AbstractMesh((2,), ("x",), axis_types=(AxisType.Auto,), abstract_device=device)

    def loss(lhs, rhs, sizes):
        f = jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x"))
        return jnp.sum(f(lhs, rhs, sizes))

    sharding = NamedSharding(mesh, P("x"))
    args = (
        jax.ShapeDtypeStruct((2 * M, K), jnp.bfloat16, sharding=sharding),
        jax.ShapeDtypeStruct((2 * G, K, N), jnp.bfloat16, sharding=sharding),
        jax.ShapeDtypeStruct((2 * G,), jnp.int32, sharding=sharding),
    )
    allowed = ("tpu_custom_call", "mosaic_gpu_v2")
    exported = jax.export.export(
        jax.jit(jax.value_and_grad(loss, argnums=(0, 1))),
        platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(c) for c in allowed],
    )(*args)
    text = exported.mlir_module()
    return text, collections.Counter(CALLS.findall(text))


def test_tpu_export_holds_mosaic_tpu_kernels_not_xla():
    """Lowered for a TPU v5 on this CPU host (tokamax would pick its XLA implementation from the
    host, and refuses "mosaic" on it): three Mosaic TPU calls (forward, d_lhs, d_rhs) and no
    XLA ragged_dot; through the resolver, "auto" on that mesh's platform is this kernel."""

    def fn(lhs, rhs, sizes):
        return gmm_tokamax.grouped_matmul_tokamax(
            lhs, rhs, sizes, platform="tpu", device_kind="TPU v5 lite"
        )

    text, calls = _export_on_abstract_mesh(fn, "tpu", "TPU v5 lite")
    assert calls == {"tpu_custom_call": 3}
    assert not RAGGED_DOT_OP.findall(text)
    facts = resolve.Facts("TPU v5 lite")
    assert resolve.resolve("expert_kernel", "auto", "tpu", facts) == "tokamax"


def test_tpu_export_of_small_operands_falls_back_to_xla():
    """Operands below the Mosaic TPU kernel's 128 (its NotImplementedError in tokamax) take
    tokamax's XLA implementation: XLA's ragged_dot, no Mosaic call."""

    def fn(lhs, rhs, sizes):
        return gmm_tokamax.grouped_matmul_tokamax(
            lhs, rhs, sizes, platform="tpu", device_kind="TPU v5 lite"
        )

    text, calls = _export_on_abstract_mesh(fn, "tpu", "TPU v5 lite", K=64)
    assert not calls and len(RAGGED_DOT_OP.findall(text)) == 3


def test_cuda_from_a_host_without_gpu():
    """What happens exporting tokamax's Mosaic GPU kernel for CUDA from this CPU host: tokamax
    picks its kernel's variant from JAX's default device (here the host's CPU) and raises
    NotImplementedError ("Unsupported GPU architecture"), whatever the mesh says; the resolver
    refuses the choice in one line before that (so a layer on abstract H100s says so when it is
    built), naming ``jax.default_device`` (tests/library/test_gpu_compile.py lowers it within
    that of a compile-only H100)."""

    def fn(lhs, rhs, sizes):
        return gmm_tokamax.grouped_matmul_tokamax(
            lhs, rhs, sizes, platform="cuda", device_kind="NVIDIA H100 80GB HBM3"
        )

    with pytest.raises(NotImplementedError, match="Unsupported GPU architecture"):
        _export_on_abstract_mesh(fn, "cuda", "NVIDIA H100 80GB HBM3")
    helpers.assert_raises_one_line(
        ValueError,
        r"^expert_kernel='tokamax': tokamax's Mosaic GPU kernel picks its variant from JAX's "
        r"default device \(jax\.extend\.backend\.get_default_device\(\): 'cpu' here\), so it "
        r"cannot lower for CUDA here .*; lower on the GPU host, or within "
        r"jax\.default_device\(<a device of the mesh>\)",
        layer_cases.build_layer,
        helpers.gpu_expert_mesh(8),
        8,
        2,
        None,
        1.25,
        expert_kernel="tokamax",
    )


def test_layer_exported_for_tpu_runs_its_experts_on_mosaic_tpu():
    """The balanced layer's training step (bf16, D = F = 128) built on abstract TPU v5 devices
    with "auto": every expert matmul is tokamax's Mosaic TPU kernel, forward and both transposed
    products (the module holds each kernel once, in functions called for masters and slots), and
    none is XLA's ragged_dot."""
    tpu = AbstractDevice(device_kind="TPU v5 lite", num_cores=None, platform="tpu")
    mesh = AbstractMesh((8,), ("expert",), abstract_device=tpu)
    balancer = layer_cases.balancer_config(mesh, 8, slots=2)
    layer = nnx.eval_shape(
        lambda: helpers.build_layer(
            mesh,
            d_model=128,
            d_ff=128,
            num_experts=8,
            top_k=2,
            balancer=balancer,
            capacity_factor=1.25,
            param_dtype=jnp.bfloat16,
        )
    )
    fn, params, rest = layer_cases.pure_forward(layer)

    def loss(params, rest, x):
        return jnp.sum(fn(params, rest, x)[0].astype(jnp.float32) ** 2)

    x = helpers.abstract_batch(mesh, (8, 64, 128), jnp.bfloat16)
    allowed = ("tpu_custom_call", "ragged_all_to_all")
    exported = jax.export.export(
        jax.jit(jax.value_and_grad(loss, argnums=(0, 2))),
        platforms=["tpu"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(c) for c in allowed],
    )(params, rest, x)
    text = exported.mlir_module()
    calls = collections.Counter(CALLS.findall(text))
    assert calls["tpu_custom_call"] >= 3 and "ultraep_plan" not in calls
    assert not RAGGED_DOT_OP.findall(text)
