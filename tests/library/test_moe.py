"""The balanced MoE layer (`uep.MoE`) against the dense one-device reference.

Everything runs on the 8 simulated CPU devices forced by conftest.py. The reference is the
independent oracle of tests/references: it never calls the library's layer, only the math of the
layer (softmax top-k routing, routing.py; SwiGLU experts, moe.py; the plan's quotas, planner.py;
the dispatch rules, dispatch.py). Routing decisions are checked to have a clear margin (the k-th and
(k+1)-th logits differ by more than float32 noise), so that the layer and the reference pick the
same experts.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ultraep_jax as uep
from tests import helpers
from tests.helpers import make_mesh, place_batch
from tests.helpers.layer_cases import (
    CASES,
    PARAM_NAMES,
    RAGGED_OP,
    SKEWED,
    D,
    assert_close,
    balancer_config,
    build_layer,
    group_imbalance,
    independent_loads,
    layer_forward,
    layer_value_and_grads,
    make_inputs,
    mesh_groups,
    pure_forward,
    rank_loads,
    reference_experts,
    reference_value_and_grads,
    run_case,
)
from tests.references.dispatch import kept_pairs, prefix_transport
from tests.references.layer import reference_layer
from tests.references.planner import reference_plan
from tests.references.routing import Router
from ultraep_jax.planning import native

# One test process computes the cases it caches (pytest-xdist).
pytestmark = pytest.mark.xdist_group("test_moe")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("which", ["balanced", "plain"])
def test_output_and_grads_equal_dense_reference(case, which):
    res = run_case(case)
    ref_y, ref_gx, ref_gp = res["ref"]
    y, _, gx, gp = res[which]
    assert y.shape == res["x"].shape and y.dtype == np.float32
    assert_close(y, ref_y, f"{which} y")
    assert_close(gx, ref_gx, f"{which} d/dx")
    for name in PARAM_NAMES:
        assert gp[name].shape == ref_gp[name].shape, name
        assert_close(gp[name], ref_gp[name], f"{which} d/d{name}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_balanced_equals_unbalanced(case):
    res = run_case(case)
    y_b, _, gx_b, gp_b = res["balanced"]
    y_p, _, gx_p, gp_p = res["plain"]
    assert_close(y_b, y_p, "y balanced vs plain")
    assert_close(gx_b, gx_p, "d/dx balanced vs plain")
    for name in PARAM_NAMES:
        assert_close(gp_b[name], gp_p[name], f"d/d{name} balanced vs plain")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_dropless_stats(case):
    res = run_case(case)
    mesh = make_mesh(case.mesh)
    G, R = mesh_groups(mesh)
    before = rank_loads(res["loads"])  # [G, R]
    total = G * R * (case.batch // (G * R)) * case.seq * case.top_k
    assert before.sum() == total
    for which in ("balanced", "plain"):
        stats = res[which][1]
        assert stats["rank_load_before"].shape == (R,) and stats["rank_load_after"].shape == (R,)
        assert stats["rank_load_before"].dtype == np.int32, which
        np.testing.assert_array_equal(stats["rank_load_before"], before.sum(0), err_msg=which)
        assert int(stats["rank_load_after"].sum()) == total, which
        assert int(stats["dropped"]) == 0, which
        np.testing.assert_allclose(stats["imbalance_before"], group_imbalance(before), rtol=1e-6)
        assert stats["imbalance_after"] <= stats["imbalance_before"] + 1e-6, which
    plain = res["plain"][1]
    np.testing.assert_array_equal(plain["rank_load_after"], plain["rank_load_before"])
    assert int(plain["replicas"]) == 0
    np.testing.assert_allclose(plain["imbalance_after"], plain["imbalance_before"], rtol=1e-6)
    # Dropless, the layer runs exactly the NumPy reference planner's plan of each group's loads.
    cfg = res["balancer"]
    plans = [
        reference_plan(
            res["loads"][g],
            cfg.slots_per_rank,
            cfg.min_tokens_per_replica,
            cfg.balance_eps,
            cfg.master_keep_tokens,
            capacity=R * (case.batch // (G * R)) * case.seq * case.top_k,
        )
        for g in range(G)
    ]
    bal = res["balanced"][1]
    np.testing.assert_array_equal(bal["rank_load_after"], sum(p["rank_load"] for p in plans))
    assert int(bal["replicas"]) == sum(int((p["slot_expert"] >= 0).sum()) for p in plans)
    want_after = np.stack([p["rank_load"] for p in plans])
    np.testing.assert_allclose(bal["imbalance_after"], group_imbalance(want_after), rtol=1e-6)
    assert int(bal["over_capacity"]) == 0 and int(plain["over_capacity"]) == 0


@pytest.mark.parametrize("placement", ["unplaced", "auto_mesh"])
def test_input_placement_does_not_matter(placement):
    """x as a plain array, or placed on an Auto-axes copy of the mesh, gives the same output and
    gradients as x placed on the user's mesh (`jax.make_mesh` gives Explicit axes)."""
    case = CASES[0]
    res = run_case(case)
    mesh = make_mesh(case.mesh)
    if placement == "unplaced":
        x = jnp.asarray(res["x"])
    else:
        x = place_batch(helpers.auto_axes(mesh), res["x"])
    layer = build_layer(mesh, case.num_experts, case.top_k, None, None, res["params"])
    y, _, gx, gp = layer_value_and_grads(layer, x, jnp.asarray(res["cotangent"]))
    y_ref, _, gx_ref, gp_ref = res["plain"]
    assert_close(y, y_ref, f"y, {placement} x")
    assert_close(gx, gx_ref, f"d/dx, {placement} x")
    for name in PARAM_NAMES:
        assert_close(gp[name], gp_ref[name], f"d/d{name}, {placement} x")


@pytest.mark.parametrize("case", SKEWED, ids=lambda c: c.id)
def test_replicated_expert_gradient_reaches_master(case):
    """A hot expert is replicated; its weight gradients (summed over master and replicas) equal
    the reference's."""
    res = run_case(case)
    mesh = make_mesh(case.mesh)
    G, _ = mesh_groups(mesh)
    stats = res["balanced"][1]
    assert stats["imbalance_before"] > 1.5, "the router was not skewed enough"
    assert int(stats["replicas"]) > 0
    replicated = set()
    for g in range(G):
        plan = uep.plan(res["loads"][g].astype(np.int32), res["balancer"])
        slot_expert, slot_quota = np.asarray(plan.slot_expert), np.asarray(plan.slot_quota)
        replicated |= {
            int(e) for e, q in zip(slot_expert.ravel(), slot_quota.ravel(), strict=True) if q > 0
        }
    assert replicated, "no replica carries tokens"
    _, _, ref_gp = res["ref"]
    gp = res["balanced"][3]
    for e in sorted(replicated):
        for name in ("w_gate", "w_up", "w_down"):
            assert np.abs(ref_gp[name][e]).max() > 0
            assert_close(gp[name][e], ref_gp[name][e], f"d/d{name}[{e}] (replicated expert)")


# -- capacity ------------------------------------------------------------------------------


def capacity_rows(capacity_factor, top_k, tokens_per_device) -> int:
    """Receive-buffer rows per rank."""
    return math.ceil(capacity_factor * top_k * tokens_per_device)


def expected_keep(x, params, mesh, num_experts, top_k, capacity, balancer):
    """[T, k] 0/1: the pairs the layer must keep, by the NumPy reference planner and the
    reference dispatch rules (tests/references/dispatch.py), per EP group."""
    G, R = mesh_groups(mesh)
    idx, _ = reference_experts(x, params["router_kernel"], top_k)
    experts = idx.reshape(G, R, -1)  # each source's pairs in pair order
    loads = independent_loads(x, params["router_kernel"], top_k, mesh, num_experts)
    keep = np.zeros_like(experts, dtype=bool)
    plans = []
    for g in range(G):
        if balancer is None:
            load_e = loads[g].sum(0)
            em = num_experts // R
            plan = {
                "slot_expert": np.zeros((R, 0), np.int64),
                "slot_quota": np.zeros((R, 0), np.int64),
                "master_quota": load_e,
                "rank_load": load_e.reshape(R, em).sum(1),
            }
        else:
            plan = reference_plan(
                loads[g],
                balancer.slots_per_rank,
                balancer.min_tokens_per_replica,
                balancer.balance_eps,
                balancer.master_keep_tokens,
                capacity=capacity,
            )
        assign = prefix_transport(
            loads[g], plan["slot_expert"], plan["slot_quota"], plan["master_quota"]
        )
        keep[g] = kept_pairs(experts[g], assign, plan["slot_expert"], capacity)
        plans.append(plan)
    return keep.reshape(-1, top_k).astype(np.float32), plans


def skewed_capacity_setup(mesh, seed):
    """Inputs and sizes for the capacity tests on ``mesh``: E=8, top-2, 16 tokens per device,
    skewed."""
    rng = np.random.default_rng(seed)
    batch, seq, num_experts, top_k = 8, 16, 8, 2
    x, params = make_inputs(rng, batch, seq, num_experts, top_k, skew=True, hot=[0, 1])
    tokens_per_device = batch * seq // mesh.size
    return x, params, num_experts, top_k, tokens_per_device


@pytest.mark.parametrize("mesh", ["ep8", "dp2ep4"], indirect=True)
def test_balanced_capacity_1_1_drops_nothing(mesh):
    x, params, E, k, _ = skewed_capacity_setup(mesh, seed=10)
    balancer = balancer_config(mesh, E, slots=2, balance_eps=0.01)
    layer = build_layer(mesh, E, k, balancer, 1.1, params)
    y, stats = layer_forward(layer, place_batch(mesh, x))
    assert stats["imbalance_before"] > 1.5, "the router was not skewed enough"
    assert int(stats["dropped"]) == 0
    assert float(stats["imbalance_after"]) <= 1.05
    assert int(stats["replicas"]) > 0
    assert int(stats["rank_load_after"].sum()) == x.shape[0] * x.shape[1] * k
    experts, _ = reference_experts(x, params["router_kernel"], k)
    ref = reference_layer(
        jnp.asarray(x),
        {n: jnp.asarray(v) for n, v in params.items()},
        experts,
        Router("softmax", experts.shape[-1]),
    )
    assert_close(y, ref, "balanced y with capacity 1.1")


@pytest.mark.parametrize(
    "mesh, slots, factor",
    [("ep8", 0, 1.1), ("dp2ep4", 0, 1.1), ("ep8", 1, 0.8), ("dp2ep4", 1, 0.8)],
    ids=["plain-ep8", "plain-dp2ep4", "replicas-ep8", "replicas-dp2ep4"],
    indirect=["mesh"],
)
def test_capacity_drops_exactly_the_pairs_the_rule_names(mesh, slots, factor):
    """Under a receive buffer too small for the load (plain EP, or balanced with too few slots
    and a buffer below the mean), the layer drops exactly the pairs named by the rule: plan,
    locality-first reroute, destination stores sources in rank order, each by local group, each
    group in pair order, keeps the first ``capacity`` rows. Output equals the dense reference with
    those pairs removed; the drop count matches."""
    x, params, E, k, tokens_per_device = skewed_capacity_setup(mesh, seed=10)
    capacity = capacity_rows(factor, k, tokens_per_device)
    balancer = balancer_config(mesh, E, slots=slots) if slots else None
    layer = build_layer(mesh, E, k, balancer, factor, params)
    y, stats = layer_forward(layer, place_batch(mesh, x))
    keep, plans = expected_keep(x, params, mesh, E, k, capacity, balancer)
    want_dropped = int((keep == 0).sum())
    assert want_dropped > 0, "the buffer did not overflow"
    assert int(stats["dropped"]) == want_dropped
    if slots:
        assert int(stats["replicas"]) > 0, "no replica: the case does not test drops with replicas"
        over = sum(int(max(p["rank_load"]) > capacity) for p in plans)
        assert int(stats["over_capacity"]) == over > 0
    experts, _ = reference_experts(x, params["router_kernel"], k)
    params_j = {n: jnp.asarray(v) for n, v in params.items()}
    router = Router("softmax", experts.shape[-1])
    ref = reference_layer(jnp.asarray(x), params_j, experts, router, keep=jnp.asarray(keep))
    assert_close(y, ref, "output with the rule's pairs dropped")


# -- lowering ------------------------------------------------------------------------------


def _hlo_layer(mesh, balanced: bool):
    rng = np.random.default_rng(20)
    x, params = make_inputs(rng, 8, 8, 8, 2, skew=True)
    balancer = balancer_config(mesh, 8, slots=2) if balanced else None
    return mesh, build_layer(mesh, 8, 2, balancer, 1.25, params), place_batch(mesh, x)


def test_cpu_lowering_has_planner_custom_call_no_callback_no_ragged(ep8_mesh):
    _, layer, x = _hlo_layer(ep8_mesh, balanced=True)
    fn, params, rest = pure_forward(layer)
    text = jax.jit(fn).lower(params, rest, x).as_text()
    assert "ultraep_plan" in text
    assert "callback" not in text
    assert not RAGGED_OP.search(text)

    def loss(params, rest, x):
        y, _ = fn(params, rest, x)
        return jnp.sum(y * y)

    grad_text = jax.jit(jax.grad(loss, argnums=(0, 2))).lower(params, rest, x).as_text()
    assert "ultraep_plan" in grad_text
    assert "callback" not in grad_text
    assert not RAGGED_OP.search(grad_text)


def _cuda_text(balanced: bool) -> str:
    mesh = helpers.gpu_expert_mesh(8)
    balancer = balancer_config(mesh, 8, slots=2) if balanced else None
    layer = nnx.eval_shape(lambda: build_layer(mesh, 8, 2, balancer, 1.25))
    x = helpers.abstract_batch(mesh, (8, 8, D), jnp.float32)
    fn, params, rest = pure_forward(layer)
    exported = jax.export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("ultraep_plan"),
            # ragged_all_to_all has no export compatibility guarantee in this JAX
            jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all"),
        ],
    )(params, rest, x)
    assert exported.platforms == ("cuda",)
    return exported.mlir_module()


def test_cuda_lowering_uses_ragged_all_to_all_for_tokens_and_weights():
    balanced = _cuda_text(balanced=True)
    plain = _cuda_text(balanced=False)
    # The planner's custom call where this install built the CUDA handler, else the portable one.
    assert ("ultraep_plan" in balanced) == native.has_cuda_handler()
    assert "ultraep_plan" not in plain
    assert "callback" not in balanced and "callback" not in plain
    n_balanced = len(RAGGED_OP.findall(balanced))
    n_plain = len(RAGGED_OP.findall(plain))
    assert n_plain >= 2, "token dispatch out and back"
    assert n_balanced >= 3, "token dispatch out and back, and the replica weight transfer"
    assert n_balanced > n_plain


# -- bad input ----------------------------------------------------------------------------


def _layer(mesh=None, num_experts=8, top_k=2, balancer="default", capacity_factor=1.25, **kw):
    mesh = make_mesh("ep8") if mesh is None else mesh
    if balancer == "default":
        balancer = balancer_config(mesh, num_experts, slots=1)
    return build_layer(mesh, num_experts, top_k, balancer, capacity_factor, **kw)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_k=9), "top_k"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-1), "top_k"),
        (dict(num_experts=12, balancer=None), r"divisible|multiple"),
        (dict(num_experts=4, balancer=None), r"divisible|multiple|expert"),
        (dict(balancer=uep.BalancerConfig(num_experts=16, ep_size=8)), r"(?i)balancer"),
        (dict(balancer=uep.BalancerConfig(num_experts=8, ep_size=4)), r"(?i)balancer"),
    ],
)
def test_bad_construction_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _layer(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(capacity_factor=float("inf")),
            "capacity_factor must be a finite number > 0, got inf",
        ),
        (
            dict(capacity_factor=float("nan")),
            "capacity_factor must be a finite number > 0, got nan",
        ),
        (dict(router=uep.SigmoidTopK(2, num_groups=3)), "8 experts do not split into num_groups=3"),
        (
            dict(top_k=3, router=uep.SigmoidTopK(3, num_groups=4, top_groups=1)),
            "top_k=3 exceeds the experts of 1 groups of 2",
        ),
        (dict(top_k=np.int64(0)), "top_k must be a positive int, got 0"),
    ],
    ids=["cf_inf", "cf_nan", "groups", "top_k_in_groups", "np_top_k_0"],
)
def test_bad_configuration_raises_one_line_at_construction(kwargs, match):
    """Values that used to pass construction and fail at the first call (or never), refused by
    `MoE(...)` with one line naming the value."""
    with pytest.raises(ValueError, match=re.escape(match)) as info:
        _layer(**kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(balancer=uep.BalancerConfig(slots_per_rank=0)), "no spare slot"),
        (dict(expert_axis="ep"), "the mesh has no axis 'ep'"),
    ],
    ids=["no_slots", "missing_axis"],
)
def test_construction_errors_name_moe(kwargs, match):
    """The configuration `MoE` builds (`ExpertParallel`) raises; the line names `MoE`, the entry
    the user called."""
    with pytest.raises(ValueError, match=re.escape(match)) as info:
        uep.MoE(8, 8, 8, 2, make_mesh("ep8"), rngs=nnx.Rngs(0), **kwargs)
    assert str(info.value).startswith("MoE: ") and "ExpertParallel" not in str(info.value)


def test_numpy_scalars_are_accepted_as_python_numbers(ep8_mesh):
    """NumPy integers and floats are accepted wherever Python ones are (as `BalancerConfig` does)
    and stored as Python numbers, so configurations compare and hash alike."""
    layer = _layer(num_experts=np.int64(8), top_k=np.int32(2), capacity_factor=np.float32(1.1))
    assert type(layer.top_k) is int and layer.top_k == 2
    assert type(layer.ep.num_experts) is int and layer.ep.num_experts == 8
    assert type(layer.ep.capacity_factor) is float
    assert layer.ep.capacity_factor == float(np.float32(1.1))
    assert layer.capacity(32) == math.ceil(float(np.float32(1.1)) * 2 * 32)
    assert uep.ExpertParallel(ep8_mesh, np.int64(8), capacity_factor=np.float64(1.5)) == (
        uep.ExpertParallel(ep8_mesh, 8, capacity_factor=1.5)
    )


@pytest.mark.parametrize(
    "x, error, match",
    [
        (
            jnp.zeros((0, 8, D)),
            ValueError,
            r"batch and seq must be >= 1, got x of shape \(0, 8, 8\)",
        ),
        (
            jnp.zeros((8, 0, D)),
            ValueError,
            r"batch and seq must be >= 1, got x of shape \(8, 0, 8\)",
        ),
        (jnp.ones((8, 8, D), jnp.int32), TypeError, "x must have a real floating-point dtype"),
        (jnp.ones((8, 8, D), jnp.complex64), TypeError, "x must have a real floating-point"),
    ],
    ids=["batch0", "seq0", "int", "complex"],
)
def test_bad_call_raises_one_line(x, error, match):
    """An empty batch or sequence used to raise ZeroDivisionError; integer x gave truncated
    integer outputs and complex x was accepted."""
    with pytest.raises(error, match=match) as info:
        _layer()(x)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "shape",
    [(64, D), (8, 8, D + 1), (8, 8, D // 2), (8, 8, 1, D)],
    ids=["rank2", "wide", "narrow", "rank4"],
)
def test_bad_input_raises_at_trace_time(shape):
    layer = _layer()
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    with pytest.raises(ValueError, match=r"x must be \[batch, seq, d_model"):
        jax.eval_shape(lambda p, r, x: nnx.merge(graphdef, p, r)(x), params, rest, x)


def test_bad_input_raises_when_called_eagerly():
    layer = _layer()
    with pytest.raises(ValueError, match=r"x must be \[batch, seq, d_model"):
        layer(jnp.zeros((64, D), jnp.float32))
    with pytest.raises(ValueError, match=r"x must be \[batch, seq, d_model"):
        layer(jnp.zeros((8, 8, D + 1), jnp.float32))


# -- eager use ------------------------------------------------------------------------------


def test_eager_calls_compile_once_and_match_jit(ep8_mesh):
    """The layer called outside `jax.jit` compiles a handful of programs on the first call and
    none on later calls of the same shape, and gives the jitted result."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: (
            compiles.append(event)
            if event == "/jax/core/compile/backend_compile_duration"
            else None
        )
    )
    rng = np.random.default_rng(30)
    x, params = make_inputs(rng, 8, 8, 8, 2, skew=True)
    layer = build_layer(ep8_mesh, 8, 2, balancer_config(ep8_mesh, 8, slots=2), 1.25, params)
    xs = place_batch(ep8_mesh, x)
    y_jit, stats_jit = layer_forward(layer, xs)
    before = len(compiles)
    y1, _ = layer(xs)
    first = len(compiles) - before
    x2 = xs * 1.0
    before_second = len(compiles)
    y2, stats2 = layer(x2)
    assert first <= 3, f"the first eager call compiled {first} programs"
    assert len(compiles) == before_second, "a second eager call recompiled"
    assert_close(np.asarray(y1), y_jit, "eager y vs jit")
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y1))
    np.testing.assert_array_equal(np.asarray(stats2.rank_load_after), stats_jit["rank_load_after"])


def test_one_expert_rank_equals_reference():
    """EP size 1 (every device a data group): the balancer has nothing to do and nothing is
    exchanged; values and gradients still equal the dense reference."""
    mesh = helpers.expert_mesh(1, dp=8)
    rng = np.random.default_rng(40)
    x, params = make_inputs(rng, 8, 4, 4, 2, skew=True)
    balancer = uep.BalancerConfig(num_experts=4, ep_size=1, slots_per_rank=2, min_tokens_per_rank=0)
    layer = build_layer(mesh, 4, 2, balancer, 1.0, params)
    cotangent = rng.normal(size=x.shape).astype(np.float32)
    y, stats, gx, gp = layer_value_and_grads(layer, place_batch(mesh, x), jnp.asarray(cotangent))
    ref_y, ref_gx, ref_gp = reference_value_and_grads(
        jnp.asarray(x), {k: jnp.asarray(v) for k, v in params.items()}, cotangent, 2
    )
    assert int(stats["replicas"]) == 0 and int(stats["dropped"]) == 0
    assert_close(y, ref_y, "y at EP=1")
    assert_close(gx, ref_gx, "d/dx at EP=1")
    for name in PARAM_NAMES:
        assert_close(gp[name], ref_gp[name], f"d/d{name} at EP=1")
