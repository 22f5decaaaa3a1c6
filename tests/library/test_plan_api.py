"""The public planner API: validation, the FFI call under every JAX transformation, lowering."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from tests.helpers import expert_mesh
from tests.references.planner import check_plan_invariants, rank_loads_before, reference_plan
from ultraep_jax.planning import native


def _skewed_loads(rng, R, E, hot=3):
    loads = rng.integers(0, 200, size=(R, E))
    loads[:, rng.choice(E, size=hot, replace=False)] += rng.integers(500, 3000, size=(R, hot))
    return loads.astype(np.int32)


def _as_numpy(plan):
    return {k: np.asarray(v) for k, v in vars(plan).items()}


CFG = uep.BalancerConfig(num_experts=16, ep_size=8, slots_per_rank=2, min_tokens_per_replica=64)


# -- configuration and input validation -------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"num_experts": 10, "ep_size": 4}, ValueError, "not divisible"),
        ({"num_experts": 8, "ep_size": 0}, ValueError, "ep_size must be a positive int, got 0"),
        ({"num_experts": 8, "ep_size": 4, "slots_per_rank": -1}, ValueError, "slots_per_rank"),
        (
            {"num_experts": 8, "ep_size": 4, "min_tokens_per_replica": 0},
            ValueError,
            "min_tokens_per_replica",
        ),
        ({"num_experts": 8, "ep_size": 4, "balance_eps": -0.1}, ValueError, "balance_eps"),
        ({"num_experts": 8, "ep_size": 4, "balance_eps": float("nan")}, ValueError, "balance_eps"),
        ({"num_experts": 8.0, "ep_size": 4}, TypeError, "num_experts must be an int"),
        ({"num_experts": 8, "ep_size": 4, "slots_per_rank": True}, TypeError, "slots_per_rank"),
        ({"num_experts": 8, "ep_size": np.bool_(True)}, TypeError, "ep_size must be an int"),
        (
            {"num_experts": 8, "ep_size": 4, "balance_eps": "0.1"},
            TypeError,
            "balance_eps must be a",
        ),
        (
            {"num_experts": 8, "ep_size": 4, "balance_eps": False},
            TypeError,
            "balance_eps must be a",
        ),
        ({"num_experts": 8, "ep_size": 4, "balance_eps": float("inf")}, ValueError, "balance_eps"),
        # above int64: the planner's attributes are int64, so these would fail later, obscurely
        (
            {"num_experts": 8, "ep_size": 4, "min_tokens_per_replica": 2**63},
            ValueError,
            r"min_tokens_per_replica must be <= 2147483647, got 9223372036854775808$",
        ),
        (
            {"num_experts": 8, "ep_size": 4, "master_keep_tokens": 2**64 + 5},
            ValueError,
            r"master_keep_tokens must fit in int64",
        ),
        ({"num_experts": 8, "ep_size": 4, "slots_per_rank": 2**70}, ValueError, "slots_per_rank"),
        ({"num_experts": 8, "ep_size": 4, "master_keep_tokens": -1}, ValueError, "master_keep"),
        # the documented bounds: a floor beyond any int32 load (it used to abort the process),
        # and more slots than a rank can fill (an opaque TypeError at 2**61, out of memory at
        # 2**40), NumPy integers included
        (
            {"num_experts": 8, "ep_size": 4, "min_tokens_per_replica": 2**62},
            ValueError,
            r"^BalancerConfig.min_tokens_per_replica must be <= 2147483647, "
            r"got 4611686018427387904$",
        ),
        (
            {"num_experts": 8, "ep_size": 4, "min_tokens_per_replica": np.int64(2**31)},
            ValueError,
            r"min_tokens_per_replica must be <= 2147483647, got 2147483648$",
        ),
        (
            {"num_experts": 8, "ep_size": 4, "slots_per_rank": 2**61},
            ValueError,
            r"^BalancerConfig.slots_per_rank must be <= 4096, got 2305843009213693952$",
        ),
        (
            {"num_experts": 8, "ep_size": 4, "slots_per_rank": np.uint64(2**40)},
            ValueError,
            r"slots_per_rank must be <= 4096, got 1099511627776$",
        ),
    ],
)
def test_config_rejects_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        uep.BalancerConfig(**kwargs)
    assert "\n" not in str(info.value)  # one line


def test_config_is_frozen_and_hashable():
    cfg = uep.BalancerConfig(num_experts=8, ep_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError, match="ep_size"):
        cfg.ep_size = 2
    assert hash(cfg) == hash(uep.BalancerConfig(num_experts=8, ep_size=4))
    assert cfg.experts_per_rank == 2


@pytest.mark.parametrize("int_type", [np.int32, np.int64, np.uint16])
@pytest.mark.parametrize("float_type", [np.float32, np.float64, float, np.int8])
def test_config_accepts_numpy_scalars_and_normalises_them(int_type, float_type):
    cfg = uep.BalancerConfig(
        num_experts=int_type(16),
        ep_size=int_type(8),
        slots_per_rank=int_type(2),
        min_tokens_per_replica=int_type(64),
        balance_eps=float_type(0.25) if float_type is not np.int8 else float_type(0),
        master_keep_tokens=int_type(1),
        ranks_per_domain=int_type(4),
    )
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        assert type(value) is (float if field.name == "balance_eps" else int), field.name
    want_eps = float(float_type(0.25)) if float_type is not np.int8 else 0.0
    same = uep.BalancerConfig(16, 8, 2, 64, want_eps, 1, ranks_per_domain=4)
    assert cfg == same
    assert hash(cfg) == hash(same)
    # and the planner takes it (np.float32 used to raise TypeError, huge ints OverflowError)
    loads = _skewed_loads(np.random.default_rng(3), 8, 16)
    got = _as_numpy(uep.plan(loads, cfg))
    want = reference_plan(loads, 2, 64, want_eps, 1, ranks_per_domain=4)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_config_largest_values_reach_the_planner():
    # The largest legal min_tokens_per_replica (2**31 - 1: beyond any expert's int32 load) and
    # master_keep_tokens (int64's maximum) reach the custom call as they are (beyond int64 they
    # used to fail with a bare OverflowError); 4096 slots per rank too.
    big = 2**63 - 1
    loads = _skewed_loads(np.random.default_rng(4), 8, 16)
    for F, K in ((2**31 - 1, 1), (64, big)):
        cfg = uep.BalancerConfig(16, 8, min_tokens_per_replica=F, master_keep_tokens=K)
        got = _as_numpy(uep.plan(loads, cfg))
        want = reference_plan(loads, 2, F, cfg.balance_eps, K)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        if K == big:  # no master can give a token away
            np.testing.assert_array_equal(got["rank_load"], rank_loads_before(loads))
        else:  # only replicas that clear a rank's whole remaining excess (the adaptive floor)
            assert (got["rank_load"] <= rank_loads_before(loads).max()).all()
    cfg = uep.BalancerConfig(16, 8, slots_per_rank=4096, min_tokens_per_replica=64)
    got = _as_numpy(uep.plan(loads, cfg))
    want = reference_plan(loads, 4096, 64, cfg.balance_eps, 1)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize(
    "capacity, error, match",
    [
        (0, ValueError, r"^plan: capacity must be a positive int, got 0$"),
        (-5, ValueError, r"capacity must be a positive int, got -5"),
        (
            2**63,
            ValueError,
            r"capacity must fit in int64 \(<= 2\*\*63 - 1\), got 9223372036854775808",
        ),
        (100.0, TypeError, r"capacity must be an int, got float"),
        (True, TypeError, r"capacity must be an int, got bool"),
        (np.bool_(True), TypeError, r"capacity must be an int"),
        ("100", TypeError, r"capacity must be an int, got str"),
        (np.array([100]), TypeError, r"capacity must be an int, got ndarray"),
    ],
)
def test_plan_rejects_bad_capacity(capacity, error, match):
    with pytest.raises(error, match=match) as info:
        uep.plan(np.zeros((8, 16), np.int32), CFG, capacity=capacity)
    assert "\n" not in str(info.value)


def test_capacity_is_a_static_attribute_of_the_custom_call():
    lower = jax.jit(lambda l: uep.plan(l, CFG, capacity=np.int32(600))).lower
    text = lower(jax.ShapeDtypeStruct((8, 16), jnp.int32)).as_text()
    assert "capacity = 600 : i64" in text
    text = jax.jit(lambda l: uep.plan(l, CFG)).lower(jax.ShapeDtypeStruct((8, 16), jnp.int32))
    assert "capacity = 0 : i64" in text.as_text()  # None: unbounded


def test_plan_rejects_wrong_shape_and_dtype():
    with pytest.raises(ValueError, match=r"shape \[ep_size, num_experts\] = \[8, 16\]"):
        uep.plan(np.zeros((8, 8), np.int32), CFG)
    with pytest.raises(ValueError, match="shape"):
        uep.plan(np.zeros((1, 8, 16), np.int32), CFG)
    with pytest.raises(TypeError, match="int32"):
        uep.plan(np.zeros((8, 16), np.float32), CFG)
    with pytest.raises(TypeError, match="int32"):
        uep.plan(jnp.zeros((8, 16), jnp.int16), CFG)
    with pytest.raises(TypeError, match="BalancerConfig"):
        uep.plan(np.zeros((8, 16), np.int32), {"ep_size": 8})


def test_negative_load_is_reported_by_the_custom_call():
    loads = np.ones((8, 16), np.int32)
    loads[5, 7] = -3
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"loads\[0\]\[5, 7\] = -3"):
        jax.block_until_ready(uep.plan(loads, CFG).rank_load)


def test_overflowing_expert_total_is_reported():
    loads = np.zeros((8, 16), np.int32)
    loads[:, 0] = 2**30  # the expert's total needs 33 bits
    with pytest.raises(jax.errors.JaxRuntimeError, match="exceeds int32"):
        jax.block_until_ready(uep.plan(loads, CFG).rank_load)


# -- the FFI call under transformations ------------------------------------------------------


def test_eager_jit_vmap_and_lax_map_agree():
    rng = np.random.default_rng(0)
    batch = np.stack([_skewed_loads(rng, 8, 16) for _ in range(5)])
    eager = [_as_numpy(uep.plan(l, CFG)) for l in batch]
    jitted = jax.jit(lambda l: uep.plan(l, CFG))
    vmapped = jax.jit(jax.vmap(lambda l: uep.plan(l, CFG)))(batch)
    mapped = jax.jit(lambda b: jax.lax.map(lambda l: uep.plan(l, CFG), b))(batch)
    for i, want in enumerate(eager):
        got_jit = _as_numpy(jitted(batch[i]))
        for name in want:
            np.testing.assert_array_equal(got_jit[name], want[name])
            np.testing.assert_array_equal(np.asarray(getattr(vmapped, name))[i], want[name])
            np.testing.assert_array_equal(np.asarray(getattr(mapped, name))[i], want[name])
        check_plan_invariants(batch[i], want, CFG.slots_per_rank)
        assert want["rank_load"].max() <= rank_loads_before(batch[i]).max()
    assert int(jnp.sum(vmapped.num_replicas)) > 0  # the skewed loads really were rebalanced


def test_batched_plans_are_pytrees_of_per_matrix_reference_plans():
    # jit(vmap(plan)) returns one Plan whose leaves carry a leading batch axis; flattening it and
    # slicing every leaf must give, field by field, the NumPy reference's plan of each matrix.
    # (A wrong leaf order, a batch axis in the wrong place or a leaf that does not vary over the
    # batch fails here.)
    rng = np.random.default_rng(1)
    batch = np.stack([_skewed_loads(rng, 8, 16) for _ in range(6)])
    plans = jax.jit(jax.vmap(lambda l: uep.plan(l, CFG, capacity=700)))(batch)
    leaves, treedef = jax.tree_util.tree_flatten(plans)
    names = [f.name for f in dataclasses.fields(uep.Plan)]
    assert treedef.num_leaves == len(names) == 4
    for i, loads in enumerate(batch):
        want = reference_plan(loads, 2, 64, CFG.balance_eps, 1, capacity=700)
        one = jax.tree_util.tree_unflatten(treedef, [np.asarray(leaf)[i] for leaf in leaves])
        assert isinstance(one, uep.Plan)
        for name, leaf in zip(names, jax.tree_util.tree_leaves(one), strict=True):
            np.testing.assert_array_equal(leaf, want[name], err_msg=f"{name} of matrix {i}")
        assert int(one.num_replicas) == int((want["slot_expert"] >= 0).sum())
    # the matrices differ, so the per-matrix plans must too
    assert len({np.asarray(plans.slot_quota)[i].tobytes() for i in range(len(batch))}) > 1


def test_same_plan_on_every_rank_inside_shard_map():
    mesh = expert_mesh()
    rng = np.random.default_rng(2)
    loads = _skewed_loads(rng, 8, 16)
    want = _as_numpy(uep.plan(loads, CFG))

    def per_rank(local_loads):  # [1, E]: this rank's own row
        gathered = jax.lax.all_gather(local_loads, "expert", tiled=True)  # [R, E], same everywhere
        plan = uep.plan(gathered, CFG)  # varies as the gathered loads do (over "expert")
        return jax.tree.map(lambda a: a[None], plan)

    step = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))
    placed = jax.device_put(loads, NamedSharding(mesh, P("expert")))
    lowered = step.lower(placed).as_text()
    assert "ultraep_plan" in lowered
    got = _as_numpy(step(placed))
    for name, value in want.items():
        assert got[name].shape == (8,) + value.shape
        for rank in range(8):
            np.testing.assert_array_equal(got[name][rank], value, err_msg=f"{name} on rank {rank}")


def test_jitted_plan_is_the_custom_call_with_no_host_callback():
    text = (
        jax.jit(lambda l: uep.plan(l, CFG))
        .lower(jax.ShapeDtypeStruct((8, 16), jnp.int32))
        .as_text()
    )
    assert "custom_call @ultraep_plan" in text
    assert "callback" not in text


def test_cuda_lowering_uses_the_same_custom_call():
    """Lowered for CUDA, "auto" is the CPU's custom call where this install built the CUDA handler
    (`native.has_cuda_handler`; ULTRAEP_BUILD_CUDA), else the portable planner: no custom call."""
    exported = jax.export.export(
        jax.jit(lambda l: uep.plan(l, CFG)),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("ultraep_plan")],
    )(jax.ShapeDtypeStruct((8, 16), jnp.int32))
    text = exported.mlir_module()
    assert exported.platforms == ("cuda",)
    assert "callback" not in text
    if native.has_cuda_handler():
        assert "ultraep_plan" in text
    else:
        assert "stablehlo.custom_call" not in text


@pytest.mark.parametrize("platform", ["tpu", "rocm"])
def test_native_planner_lowered_where_it_has_no_handler_is_one_line(platform):
    """`planner="native"` lowered for a platform without a handler (an export for TPU from this
    CPU host): one line of ours that says what to use, not XLA's error for the custom call."""
    loads = jax.ShapeDtypeStruct((8, 16), jnp.int32)
    with pytest.raises(ValueError, match=f"no native planner handler exists for '{platform}'"):
        jax.export.export(
            jax.jit(lambda l: uep.plan(l, CFG, planner="native")), platforms=[platform]
        )(loads)
    # The same call lowered for the CPU is the handler, as before.
    assert (
        "custom_call @ultraep_plan"
        in jax.jit(lambda l: uep.plan(l, CFG, planner="native")).lower(loads).as_text()
    )


def test_parallel_with_the_portable_planner_is_one_line():
    loads = np.ones((8, 16), np.int32)
    with pytest.raises(ValueError, match="parallel=True is a form of the native planner"):
        uep.plan(loads, CFG, parallel=True, planner="portable")


def test_export_for_cpu_needs_the_plan_target_allowed():
    """`jax.export` refuses a custom call without a compatibility guarantee: exporting `uep.plan`
    (or a balanced layer) for CPU or CUDA needs ``DisabledSafetyCheck.custom_call("ultraep_plan")``
    (``"ultraep_plan_parallel"`` with ``parallel=True``; docs/api.md). With it the export runs and
    plans as the call does; without it, JAX's error."""
    loads = _skewed_loads(np.random.default_rng(3), 8, 16)
    spec = jax.ShapeDtypeStruct(loads.shape, jnp.int32)
    with pytest.raises(ValueError, match=r"custom calls whose targets have no compatibility"):
        jax.export.export(jax.jit(lambda l: uep.plan(l, CFG)), platforms=["cpu"])(spec)
    for parallel, target in ((False, "ultraep_plan"), (np.bool_(True), "ultraep_plan_parallel")):
        exported = jax.export.export(
            jax.jit(lambda l, parallel=parallel: uep.plan(l, CFG, parallel=parallel)),
            platforms=["cpu"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(target)],
        )(spec)
        assert f"custom_call @{target}(" in exported.mlir_module()
        got, want = exported.call(loads), uep.plan(loads, CFG)
        for name in ("slot_expert", "slot_quota", "master_quota", "rank_load"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        assert int(np.sum(got.slot_quota)) > 0


def test_parallel_takes_numpy_bools_and_refuses_a_portable_platform():
    """``parallel=np.bool_(True)`` is True (it said "must be a bool, got bool"); with the default
    planner, lowering for a platform that plans portably (a TPU export) raised nothing and planned
    serially: one line now. Other types stay TypeError, naming the type."""
    loads = _skewed_loads(np.random.default_rng(4), 8, 16)
    want = _as_numpy(uep.plan(loads, CFG, parallel=True))
    assert_same = np.testing.assert_array_equal
    for name, value in _as_numpy(uep.plan(loads, CFG, parallel=np.bool_(True))).items():
        assert_same(value, want[name], err_msg=name)
    uep.plan(loads, CFG, parallel=np.bool_(False))
    with pytest.raises(TypeError, match=r"^plan: parallel must be a bool .*, got int 1$"):
        uep.plan(loads, CFG, parallel=1)
    spec = jax.ShapeDtypeStruct(loads.shape, jnp.int32)
    match = r"^plan: parallel=True is a form of the native planner, and 'tpu' plans with the "
    export = jax.export.export(
        jax.jit(lambda l: uep.plan(l, CFG, parallel=True)), platforms=["tpu"]
    )
    with pytest.raises(ValueError, match=match + "portable planner") as err:
        export(spec)
    assert "\n" not in str(err.value)


def test_imbalance():
    np.testing.assert_allclose(uep.imbalance(np.array([3, 1, 1, 3])), 1.5)
    np.testing.assert_allclose(uep.imbalance(np.array([[2, 2], [4, 0]])), [1.0, 2.0])
    assert float(uep.imbalance(np.zeros(4))) == 1.0
