"""The one resolver (`config.resolve`): its candidate table for each kind on each platform, its
one-line refusals, the retired and deprecated names, where the platform comes from (the mesh, on
every mesh), and the exported programs it makes: a TPU export carries no CPU-only choice, and an
export for several platforms from a mesh that names none carries each platform's."""

from __future__ import annotations

import functools
import pathlib
import re
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh

import ultraep_jax as uep
from tests import helpers
from tests.helpers import layer_cases
from ultraep_jax.base import operands
from ultraep_jax.config import resolve
from ultraep_jax.experts import registry
from ultraep_jax.replicas import relay

# Every case on each JAX line (conftest.py, --suite=quick): what it checks is what a JAX version
# compiles.
pytestmark = pytest.mark.every_case

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
B200 = "NVIDIA B200"
TPU_V5 = "TPU v5 lite"


@pytest.fixture
def hopper_host(monkeypatch):
    """This host as if its default device were a Hopper GPU (JAX's Mosaic GPU kernels lower
    only on one)."""
    monkeypatch.setattr(operands, "host_is_hopper", lambda: True)


@pytest.fixture
def tokamax_installed(monkeypatch):
    monkeypatch.setattr(resolve, "tokamax_installed", lambda: True)


@pytest.fixture
def no_tokamax(monkeypatch):
    monkeypatch.setattr(resolve, "tokamax_installed", lambda: False)


def _ops(lhs_shape, rhs_shape, dtype=jnp.bfloat16):
    return resolve.Operands(lhs_shape, rhs_shape, jnp.dtype(dtype), jnp.dtype(dtype))


def _facts(kind=None, **given):
    return resolve.Facts(device_kind=kind, **given)


# -- the candidate table: each kind on each platform -------------------------------------------


@pytest.mark.parametrize(
    "platform, handler, want",
    [
        ("cpu", False, "native"),
        ("cuda", True, "native"),
        ("gpu", True, "native"),  # a mesh's GPU devices say "gpu"
        ("cuda", False, "portable"),
        ("tpu", True, "portable"),
        ("rocm", True, "portable"),
    ],
)
def test_auto_planner_by_platform_and_handler(platform, handler, want):
    assert resolve.resolve("planner", "auto", platform, _facts(cuda_handler=handler)) == want


def test_native_planner_where_no_handler_is_refused_in_one_line():
    helpers.assert_raises_one_line(
        ValueError,
        r"^planner='native': this install has no CUDA planner handler .*; use planner='auto'",
        resolve.resolve,
        "planner",
        "native",
        "cuda",
    )
    helpers.assert_raises_one_line(
        ValueError,
        r"^planner='native': no native planner handler exists for 'tpu' devices",
        resolve.resolve,
        "planner",
        "native",
        "tpu",
    )
    for platform in ("cpu", "cuda", "rocm", "tpu"):
        assert resolve.resolve("planner", "portable", platform) == "portable"


@pytest.mark.parametrize(
    "platform, want", [("cpu", "padded"), ("gpu", "ragged"), ("cuda", "ragged"), ("tpu", "ragged")]
)
def test_auto_comm_backend_by_platform(platform, want):
    assert resolve.resolve("comm_backend", "auto", platform) == want
    assert resolve.resolve("comm_backend", "padded", platform) == "padded"


def test_ragged_on_cpu_is_refused_in_one_line():
    helpers.assert_raises_one_line(
        ValueError,
        r"^comm_backend='ragged': cannot run on CPU devices \(XLA:CPU has no ragged_all_to_all\); "
        r"use comm_backend='padded' or 'auto'$",
        resolve.resolve,
        "comm_backend",
        "ragged",
        "cpu",
    )


@pytest.mark.usefixtures("no_tokamax")
@pytest.mark.parametrize(
    "platform, kind, want",
    [
        ("cpu", "cpu", "tiled"),
        ("cuda", A100, "ragged_dot"),
        ("rocm", "AMD Instinct MI300X", "ragged_dot"),
        ("tpu", TPU_V5, "ragged_dot"),  # tokamax not installed
    ],
)
def test_auto_kernel_without_operands(platform, kind, want):
    assert resolve.resolve("expert_kernel", "auto", platform, _facts(kind)) == want


def test_auto_kernel_on_hopper_follows_the_operands_and_the_host(hopper_host, monkeypatch):
    """Mosaic GPU where the operands suit it (bf16/f16, K and N multiples of the tiles), else
    ragged_dot; and never where this host has no Hopper GPU (the kernels read it when lowered)."""
    fits = _ops((256, 256), (4, 256, 384))

    def auto(kind, ops):
        return resolve.resolve("expert_kernel", "auto", "cuda", _facts(kind, operands=ops))

    assert auto(H100, fits) == "mgpu"
    assert auto(None, fits) == "mgpu"  # no mesh names the kind: the host's
    assert auto(H100, _ops((256, 256), (4, 256, 384), jnp.float32)) == "ragged_dot"
    assert auto(H100, _ops((256, 96), (4, 96, 128))) == "ragged_dot"  # K=96
    assert auto(A100, fits) == "ragged_dot"
    monkeypatch.setattr(operands, "host_is_hopper", lambda: False)
    assert auto(H100, fits) == "ragged_dot"  # a CUDA export from a CPU host


def test_auto_kernel_on_tpu_is_tokamax_where_its_mosaic_kernel_takes_it(tokamax_installed):
    def auto(kind, ops=None):
        return resolve.resolve("expert_kernel", "auto", "tpu", _facts(kind, operands=ops))

    assert auto(TPU_V5) == "tokamax"
    assert auto("TPU7x", _ops((256, 128), (4, 128, 256))) == "tokamax"
    assert auto(TPU_V5, _ops((256, 64), (4, 64, 256))) == "ragged_dot"  # K < 128
    assert auto("TPU v4") == "ragged_dot"
    # Not on CUDA: only a GPU A/B against JAX's Mosaic GPU kernels may decide that.
    assert resolve.resolve("expert_kernel", "auto", "cuda", _facts(A100)) == "ragged_dot"


def test_explicit_kernels_refused_where_they_cannot_run(no_tokamax, monkeypatch):
    helpers.assert_raises_one_line(
        ValueError,
        r"^expert_kernel='mgpu': JAX's Mosaic GPU kernels run on NVIDIA GPUs, not 'cpu' devices",
        resolve.resolve,
        "expert_kernel",
        "mgpu",
        "cpu",
    )
    helpers.assert_raises_one_line(
        ValueError,
        r"^expert_kernel='mgpu': JAX's Mosaic GPU kernels read this host's GPU",
        resolve.resolve,
        "expert_kernel",
        "mgpu",
        "cuda",
        _facts(H100),
    )
    helpers.assert_raises_one_line(
        ValueError,
        r"^expert_kernel='tokamax': tokamax is not installed",
        resolve.resolve,
        "expert_kernel",
        "tokamax",
        "tpu",
    )
    monkeypatch.setattr(resolve, "tokamax_installed", lambda: True)
    helpers.assert_raises_one_line(
        ValueError,
        r"^expert_kernel='tokamax': tokamax's Mosaic GPU kernel picks its variant from JAX's "
        r"default device \(jax\.extend\.backend\.get_default_device\(\): 'cpu' here\).*"
        r"jax\.default_device",
        resolve.resolve,
        "expert_kernel",
        "tokamax",
        "cuda",
    )
    for name in ("tiled", "ragged_dot", "tokamax"):
        assert resolve.resolve("expert_kernel", name, "cpu") == name


# -- the facts are the mesh's devices', not the host's ------------------------------------------

#: An H100 as an abstract mesh carries it (`jax.sharding.Mesh.abstract_mesh` of compile-only
#: H100s: its kind and core count, no compute capability).
ABSTRACT_H100 = AbstractDevice(device_kind=H100, num_cores=132, platform="gpu")


def test_facts_of_a_mesh_are_its_devices():
    """A mesh's facts: its devices' kind, and a GPU's core count and compute capability where
    the devices carry them (tests/library/test_gpu_compile.py checks a mesh of compile-only
    H100s: "9.0" and 132)."""
    h100 = AbstractMesh((8,), ("expert",), abstract_device=ABSTRACT_H100)
    assert resolve.facts_of(h100) == _facts(H100, core_count=132)
    assert resolve.facts_of(helpers.expert_mesh(8)) == _facts("cpu")  # no GPU's counts
    tpu = AbstractDevice(device_kind=TPU_V5, num_cores=1, platform="tpu")
    assert resolve.facts_of(AbstractMesh((8,), ("expert",), abstract_device=tpu)) == _facts(TPU_V5)
    assert resolve.facts_of(AbstractMesh((8,), ("expert",))) == resolve.Facts()
    assert resolve.facts_of(None, cuda_handler=True) == _facts(cuda_handler=True)
    with jax.sharding.use_abstract_mesh(h100):
        assert resolve.traced_facts(cuda_handler=True) == _facts(
            H100, core_count=132, cuda_handler=True
        )
        with resolve.lowering_for("tpu"):  # an export to another platform: none of the mesh's
            assert resolve.traced_facts() == resolve.Facts()


def test_auto_kernel_on_an_h100_mesh_is_mgpu_from_its_facts(hopper_host):
    """ "auto" inside a step traced on an abstract mesh of H100s (a layer built for the pod, on
    any host) resolves from that mesh's facts: mgpu for fitting bf16 operands; a non-Hopper
    mesh's, ragged_dot."""
    fits = _ops((256, 128), (4, 128, 128))
    for device, want in (
        (ABSTRACT_H100, "mgpu"),
        (AbstractDevice(device_kind=A100, num_cores=108, platform="gpu"), "ragged_dot"),
        (AbstractDevice(device_kind=B200, num_cores=148, platform="gpu"), "ragged_dot"),
    ):
        mesh = AbstractMesh((8,), ("expert",), abstract_device=device)
        with jax.sharding.use_abstract_mesh(mesh):
            platform = resolve.traced_platform()
            facts = resolve.traced_facts(operands=fits)
        assert (facts.device_kind, facts.core_count) == (device.device_kind, device.num_cores)
        assert resolve.resolve("expert_kernel", "auto", platform, facts) == want, device


def test_hopper_is_the_compute_capability_where_the_devices_carry_one(hopper_host):
    """A GPU's compute capability, where its devices carry one, decides Hopper over its kind's
    name: a kind no name rule knows at "9.0" is Hopper, a "10.0" is not."""
    fits = _ops((256, 128), (4, 128, 128))

    def auto(kind, cc):
        facts = _facts(kind, compute_capability=cc, operands=fits)
        return resolve.resolve("expert_kernel", "auto", "cuda", facts)

    assert auto("NVIDIA GH100 engineering sample", "9.0") == "mgpu"
    assert auto("NVIDIA GH100 engineering sample", None) == "ragged_dot"  # the name alone
    assert auto(H100, "9.0") == "mgpu"
    assert auto(A100, "8.0") == auto(B200, "10.0") == "ragged_dot"
    helpers.assert_raises_one_line(
        ValueError,
        r"^expert_kernel='mgpu': JAX's Mosaic GPU ragged-dot kernels need a Hopper GPU \(compute "
        r"capability 9\.x\), not 'NVIDIA B200', compute capability 10\.0",
        resolve.resolve,
        "expert_kernel",
        "mgpu",
        "cuda",
        _facts(B200, compute_capability="10.0"),
    )


def test_mgpu_from_a_host_without_hopper_is_ragged_dot_saying_what_jax_reads(monkeypatch):
    """An H100 mesh lowered on a host without a Hopper GPU (a CPU host's deviceless compile):
    "auto" takes ragged_dot, and mgpu asked for is refused naming what JAX's weight-gradient
    kernel reads of the host (tests/library/test_gpu_compile.py lowers it there)."""
    monkeypatch.setattr(operands, "host_is_hopper", lambda: False)
    facts = _facts(H100, compute_capability="9.0", core_count=132)
    fits = _facts(H100, operands=_ops((256, 128), (4, 128, 128)))
    assert resolve.resolve("expert_kernel", "auto", "cuda", fits) == "ragged_dot"
    helpers.assert_raises_one_line(
        ValueError,
        r"^expert_kernel='mgpu': JAX's Mosaic GPU kernels read this host's GPU when they are "
        r"lowered: the weight gradient's grid is jax\.devices\(\)\[0\]\.core_count "
        r"\(jax/experimental/pallas/ops/gpu/transposed_ragged_dot_mgpu\.py\), the SMs of this "
        r"host's first device, whatever the mesh \(the mesh's GPUs have 132\), and this host has "
        r"no Hopper GPU, so a deviceless compile "
        r"or a CUDA export from it can use 'ragged_dot'",
        resolve.resolve,
        "expert_kernel",
        "mgpu",
        "cuda",
        facts,
    )


def _gpu(kind, cc):
    """A stand-in for a GPU device as JAX's default device (what tokamax reads)."""
    return types.SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=cc)


def test_tokamax_on_cuda_follows_the_default_device_tokamax_reads(tokamax_installed, monkeypatch):
    """tokamax's Mosaic GPU kernels read JAX's default device: explicit tokamax for a mesh's
    GPUs is taken where that device is a GPU of the mesh's kind (the GPU host's, or
    ``jax.default_device`` of a compile-only one), and its weight gradient is its Hopper kernel
    there; refused in one line for another GPU."""
    from ultraep_jax.experts import gmm_tokamax

    shapes = ((256, 128), (4, 128, 128))
    monkeypatch.setattr(operands, "default_device", lambda: _gpu(H100, "9.0"))
    assert resolve.resolve("expert_kernel", "tokamax", "cuda", _facts(H100)) == "tokamax"
    assert resolve.resolve("expert_kernel", "tokamax", "cuda") == "tokamax"  # kind not known
    assert gmm_tokamax.implementations("cuda", *shapes, H100) == ("mosaic_gpu",) * 3
    helpers.assert_raises_one_line(
        ValueError,
        r"^expert_kernel='tokamax': tokamax's Mosaic GPU kernel picks its variant from JAX's "
        r"default device, a 'NVIDIA H100 80GB HBM3', not the mesh's 'NVIDIA B200'; lower within "
        r"jax\.default_device",
        resolve.resolve,
        "expert_kernel",
        "tokamax",
        "cuda",
        _facts(B200),
    )
    monkeypatch.setattr(operands, "default_device", lambda: _gpu(A100, "8.0"))
    assert gmm_tokamax.implementations("cuda", *shapes, A100) == ("mosaic_gpu",) * 2 + ("xla",)


def test_unknown_platform_keeps_explicit_names_and_needs_one_for_auto():
    for kind, names in resolve.NAMES.items():
        for name in names[1:]:
            assert resolve.resolve(kind, name, None) == name
        with pytest.raises(ValueError, match="needs a platform"):
            resolve.resolve(kind, "auto", None)


def test_every_kind_resolves_auto_on_every_platform(no_tokamax):
    """The last candidate of each kind runs anywhere, so "auto" is something everywhere."""
    for kind in resolve.CANDIDATES:
        for platform in (*resolve.PLATFORMS, resolve.OTHER):
            assert resolve.resolve(kind, "auto", platform) in resolve.NAMES[kind]
        assert resolve.CANDIDATES[kind][-1].supported("any", resolve.Facts()) is True


def test_names_are_auto_and_the_candidates():
    assert resolve.NAMES == {
        "planner": ("auto", "native", "portable"),
        "expert_kernel": ("auto", "tokamax", "mgpu", "ragged_dot", "tiled"),
        "comm_backend": ("auto", "ragged", "padded"),
    }
    assert (uep.config.execution.KERNELS, uep.config.execution.BACKENDS) == (
        resolve.NAMES["expert_kernel"],
        resolve.NAMES["comm_backend"],
    )


def test_platform_of_concrete_and_abstract_meshes():
    mesh = helpers.expert_mesh(8)
    assert resolve.platform_of(mesh) == "cpu" and resolve.device_kind_of(mesh) == "cpu"
    gpu = helpers.gpu_expert_mesh(8)
    assert resolve.platform_of(gpu) == "gpu" and resolve.canonical_platform("gpu") == "cuda"
    assert resolve.platform_of(AbstractMesh((8,), ("expert",))) is None
    assert resolve.platform_of(None) is None
    assert resolve.canonical_platform("gpu", "AMD Instinct MI300X") == "rocm"
    # XLA's ROCm executor may report the architecture as the kind.
    for kind in ("gfx942:sramecc+:xnack-", "gfx950", "AMD Radeon gfx1100"):
        assert resolve.canonical_platform("gpu", kind) == "rocm", kind
    assert resolve.canonical_platform("gpu", H100) == "cuda"


# -- names: one meaning each ------------------------------------------------------------------


def test_pallas_kernel_is_refused_naming_its_replacements():
    match = r"expert_kernel='pallas' .* was removed; use expert_kernel='tokamax' .* or 'mgpu'"
    execution = "^Execution: " + match
    helpers.assert_raises_one_line(ValueError, execution, uep.Execution, "auto", "pallas")
    helpers.assert_raises_one_line(
        ValueError, match, uep.ExpertParallel, helpers.expert_mesh(8), 8, expert_kernel="pallas"
    )
    rows = jnp.zeros((4, 8))
    stack = (jnp.zeros((2, 8, 8)),) * 3
    helpers.assert_raises_one_line(
        ValueError,
        "^grouped_glu: " + match,
        registry.grouped_glu,
        rows,
        [stack],
        jnp.array([2, 2]),
        "pallas",
    )


def test_portable_comm_backend_is_a_deprecated_name_of_padded():
    with pytest.warns(DeprecationWarning, match="comm_backend='portable' is deprecated: it is "):
        execution = uep.Execution(comm_backend="portable")
    assert execution.comm_backend == "padded"
    assert execution == uep.Execution(comm_backend="padded")  # one configuration, one program
    with pytest.warns(DeprecationWarning, match="'padded'") as caught:
        ep = uep.ExpertParallel(helpers.expert_mesh(8), 8, comm_backend="portable")
    assert len(caught) == 1 and ep.comm_backend == "padded"
    # The warning names the caller's line, not the library's (nor flax's, which builds uep.MoE).
    assert caught[0].filename == __file__
    with pytest.warns(DeprecationWarning, match="'padded'") as caught:
        layer = nnx.eval_shape(
            lambda: uep.MoE(
                mesh=helpers.expert_mesh(8),
                d_model=8,
                d_ff=8,
                num_experts=8,
                top_k=2,
                rngs=nnx.Rngs(0),
                comm_backend="portable",
            )
        )
    assert len(caught) == 1 and caught[0].filename == __file__
    assert layer.ep.comm_backend == "padded"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        uep.Execution(planner="portable")  # the planner's name: no warning


def test_expert_parallel_reads_back_its_execution_keywords():
    ep = uep.ExpertParallel(
        helpers.expert_mesh(8), 8, expert_kernel="ragged_dot", transfer_chunks=2, planner="native"
    )
    assert (ep.comm_backend, ep.expert_kernel, ep.transfer_chunks, ep.planner) == (
        "auto",
        "ragged_dot",
        2,
        "native",
    )
    assert ep.activation == "silu" and ep.execution.comm_backend == "auto"


# -- the exported programs ----------------------------------------------------------------------

CALLS = re.compile(r"custom_call\s*@([\w$.]+)")
#: The tiled kernel in an exported module: its function's name in the locations.
TILED = 'loc("tiled_glu_parts"'
#: How XLA's ragged_dot appears in an exported module (as in tests/library/test_gpu.py).
RAGGED_DOT_OP = re.compile(r'"?chlo\.ragged_dot"?\s*%|stablehlo\.composite "chlo\.ragged_dot"')


#: The step's ragged all-to-alls: the tokens out and back, forward and backward (4), and the
#: replica weights and their gradients, one each per relay hop (the balancer's default fan-out).
RAGGED_ALL_TO_ALLS = 4 + 2 * relay.static_hops(8, uep.BalancerConfig().max_fanout)


def _step(mesh, concrete=False, **options):
    """The balanced layer's training step (loss and gradients, 2 slots, D=F=8) built on ``mesh``
    (``options``: more `uep.MoE` keywords), jitted, and its arguments: abstract, or with the
    layer's values and a batch of ones when ``concrete``."""
    balancer = layer_cases.balancer_config(mesh, 8, slots=2)
    build = functools.partial(layer_cases.build_layer, mesh, 8, 2, balancer, 1.25, **options)
    layer = build() if concrete else nnx.eval_shape(build)
    x = helpers.abstract_batch(mesh, (8, 8, layer_cases.D), jnp.float32)
    if concrete:
        x = helpers.place_batch(mesh, jnp.linspace(-1, 1, x.size).reshape(x.shape))
    fn, params, rest = layer_cases.pure_forward(layer)

    def loss(params, rest, x):
        return jnp.sum(fn(params, rest, x)[0] ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 2))), (params, rest, x)


def _exported(mesh, platforms, checks=("ragged_all_to_all",), export=jax.export.export, **kw):
    """`_step` on ``mesh`` exported for ``platforms`` by ``export`` with jax.export's checks,
    but for ``checks``' custom calls."""
    step, args = _step(mesh, **kw)
    disabled = [jax.export.DisabledSafetyCheck.custom_call(c) for c in checks]
    return export(step, platforms=platforms, disabled_checks=disabled)(*args)


def _step_export(mesh, platforms, checks=("ragged_all_to_all",), export=jax.export.export, **kw):
    """The module of `_exported`."""
    return _exported(mesh, platforms, checks, export, **kw).mlir_module()


def test_tpu_export_from_an_abstract_tpu_mesh_carries_no_cpu_only_choice(no_tokamax):
    """The mesh of `jax.make_mesh`'s CPU devices, as an abstract mesh of TPUs: "auto" is
    resolved for TPU when the step is traced (no planner custom call, no tiled kernel: every
    expert matmul is XLA's ragged_dot, and the exchanges JAX's ragged_all_to_all)."""
    cpu = jax.make_mesh((8,), ("expert",))
    tpu = AbstractDevice(device_kind=TPU_V5, num_cores=None, platform="tpu")
    mesh = AbstractMesh(cpu.axis_sizes, cpu.axis_names, abstract_device=tpu)
    text = _step_export(mesh, ["tpu"])
    calls = CALLS.findall(text)
    assert "ultraep_plan" not in calls and "callback" not in text and TILED not in text
    # Experts: 3 ragged_dots forward and 2 per matmul backward, for masters and slots.
    assert len(RAGGED_DOT_OP.findall(text)) == 18
    assert calls.count("ragged_all_to_all") == RAGGED_ALL_TO_ALLS


def test_tpu_export_from_a_concrete_cpu_mesh_carries_no_cpu_only_choice(no_tokamax):
    """`uep.export` of a step built on CPU devices, for TPU: TPU's choices, as from a TPU mesh
    (no planner call, no tiled kernel; XLA's ragged_dots, JAX's ragged all-to-alls)."""
    text = _step_export(helpers.expert_mesh(8), ["tpu"], export=uep.export)
    calls = CALLS.findall(text)
    assert "ultraep_plan" not in calls and "callback" not in text and TILED not in text
    assert len(RAGGED_DOT_OP.findall(text)) == 18
    assert calls.count("ragged_all_to_all") == RAGGED_ALL_TO_ALLS


def test_export_for_another_platform_than_the_meshs_is_refused_without_the_helper():
    """`jax.export` for TPU of a step whose "auto" followed its CPU devices: our one line naming
    `uep.export`, not the CPU's choices run on TPU."""
    helpers.assert_raises_one_line(
        ValueError, "ultraep_jax.export", _step_export, helpers.expert_mesh(8), ["tpu"]
    )


def test_export_for_cpu_and_tpu_runs_on_cpu_as_the_jitted_step(no_tokamax):
    """`uep.export` for CPU and TPU from CPU devices is compiled whole on CPU, TPU's branch
    included: every platform takes choices XLA:CPU compiles (no ragged_all_to_all, no
    ragged_dot: the tiled kernel and the padded exchange), and the artifact runs on CPU equal
    to the jitted step, bit for bit."""
    mesh = helpers.expert_mesh(8)
    step, args = _step(mesh, concrete=True)
    checks = [jax.export.DisabledSafetyCheck.custom_call("ultraep_plan")]
    exported = uep.export(step, platforms=["cpu", "tpu"], disabled_checks=checks)(*args)
    text = exported.mlir_module()
    assert TILED in text and not RAGGED_DOT_OP.findall(text)
    assert "ragged_all_to_all" not in CALLS.findall(text)
    for got, want in zip(
        jax.tree.leaves(exported.call(*args)), jax.tree.leaves(step(*args)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("mesh_kind", ["concrete", "abstract"])
def test_export_for_several_platforms_on_a_data_axis(mesh_kind, no_tokamax):
    """dp2 x ep4, exported for CPU and TPU, and for CUDA and TPU: each platform's planner branch
    has the loads' type (the FFI call's outputs lost it: "switch branches must have equal output
    types")."""
    mesh = helpers.expert_mesh(4, 2)
    if mesh_kind == "abstract":
        mesh = AbstractMesh(mesh.axis_sizes, mesh.axis_names, axis_types=mesh.axis_types)
        text = _step_export(mesh, ["cuda", "tpu"], checks=("ragged_all_to_all", "ultraep_plan"))
        assert "ragged_all_to_all" in CALLS.findall(text)
    text = _step_export(mesh, ["cpu", "tpu"], checks=("ultraep_plan",), export=uep.export)
    assert TILED in text and "ragged_all_to_all" not in CALLS.findall(text)


def test_ops_xla_cpu_cannot_compile_are_refused_beside_cpu(no_tokamax):
    """An explicit choice whose ops XLA:CPU cannot compile, in an export for CPU and another
    platform, is refused in one line when traced; "auto" from a mesh that names no platform,
    lowered for CPU and TPU by `jax.export` alone, raises our one line naming `uep.export`."""
    mesh = helpers.expert_mesh(8)
    helpers.assert_raises_one_line(
        ValueError,
        r"^expert_kernel='ragged_dot': an export for \('cpu', 'tpu'\) is compiled whole on CPU, "
        r"'tpu' branch included",
        _step_export,
        mesh,
        ["cpu", "tpu"],
        checks=("ultraep_plan",),
        export=uep.export,
        execution=uep.Execution(expert_kernel="ragged_dot"),
    )
    helpers.assert_raises_one_line(
        ValueError,
        r"^ultraep_jax: comm_backend='auto' on 'tpu' lowers to ops XLA:CPU cannot compile.*"
        r"ultraep_jax\.export",
        _step_export,
        AbstractMesh((8,), ("expert",)),
        ["cpu", "tpu"],
        checks=("ragged_all_to_all", "ultraep_plan"),
    )


def test_explicit_names_are_checked_for_an_exports_platforms(no_tokamax):
    """An abstract mesh without a device names no platform: an explicit name is checked for the
    export's platforms (`uep.export`), or, where none is named, refused where no platform
    takes it, in the one line a concrete mesh gets."""
    mesh = AbstractMesh((8,), ("expert",))
    helpers.assert_raises_one_line(
        ValueError,
        r"^expert_kernel='mgpu': JAX's Mosaic GPU kernels run on NVIDIA GPUs, not 'tpu'",
        _step_export,
        mesh,
        ["tpu"],
        export=uep.export,
        execution=uep.Execution(expert_kernel="mgpu"),
    )
    for export in (uep.export, jax.export.export):
        helpers.assert_raises_one_line(
            ValueError,
            r"^expert_kernel='tokamax': tokamax is not installed",
            _step_export,
            mesh,
            ["tpu"],
            export=export,
            execution=uep.Execution(expert_kernel="tokamax"),
        )


def test_export_platforms_are_named_as_lowering_names_them():
    assert resolve.target_platforms(["gpu", "cuda", "tpu"]) == ("cuda", "tpu")
    for bad in ((), ("tpu", "metal")):
        helpers.assert_raises_one_line(
            ValueError, "platforms must name some of", uep.export, jax.jit(abs), platforms=bad
        )
    helpers.assert_raises_one_line(
        TypeError,
        r"^platforms must be a platform name or a list of them .*, got NoneType None$",
        uep.export,
        jax.jit(abs),
        platforms=None,
    )


def test_export_for_several_platforms_from_a_mesh_that_names_none(no_tokamax):
    """An abstract mesh without a device, exported for CUDA and TPU: each platform's choice,
    picked when the program runs (ragged all-to-alls on both; no tiled kernel, CPU's)."""
    mesh = AbstractMesh((8,), ("expert",))
    text = _step_export(mesh, ["cuda", "tpu"], checks=("ragged_all_to_all", "ultraep_plan"))
    calls = CALLS.findall(text)
    # Each platform's program holds every exchange; JAX may lower identical branches once.
    assert RAGGED_ALL_TO_ALLS <= calls.count("ragged_all_to_all") <= 2 * RAGGED_ALL_TO_ALLS
    assert TILED not in text
    assert RAGGED_DOT_OP.findall(text)  # the experts, on both


def test_auto_on_a_cpu_mesh_is_resolved_when_traced():
    """On CPU devices "auto" traces the CPU's choices alone (no platform branch): the padded
    exchange and the tiled kernel, no ragged_all_to_all and no ragged_dot in the program."""
    mesh = helpers.expert_mesh(8)
    text = _step_export(mesh, ["cpu"], checks=("ultraep_plan",))
    assert CALLS.findall(text) == ["ultraep_plan"]  # no ragged_all_to_all
    assert not RAGGED_DOT_OP.findall(text) and TILED in text


# -- docs/gpu.md's kernel table is the resolver's -----------------------------------------------

GPU_DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "gpu.md"

#: Each row of docs/gpu.md's kernel table (its first two cells) as the resolver's inputs:
#: (platform, device kind, this host has a Hopper GPU, tokamax installed, operands).
KERNEL_ROWS = {
    ("CPU", "any"): ("cpu", "cpu", False, True, None),
    (
        "NVIDIA Hopper (H100, H200), lowered on a Hopper host",
        "bf16/f16, K and N multiples of 128",
    ): ("gpu", H100, True, True, _ops((512, 256), (8, 256, 384))),
    (
        "NVIDIA, kind not known (a CUDA export through `uep.export`, an abstract mesh without a "
        "device), lowered on a Hopper host",
        "bf16/f16, K and N multiples of 128",
    ): ("gpu", None, True, True, _ops((512, 256), (8, 256, 384))),
    ("NVIDIA Hopper, lowered on a Hopper host", "float32, or other shapes"): (
        "gpu",
        H100,
        True,
        True,
        _ops((512, 256), (8, 256, 384), jnp.float32),
    ),
    (
        "NVIDIA Hopper, lowered on a host without one (a deviceless compile for compile-only "
        "H100s, a CUDA export from a CPU host)",
        "any",
    ): (
        "gpu",
        H100,
        False,
        True,
        _ops((512, 256), (8, 256, 384)),
    ),
    ("NVIDIA Ampere and older, Blackwell", "any"): ("gpu", A100, True, True, None),
    ("TPU v5 and later, tokamax installed", "K and N >= 128"): (
        "tpu",
        TPU_V5,
        False,
        True,
        _ops((512, 128), (8, 128, 256)),
    ),
    ("TPU v5 and later, tokamax installed", "K or N < 128"): (
        "tpu",
        TPU_V5,
        False,
        True,
        _ops((512, 64), (8, 64, 256)),
    ),
    ("TPU v4 and older, or tokamax not installed", "any"): ("tpu", TPU_V5, False, False, None),
    ("ROCm", "any"): ("gpu", "AMD Instinct MI300X", False, True, None),
}


def _kernel_table() -> dict[tuple[str, str], str]:
    """docs/gpu.md's kernel table: (devices, operands) -> the kernel name "auto" takes."""
    section = GPU_DOC.read_text().split("## Expert kernels", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[2].startswith("`"):
            rows[cells[0], cells[1]] = cells[2].split("`")[1]
    return rows


def test_docs_kernel_table_is_the_resolvers(monkeypatch):
    table = _kernel_table()
    assert set(table) == set(KERNEL_ROWS)
    for row, (platform, kind, hopper_host, installed, ops) in KERNEL_ROWS.items():
        monkeypatch.setattr(operands, "host_is_hopper", lambda hopper_host=hopper_host: hopper_host)
        monkeypatch.setattr(resolve, "tokamax_installed", lambda installed=installed: installed)
        facts = resolve.Facts(device_kind=kind, operands=ops)
        assert resolve.resolve("expert_kernel", "auto", platform, facts) == table[row], row
    text = GPU_DOC.read_text()
    for kind, name, doc in resolve.candidate_table():
        if kind == "expert_kernel":
            assert f"- `{name}`: {doc}\n" in text, name
