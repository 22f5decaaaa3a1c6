"""XLA:GPU's compiler on a host without a GPU (DESIGN.md section 13): the layer's training step
(value and gradients of a loss of its output, w.r.t. its parameters and its input), balanced and
plain, compiled for one node of 8 H100s over the CUDA plugin's compile-only devices, on the
meshes EP8 and 2 data groups x EP4; the optimized module (``compiled.as_text()``) checked for what
the CPU tests cannot see:

- the exchange "auto" takes on CUDA is XLA's ragged all-to-all, over the EP groups, and the
  planner is our custom call exactly where this install built its CUDA handler;
- no all-reduce's result reaches a ragged all-to-all (a cast after a collective transposes to an
  all-reduce of the cotangent before the backward exchange: wrong gradients);
- no collective over the data axis inside a conditional's branches (a branch chosen by a plan is
  uniform only over EP: the data groups deadlock when they take different branches);
- the expert kernel "auto" takes is resolved from the H100s' facts, not the host's, and the
  compiled step carries it: `ragged_dot` here, since JAX's Mosaic GPU weight-gradient kernel
  reads the host's GPU (its forward kernel alone lowers here); tokamax's Mosaic GPU kernels,
  asked for, lower here within ``jax.default_device`` of an H100 (where tokamax is installed).

Each compiled step's memory per device (arguments, temporaries, peak) is printed (``-s``).
Skipped where the CUDA plugin of jaxlib's version is not installed (line a: JAX 0.10), unless
``ULTRAEP_REQUIRE_GPU_COMPILE`` is set (CI's line b)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from tests import helpers
from tests.helpers import MESH_KINDS, gpu_compile
from tests.helpers.layer_cases import balancer_config
from ultraep_jax.base import operands
from ultraep_jax.config import resolve
from ultraep_jax.planning import native

#: Set where the deviceless GPU compiler must be installed (CI's line b): its absence then fails
#: this file instead of skipping it.
REQUIRE_ENV = "ULTRAEP_REQUIRE_GPU_COMPILE"


def _unavailable() -> str | None:
    """Why XLA:GPU cannot compile here, or None."""
    jaxlib_version = importlib.metadata.version("jaxlib")
    if jax.__version_info__ < (0, 12):
        return f"compiling for CUDA without a GPU needs jax >= 0.12 (this is {jax.__version__})"
    found = gpu_compile.cuda_plugin()
    if found is None:
        pins = f"jax-cuda13-plugin=={jaxlib_version} jax-cuda13-pjrt=={jaxlib_version}"
        return f"no CUDA plugin: pip install {pins} (and nvidia-cuda-nvcc without ptxas on PATH)"
    if found[1] != jaxlib_version:
        return f"the CUDA plugin is {found[1]}, jaxlib {jaxlib_version}: JAX loads only its own"
    return None


UNAVAILABLE = _unavailable()
if UNAVAILABLE is not None and os.environ.get(REQUIRE_ENV, "") in ("", "0"):
    pytest.skip(UNAVAILABLE, allow_module_level=True)


@pytest.fixture(autouse=True)
def _compiler_required():
    """Fails each test where the compiler is missing and ``ULTRAEP_REQUIRE_GPU_COMPILE`` is set
    (so that CI cannot pass with this file skipped; the rest of the suite still runs)."""
    if UNAVAILABLE is not None:
        pytest.fail(f"{UNAVAILABLE} ({REQUIRE_ENV} is set, so this fails instead of skipping)")


# The compiled steps are cached by the one test process of this group (pytest-xdist). The
# compiler needs JAX >= 0.12: CI's line (b) runs the file's slow tests too (`gpu_compile`).
pytestmark = [
    pytest.mark.xdist_group("test_gpu_compile"),
    pytest.mark.gpu_compile,
    pytest.mark.every_case,  # --suite=quick (conftest.py): what it checks is what JAX compiles
]

#: A small layer on the GPU's balanced path: 8 experts, top-2, 2 replica slots per rank,
#: bfloat16 (the GPU's training dtype), D = 128 and F = 256 (told apart in the module's shapes),
#: 8 tokens per device.
E, TOP_K, SLOTS, D, F = 8, 2, 2, 128, 256
BATCH, SEQ = 16, 4
DTYPE = jnp.bfloat16
STEPS = [
    pytest.param(mesh, balanced, id=f"{mesh}-{'balanced' if balanced else 'plain'}")
    for mesh in MESH_KINDS
    for balanced in (True, False)
]


@functools.cache
def mesh_of(kind: str) -> jax.sharding.Mesh:
    """`MESH_KINDS`' mesh over 8 compile-only H100s."""
    dp, ep = MESH_KINDS[kind]
    return gpu_compile.compile_only_mesh(ep, dp)


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """A training step compiled for the H100s: its optimized module, XLA's memory analysis, the
    bytes its arguments take per device (from their shapes and shardings), seconds to lower and
    compile it."""

    mesh: jax.sharding.Mesh
    module: gpu_compile.HloModule
    text: str
    memory: object
    argument_bytes: int
    seconds: float


@functools.cache
def compiled_step(kind: str, balanced: bool, expert_kernel: str = "auto") -> CompiledStep:
    """The layer's value and gradients w.r.t. its parameters and its input (a layer inside a
    model) of mean(y**2), jitted over ``kind``'s H100 mesh and compiled (nothing runs)."""
    mesh = mesh_of(kind)
    balancer = balancer_config(mesh, E, SLOTS) if balanced else None
    layer = nnx.eval_shape(
        lambda: uep.MoE(
            d_model=D,
            d_ff=F,
            num_experts=E,
            top_k=TOP_K,
            mesh=mesh,
            balancer=balancer,
            capacity_factor=None,
            param_dtype=DTYPE,
            expert_kernel=expert_kernel,
            rngs=nnx.Rngs(0),
        )
    )
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    shardings = dict(zip(("w_gate", "w_up", "w_down"), layer.ep.weight_shardings, strict=True))
    shardings["router_kernel"] = NamedSharding(layer.ep.mesh, P())
    params = jax.tree.map_with_path(
        lambda path, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings[path[0].key]),
        params,
    )
    x = jax.ShapeDtypeStruct(
        (BATCH, SEQ, D), DTYPE, sharding=NamedSharding(mesh, P(tuple(mesh.axis_names)))
    )

    def step(params, x):
        def loss(params, x):
            y, _ = nnx.merge(graphdef, params, rest)(x)
            return jnp.mean(jnp.square(y.astype(jnp.float32)))

        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    start = time.perf_counter()
    compiled = gpu_compile.compile_without_cache(jax.jit(step).lower(params, x))
    seconds = time.perf_counter() - start
    shard_bytes = [
        int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
        for a in jax.tree.leaves((params, x))
    ]
    text = compiled.as_text()
    return CompiledStep(
        mesh,
        gpu_compile.HloModule(text),
        text,
        compiled.memory_analysis(),
        sum(shard_bytes),
        seconds,
    )


def test_the_mesh_is_eight_h100s_and_the_host_stays_cpu():
    mesh = mesh_of("dp2ep4")
    assert {(d.platform, d.device_kind) for d in mesh.devices.flat} == {("gpu", gpu_compile.H100)}
    assert jax.devices()[0].platform == "cpu"


@pytest.mark.slow  # a step lowers and compiles in 10-35 CPU-seconds (plain, balanced)
@pytest.mark.parametrize(("kind", "balanced"), STEPS)
def test_step_exchanges_with_ragged_all_to_all_over_ep_groups(kind, balanced):
    """The exchange "auto" takes on CUDA is the ragged all-to-all, each over one data row's EP
    ranks; the planner is our custom call where this install has its CUDA handler (else the
    portable planner, plain HLO)."""
    step = compiled_step(kind, balanced)
    ragged = step.module.instructions(gpu_compile.RAGGED_OPS)
    assert ragged, "no ragged-all-to-all in the optimized module"
    ep_groups = np.arange(step.mesh.devices.size).reshape(-1, step.mesh.shape["expert"]).tolist()
    for _, instruction in ragged:
        groups = gpu_compile.replica_groups(instruction, step.mesh.devices.size)
        assert sorted(map(sorted, groups)) == ep_groups, (instruction.name, groups)
    plans = step.text.count('custom_call_target="ultraep_plan"')
    assert (plans > 0) == (balanced and native.has_cuda_handler()), plans


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "balanced"), STEPS)
def test_no_all_reduce_feeds_a_ragged_exchange(kind, balanced):
    found = gpu_compile.all_reduces_feeding_ragged(compiled_step(kind, balanced).module)
    assert not found, f"(ragged all-to-all, all-reduce feeding it): {found}"


@pytest.mark.slow
@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "plain"])
def test_no_data_axis_collective_inside_a_branch(balanced):
    step = compiled_step("dp2ep4", balanced)
    found = gpu_compile.branch_collectives_across_rows(step.module, step.mesh)
    assert not found, f"(conditional, collective over data rows, its groups): {found}"


@pytest.mark.slow
def test_memory_per_device():
    """Prints each step's memory per device (XLA's buffer assignment for the H100); the
    arguments are the bytes of each device's shards of the parameters and the batch."""
    lines = []
    for kind, balanced in (p.values for p in STEPS):
        step = compiled_step(kind, balanced)
        memory = step.memory
        assert memory.argument_size_in_bytes == step.argument_bytes
        assert memory.peak_memory_in_bytes >= memory.argument_size_in_bytes
        lines.append(
            f"{kind:7} {'balanced' if balanced else 'plain':9}"
            f"{memory.argument_size_in_bytes:>12,}{memory.temp_size_in_bytes:>12,}"
            f"{memory.peak_memory_in_bytes:>12,}{step.seconds:>16.1f}"
        )
    header = f"{'mesh':7} {'step':9}{'argument':>12}{'temp':>12}{'peak':>12}{'lower+compile s':>16}"
    print(
        f"\nper-device bytes, E={E} top-{TOP_K} D={D} F={F} {jnp.dtype(DTYPE).name}, "
        f"{BATCH * SEQ // 8} tokens per device, {gpu_compile.H100}:\n{header}\n" + "\n".join(lines)
    )


# -- the checks catch what they look for: small programs with the defects, compiled the same way --


def _compile(mesh, fn, in_specs, *shapes):
    """``fn`` under shard_map over ``mesh`` (every output split like the first input), compiled
    for the H100s; the parsed optimized module."""
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=in_specs[0])
    args = [
        jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
        for shape, spec in zip(shapes, in_specs, strict=True)
    ]
    compiled = gpu_compile.compile_without_cache(jax.jit(mapped).lower(*args))
    return gpu_compile.HloModule(compiled.as_text())


@pytest.mark.parametrize("reduced", [True, False], ids=["all_reduce_first", "none"])
def test_the_walk_finds_an_all_reduce_feeding_a_ragged_exchange(reduced):
    """The defect of the cast after the exchange, written out: the rows a ragged all-to-all sends
    are an all-reduce's result (through elementwise work); without the all-reduce the walk finds
    none."""
    mesh = mesh_of("ep8")
    R, width = 8, 16

    def exchange(x):
        # x [R, width]: row j goes to rank j, which writes it at row (this rank).
        if reduced:
            x = jax.lax.pcast(jax.lax.psum(x, "expert"), "expert", to="varying")
        x = jnp.tanh(x * 2.0)
        ones = jnp.ones((R,), jnp.int32)
        rank = jax.lax.axis_index("expert")
        output = jax.lax.pcast(jnp.zeros((R, width), x.dtype), "expert", to="varying")
        return jax.lax.ragged_all_to_all(
            x, output, jnp.arange(R, dtype=jnp.int32), ones, ones * rank, ones, axis_name="expert"
        )

    module = _compile(mesh, exchange, (P("expert"),), (R * R, width))
    assert module.instructions(gpu_compile.RAGGED_OPS)
    found = gpu_compile.all_reduces_feeding_ragged(module)
    assert bool(found) == reduced, found


@pytest.mark.parametrize("axis", ["data", "expert"])
def test_the_branch_check_finds_a_data_axis_collective(axis):
    """A conditional whose branch sums over ``axis``: found over "data", not over "expert"."""
    mesh = mesh_of("dp2ep4")

    def branched(x):
        return jax.lax.cond(
            jnp.sum(x) > 0,
            lambda v: jax.lax.pcast(jax.lax.psum(v, axis), axis, to="varying") * 2.0,
            lambda v: v - 1.0,
            x,
        )

    module = _compile(mesh, branched, (P(("data", "expert")),), (8, 16))
    assert module.instructions({"conditional"})
    found = gpu_compile.branch_collectives_across_rows(module, mesh)
    assert bool(found) == (axis == "data"), found


# -- the expert kernel: "auto" from the H100s' facts ------------------------------------------

#: The custom call of a Mosaic GPU kernel (JAX's and tokamax's) in the optimized module.
MOSAIC_GPU = 'custom_call_target="mosaic_gpu'
#: The smallest operands JAX's Mosaic GPU kernels take, per rank: K = N = 128, rows of 2 tiles.
MGPU_M, MGPU_K, MGPU_N, MGPU_G = 256, 128, 128, 4


def _operands(lhs_shape, rhs_shape) -> resolve.Operands:
    return resolve.Operands(lhs_shape, rhs_shape, jnp.dtype(DTYPE), jnp.dtype(DTYPE))


def test_the_h100s_facts_are_the_meshs_not_the_hosts(monkeypatch):
    """The mesh's facts are the H100s' (kind, compute capability 9.0, 132 SMs; traced inside a
    shard_map over them, the abstract H100's kind and SMs), though the host is a CPU; on them
    "auto" takes mgpu for fitting bf16 operands where the host can lower it (a Hopper host), and
    ragged_dot here."""
    mesh = mesh_of("ep8")
    facts = resolve.facts_of(mesh)
    assert facts == resolve.Facts(gpu_compile.H100, compute_capability="9.0", core_count=132)
    traced = []

    def body(x):
        traced.append((resolve.traced_platform(), resolve.traced_facts()))
        return x

    jax.eval_shape(
        jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")),
        jax.ShapeDtypeStruct((8,), jnp.float32),
    )
    assert traced == [("gpu", resolve.Facts(gpu_compile.H100, core_count=132))]
    fits = _operands((MGPU_M, MGPU_K), (MGPU_G, MGPU_K, MGPU_N))
    for given in (facts, traced[0][1]):
        given = dataclasses.replace(given, operands=fits)
        assert resolve.resolve("expert_kernel", "auto", "gpu", given) == "ragged_dot"
        with monkeypatch.context() as patch:
            patch.setattr(operands, "host_is_hopper", lambda: True)
            assert resolve.resolve("expert_kernel", "auto", "gpu", given) == "mgpu"


def _mgpu_compiled(gradients: bool):
    """`grouped_matmul_mgpu` of bf16 [M, K] x [G, K, N] per rank (or its gradients w.r.t. both
    operands), in a shard_map over the 8 H100s, lowered and compiled here."""
    from ultraep_jax.experts import gmm_mgpu

    mesh = mesh_of("ep8")

    def matmul(lhs, rhs, sizes):
        return gmm_mgpu.grouped_matmul_mgpu(lhs, rhs, sizes)

    def loss(lhs, rhs, sizes):
        return jnp.sum(matmul(lhs, rhs, sizes).astype(jnp.float32))

    fn = jax.grad(loss, argnums=(0, 1)) if gradients else matmul
    spec = P("expert")
    step = jax.shard_map(
        fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, spec) if gradients else spec
    )
    sharding = NamedSharding(mesh, spec)
    args = (
        jax.ShapeDtypeStruct((8 * MGPU_M, MGPU_K), DTYPE, sharding=sharding),
        jax.ShapeDtypeStruct((8 * MGPU_G, MGPU_K, MGPU_N), DTYPE, sharding=sharding),
        jax.ShapeDtypeStruct((8 * MGPU_G,), jnp.int32, sharding=sharding),
    )
    return gpu_compile.compile_without_cache(jax.jit(step).lower(*args))


def test_jax_mgpu_weight_gradient_reads_the_host_so_auto_cannot_take_it_here():
    """Why "auto" on the H100s takes ragged_dot from this host: JAX's Mosaic GPU forward kernel
    (132 SMs fixed) lowers here to Mosaic GPU custom calls, and its weight-gradient kernel does
    not: its grid is ``jax.devices()[0].core_count``, the CPU host's device, which has none. When
    JAX reads the target instead, this fails: then drop the host check of
    `resolve._mgpu_supported` so that "auto" takes mgpu here too (issue 75)."""
    if operands.host_is_hopper():
        pytest.skip("this host is a Hopper GPU: the kernels lower from it")
    assert MOSAIC_GPU in _mgpu_compiled(gradients=False).as_text()
    with pytest.raises(AttributeError) as caught:
        _mgpu_compiled(gradients=True)
    last = caught.traceback[-1]  # where it was raised: JAX's kernel reading the host's SMs
    assert str(last.path).endswith("transposed_ragged_dot_mgpu.py"), caught.traceback
    assert "jax.devices()[0].core_count" in str(last.statement), last.statement


@pytest.mark.slow  # shares the compiled step of the tests above
def test_step_carries_the_kernel_auto_takes_for_the_h100s():
    """The compiled step's experts are the kernel "auto" resolves from the mesh's facts for
    their bf16 operands (gate and up: K=D=128, N=F=256; down: K=256, N=128; all fit mgpu):
    ragged_dot from this host (no Mosaic GPU call), mgpu from a Hopper host."""
    mesh = mesh_of("ep8")
    facts = resolve.facts_of(mesh)
    chosen = {
        resolve.resolve("expert_kernel", "auto", "gpu", dataclasses.replace(facts, operands=ops))
        for ops in (_operands((64, D), (E, D, F)), _operands((64, F), (E, F, D)))
    }
    assert chosen == {"mgpu" if operands.host_is_hopper() else "ragged_dot"}
    text = compiled_step("ep8", True).text
    assert (MOSAIC_GPU in text) == (chosen == {"mgpu"})


@pytest.mark.slow  # a step lowers and compiles in about 30 CPU-seconds
def test_explicit_tokamax_lowers_for_the_h100s_within_their_default_device():
    """tokamax's Mosaic GPU kernels read JAX's default device: within ``jax.default_device`` of
    one of the H100s the step asked for tokamax compiles here, its experts Mosaic GPU calls;
    outside it the layer refuses tokamax in one line naming that remedy."""
    pytest.importorskip("tokamax")
    mesh = mesh_of("ep8")
    helpers.assert_raises_one_line(
        ValueError,
        r"expert_kernel='tokamax': tokamax's Mosaic GPU kernel picks its variant from JAX's "
        r"default device .*jax\.default_device",
        compiled_step.__wrapped__,
        "ep8",
        True,
        "tokamax",
    )
    with jax.default_device(mesh.devices.flat[0]):
        text = compiled_step.__wrapped__("ep8", True, "tokamax").text
    assert MOSAIC_GPU in text
