"""The collectives of the layer's steps, read from their jaxprs (`tests/helpers/collectives.py`;
DESIGN.md section 13): no all-reduce touches an exchange's rows (the transpose of a cast after
`ragged_all_to_all` all-reduced the receive buffer's cotangent over the EP group), no collective
in a plan-chosen branch names an axis the plan may differ on (a psum over "data" in the replica
transfer's `lax.cond` hung when data groups took different branches), and each step's
collectives, counted by kind, axes and place, equal `TABLES`, so that a new one shows in review.

Tracing only (`jax.make_jaxpr`, nothing compiled). The steps are a matrix that takes each
dimension at least once in few traces (a balanced gradient traces in about 3 s on one core): the
balanced and the plain layer; forward, `jax.grad`, value-and-grad under `jax.checkpoint`; EP8,
data x EP, FSDP x EP (weights split over "fsdp" as MaxText splits them) and EP x tensor; Explicit
and Auto axes; the padded exchange (CPU's) and the ragged one traced for CUDA, for TPU and for
both (`platform_dependent`); the native and the portable planner. The checker's own cases, on
small hand-made shard_maps, come first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from tests import helpers
from tests.helpers import collectives as coll
from tests.helpers import layer_cases as lc
from ultraep_jax._vma import vary
from ultraep_jax.config import resolve

# Every case on each JAX line (conftest.py, --suite=quick): what it checks is what a JAX version
# compiles.
pytestmark = pytest.mark.every_case

E, TOP_K, BATCH, SEQ, SLOTS = 8, 2, 8, 4, 2

# -- the checker on hand-made programs ---------------------------------------------------------


def _dp2ep4():
    """("data", "expert") = (2, 4), Auto axes (shard_map splits unplaced inputs)."""
    return helpers.auto_axes(helpers.expert_mesh(4, 2))


def _traced(fn, mesh, *args, in_specs, out_specs, grad=None):
    """`coll.collectives` of ``fn`` in a shard_map over ``mesh`` (with ``grad``, argnums: of the
    gradient of its sum)."""
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    step = mapped if grad is None else jax.grad(lambda *a: jnp.sum(mapped(*a)), grad)
    return coll.collectives(jax.make_jaxpr(step)(*args))


def _ragged(operand, output, sizes=None):
    """`jax.lax.ragged_all_to_all` over "expert" of ``operand`` [4, D] into ``output`` [4, D],
    ``sizes`` [4] rows (default one) to each of the 4 ranks."""
    sizes = jnp.ones((4,), jnp.int32) if sizes is None else sizes
    offsets = jnp.arange(4, dtype=jnp.int32)
    return jax.lax.ragged_all_to_all(
        operand, output, offsets, sizes, offsets, sizes, axis_name="expert"
    )


def test_branch_collective_over_an_axis_the_index_varies_on_is_found():
    """A psum over "data" in a branch whose index varies over "data" is reported; a psum over
    "expert" there is not (within an EP group every rank takes the same branch), nor a psum over
    "data" in a `platform_dependent` branch (its index is the platform)."""
    mesh = _dp2ep4()

    def body(flag, w):  # flag [1] varies over "data" only: it is the same within an EP group
        pick = lambda axis: lambda w: jax.lax.psum(w, axis)  # noqa: E731
        a = jax.lax.cond(flag[0] > 0, pick("data"), lambda w: w, w)
        b = jax.lax.cond(flag[0] > 0, pick("expert"), lambda w: w, w)
        c = jax.lax.platform_dependent(w, cpu=pick("data"), default=lambda w: w)
        return a + b + c

    flag = jnp.zeros((2,), jnp.int32)
    w = jnp.ones((8, 4))
    trace = _traced(body, mesh, flag, w, in_specs=(P("data"), P()), out_specs=P())
    problems = coll.nonuniform_branch_collectives(trace)
    assert (
        len(problems) == 1
        and "over ('data',) (cond, index varying over [['data']])" in (problems[0])
    ), problems
    assert coll.table(trace) == {
        ("psum", "data", "cond"): 1,
        ("psum", "data", "platform"): 1,
        ("psum", "expert", "cond"): 1,
    }


def test_a_cast_in_a_branch_is_found_in_the_gradient():
    """A weight cast to vary over "data" inside the branch (old code's replica transfer): its
    transpose is a psum over "data" in the backward branch, which the gradient's trace shows."""
    mesh = _dp2ep4()

    def body(flag, w, x):  # w invariant over "data", x varying over it
        fetch = lambda w, x: vary(w, ("data", "expert")) * x  # noqa: E731
        return jax.lax.cond(flag[0] > 0, fetch, lambda w, x: x, w, x)

    args = (jnp.zeros((2,), jnp.int32), jnp.ones((4, 4)), jnp.ones((8, 4)))
    rows = P(("data", "expert"))
    specs = dict(in_specs=(P("data"), P("expert"), rows), out_specs=rows)
    forward = _traced(body, mesh, *args, **specs)
    assert coll.nonuniform_branch_collectives(forward) == []
    assert [c.axes for c in forward.casts if c.place == "cond"] == [("data",)]
    problems = coll.nonuniform_branch_collectives(_traced(body, mesh, *args, **specs, grad=1))
    assert len(problems) == 1 and "over ('data',)" in problems[0], problems


def test_psum_feeding_or_reducing_an_exchange_is_found():
    """A psum whose result reaches a ragged_all_to_all's operand (through a scan's carry, a jit
    and a while loop's carry; through a cond's operand into its branch), or its output buffer,
    or one over the EP axis of what it received, is reported; a psum over another axis of the
    received rows (the tensor axis's sum of partial outputs) and one of its sizes are not."""
    mesh = _dp2ep4()

    def body(x):  # x [4, D] varying over both axes
        summed = jax.lax.psum(x, "expert")
        zeros = vary(jnp.zeros_like(x), ("data", "expert"))

        def carry(c, _):
            return jax.jit(lambda c: c * 2.0)(c), None

        looped, _ = jax.lax.scan(carry, summed, None, length=2)
        _, looped = jax.lax.while_loop(
            lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] * 2.0), (0, looped)
        )
        through_loops = _ragged(looped, zeros)
        into_output = _ragged(x, summed)
        in_branch = jax.lax.cond(x[0, 0] > 0, lambda s: _ragged(s, zeros), lambda s: x, summed)
        received = _ragged(x, zeros)
        reduced = jax.lax.psum(received, "expert")
        other_axis = jax.lax.psum(received, "data")
        return through_loops + into_output + in_branch + reduced + other_axis

    x = jnp.ones((32, 4))
    rows = P(("data", "expert"))
    trace = _traced(body, mesh, x, in_specs=rows, out_specs=rows)
    problems = coll.psums_on_exchanges(trace)
    feeds = [p for p in problems if " feeds " in p]
    reduces = [p for p in problems if " reduces the rows of " in p]
    assert len(feeds) == 3 and len(reduces) == 1, problems
    assert all(p.startswith("psum") and "over ('expert',)" in p for p in problems), problems

    def clean(x):
        sizes = jax.lax.psum(jnp.ones((4,), jnp.int32), "expert") // 4
        return jax.lax.psum(_ragged(x, jnp.zeros_like(x), sizes), "data")

    trace = _traced(clean, mesh, x, in_specs=rows, out_specs=P("expert"))
    assert coll.psums_on_exchanges(trace) == []


# -- the layer's steps ---------------------------------------------------------------------------

#: The meshes by name: (axis sizes, axis names).
MESHES = {
    "ep8": ((8,), ("expert",)),
    "dp2ep4": ((2, 4), ("data", "expert")),
    "fsdp2ep4": ((2, 4), ("fsdp", "expert")),
    "ep4tp2": ((4, 2), ("expert", "tensor")),
}
#: MaxText's placement of the expert weights on its FSDP x EP mesh: the model width over "fsdp"
#: (its logical axis "embed_moe"), the experts over "expert"
#: (`maxtext.layers.moe.RoutedMoE.wi_kernel_axes` / ``wo_kernel_axes``).
FSDP_SPECS = {
    "router_kernel": P("fsdp", None),
    "w_gate": P("expert", "fsdp", None),
    "w_up": P("expert", "fsdp", None),
    "w_down": P("expert", None, "fsdp"),
}


@dataclasses.dataclass(frozen=True)
class Step:
    """One traced step.

    mesh: a `MESHES` key; axis_types: "explicit" or "auto"; balanced: the layer with a
    `BalancerConfig` (`layer_cases.balancer_config`) or plain (None); step: "forward" (y and
    stats), "grad" (`jax.grad` in the parameters and x) or "remat" (value and grad of the layer
    under `jax.checkpoint` with ``policy``: "names", `uep.remat.NAMES` saved, or "nothing");
    platforms: those traced for (`resolve.lowering_for`: "cuda" and "tpu" take the ragged
    exchange), () for the mesh's (CPU: the padded one); planner: `Execution.planner`."""

    mesh: str
    axis_types: str
    balanced: bool
    step: str
    platforms: tuple[str, ...] = ()
    planner: str = "auto"
    policy: str = "names"
    kernel: str = "auto"

    @property
    def id(self) -> str:
        layer = "balanced" if self.balanced else "plain"
        where = "+".join(self.platforms) or "cpu"
        step = self.step if self.step != "remat" else f"remat_{self.policy}"
        kernel = "" if self.kernel == "auto" else f"-{self.kernel}"
        return f"{self.mesh}-{self.axis_types}-{layer}-{step}-{where}-{self.planner}{kernel}"


#: The matrix: every mesh, axis type, layer, step, exchange (and platform) and planner at least
#: once, in 7 traces. Before this round's fixes (95714ac), a psum over "data" ("fsdp") in the
#: plan-chosen cond showed in the 2nd, 3rd and 5th, and on jax <= 0.12.0 a psum feeding
#: ragged_all_to_all (the transpose of a cast after the exchange) in the 3rd, 4th and 6th.
STEPS = [
    Step("ep8", "explicit", True, "forward", planner="portable"),
    Step("dp2ep4", "explicit", True, "grad", planner="native"),
    Step("dp2ep4", "auto", True, "grad", ("cuda",)),
    Step("dp2ep4", "auto", False, "grad", ("tpu",)),
    Step("fsdp2ep4", "explicit", True, "remat"),
    Step("ep4tp2", "auto", True, "grad", ("cuda", "tpu")),
    Step("ep8", "auto", False, "remat", policy="nothing"),
    # tokamax's custom_vjp on a data axis (where tokamax is installed: the MaxText line).
    Step("dp2ep4", "explicit", True, "grad", kernel="tokamax"),
]


def _mesh(step: Step) -> jax.sharding.Mesh:
    """``step``'s mesh of the first devices, with its axis types."""
    sizes, names = MESHES[step.mesh]
    mesh = jax.make_mesh(sizes, names, devices=jax.devices()[: int(np.prod(sizes))])
    return helpers.auto_axes(mesh) if step.axis_types == "auto" else mesh


def _layer(step: Step, mesh) -> uep.MoE:
    """The layer of ``step`` (D, F of `layer_cases`), abstract (`nnx.eval_shape`: nothing is
    computed), its weights placed as MaxText places them on the FSDP mesh."""
    options = dict(planner=step.planner, expert_kernel=step.kernel)
    if "tensor" in mesh.axis_names:
        options["tensor_axis"] = "tensor"
    balancer = lc.balancer_config(mesh, E, SLOTS) if step.balanced else None
    layer = nnx.eval_shape(lambda: lc.build_layer(mesh, E, TOP_K, balancer, None, **options))
    if "fsdp" in mesh.axis_names:
        for name, spec in FSDP_SPECS.items():
            var = getattr(layer, name)
            typed = jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=NamedSharding(mesh, spec))
            var.set_value(typed)
    return layer


def _function(step: Step, graphdef, rest):
    """``step``'s function of (params, x)."""

    def forward(params, x):
        return nnx.merge(graphdef, params, rest)(x)

    def loss(params, x):
        y, _ = forward(params, x)
        return jnp.sum(y * y)

    if step.step == "forward":
        return forward
    if step.step == "grad":
        return jax.grad(loss, argnums=(0, 1))
    policies = {
        "names": jax.checkpoint_policies.save_only_these_names(*uep.remat.NAMES),
        "nothing": jax.checkpoint_policies.nothing_saveable,
    }
    return jax.value_and_grad(jax.checkpoint(loss, policy=policies[step.policy]), argnums=(0, 1))


@functools.cache
def trace_step(step: Step) -> coll.Trace:
    """`coll.collectives` of ``step``'s jaxpr."""
    mesh = _mesh(step)
    layer = _layer(step, mesh)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    token_axes = tuple(a for a in mesh.axis_names if a != "tensor")
    x = jax.ShapeDtypeStruct(
        (BATCH, SEQ, lc.D), jnp.float32, sharding=NamedSharding(mesh, P(token_axes))
    )
    within = resolve.lowering_for(step.platforms) if step.platforms else contextlib.nullcontext()
    with within:
        jaxpr = jax.make_jaxpr(_function(step, graphdef, rest))(params, x)
    return coll.collectives(jaxpr)


#: Each step's collectives (casts left out): (kind, axes, place) -> count, place "cond" inside a
#: value-chosen cond or switch, "platform" inside `platform_dependent` branches only, "-" in
#: neither. A change here is a change in what the step communicates: review it.
TABLES = {
    "ep8-explicit-balanced-forward-cpu-portable": {
        ("all_gather", "expert", "-"): 1,
        ("all_to_all", "expert", "-"): 2,
        ("psum_scatter", "expert", "cond"): 2,
    },
    "dp2ep4-explicit-balanced-grad-cpu-native": {
        ("all_gather", "expert", "-"): 1,
        ("all_gather", "expert", "cond"): 2,
        ("all_to_all", "expert", "-"): 4,
        ("pmax", "data", "-"): 3,
        ("psum", "data", "-"): 12,
        ("psum_scatter", "expert", "cond"): 2,
    },
    "dp2ep4-auto-balanced-grad-cuda-auto": {
        ("all_gather", "expert", "-"): 1,
        ("all_to_all", "expert", "-"): 4,
        ("all_to_all", "expert", "cond"): 4,
        ("pmax", "data", "-"): 3,
        ("psum", "data", "-"): 12,
        ("ragged_all_to_all", "expert", "-"): 4,
        ("ragged_all_to_all", "expert", "cond"): 4,
    },
    "dp2ep4-auto-plain-grad-tpu-auto": {
        ("all_gather", "expert", "-"): 1,
        ("all_to_all", "expert", "-"): 4,
        ("pmax", "data", "-"): 3,
        ("psum", "data", "-"): 12,
        ("ragged_all_to_all", "expert", "-"): 4,
    },
    "fsdp2ep4-explicit-balanced-remat_names-cpu-auto": {
        ("all_gather", "expert", "-"): 1,
        ("all_gather", "expert", "cond"): 2,
        ("all_to_all", "expert", "-"): 4,
        ("psum", "fsdp", "-"): 3,
        ("psum_scatter", "expert", "cond"): 2,
    },
    "ep4tp2-auto-balanced-grad-cuda+tpu-auto": {
        ("all_gather", "expert", "-"): 1,
        ("all_to_all", "expert", "cond"): 4,
        ("all_to_all", "expert", "platform"): 8,
        ("psum", "tensor", "-"): 3,
        ("ragged_all_to_all", "expert", "cond"): 4,
        ("ragged_all_to_all", "expert", "platform"): 8,
    },
    "ep8-auto-plain-remat_nothing-cpu-auto": {
        ("all_gather", "expert", "-"): 2,
        ("all_to_all", "expert", "-"): 6,
    },
}
#: tokamax's kernel communicates nothing of its own: the native dp2 x ep4 step's collectives.
TABLES["dp2ep4-explicit-balanced-grad-cpu-auto-tokamax"] = TABLES[
    "dp2ep4-explicit-balanced-grad-cpu-native"
]


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.id)
def test_step_collectives(step):
    """No all-reduce touches an exchange's rows; no branch collective names an axis its index
    varies over; the collectives are `TABLES`'."""
    if step.kernel == "tokamax" and not resolve.tokamax_installed():
        pytest.skip("tokamax is not installed (its extra: Python >= 3.12)")
    trace = trace_step(step)
    coll.assert_sound(trace, step.id)
    assert coll.table(trace) == TABLES[step.id]
