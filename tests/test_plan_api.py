"""The public planner API: validation, the FFI call under every JAX transformation, lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from tests.reference_planner import check_plan_invariants, rank_loads_before


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
        (dict(num_experts=10, ep_size=4), ValueError, "not divisible"),
        (dict(num_experts=8, ep_size=0), ValueError, "ep_size must be >= 1"),
        (dict(num_experts=8, ep_size=4, slots_per_rank=-1), ValueError, "slots_per_rank"),
        (
            dict(num_experts=8, ep_size=4, min_tokens_per_replica=0),
            ValueError,
            "min_tokens_per_replica",
        ),
        (dict(num_experts=8, ep_size=4, balance_eps=-0.1), ValueError, "balance_eps"),
        (dict(num_experts=8, ep_size=4, balance_eps=float("nan")), ValueError, "balance_eps"),
        (dict(num_experts=8.0, ep_size=4), TypeError, "num_experts must be an int"),
        (dict(num_experts=8, ep_size=4, slots_per_rank=True), TypeError, "slots_per_rank"),
    ],
)
def test_config_rejects_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        uep.BalancerConfig(**kwargs)


def test_config_is_frozen_and_hashable():
    cfg = uep.BalancerConfig(num_experts=8, ep_size=4)
    with pytest.raises(Exception):
        cfg.ep_size = 2
    assert hash(cfg) == hash(uep.BalancerConfig(num_experts=8, ep_size=4))
    assert cfg.experts_per_rank == 2


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
    with pytest.raises(Exception, match=r"loads\[0\]\[5, 7\] = -3"):
        jax.block_until_ready(uep.plan(loads, CFG).rank_load)


def test_overflowing_expert_total_is_reported():
    loads = np.zeros((8, 16), np.int32)
    loads[:, 0] = 2**30  # the expert's total needs 33 bits
    with pytest.raises(Exception, match="exceeds int32"):
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


def test_plan_is_a_pytree():
    plan = uep.plan(_skewed_loads(np.random.default_rng(1), 8, 16), CFG)
    leaves, treedef = jax.tree_util.tree_flatten(plan)
    assert len(leaves) == 4
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    np.testing.assert_array_equal(again.rank_load, plan.rank_load)


def test_same_plan_on_every_rank_inside_shard_map():
    mesh = jax.make_mesh((8,), ("expert",))
    rng = np.random.default_rng(2)
    loads = _skewed_loads(rng, 8, 16)
    want = _as_numpy(uep.plan(loads, CFG))

    def per_rank(local_loads):  # [1, E]: this rank's own row
        gathered = jax.lax.all_gather(local_loads, "expert", tiled=True)  # [R, E], same everywhere
        plan = uep.plan(gathered, CFG)
        return jax.tree.map(lambda a: jax.lax.pcast(a[None], "expert", to="varying"), plan)

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
    exported = jax.export.export(
        jax.jit(lambda l: uep.plan(l, CFG)),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("ultraep_plan")],
    )(jax.ShapeDtypeStruct((8, 16), jnp.int32))
    text = exported.mlir_module()
    assert exported.platforms == ("cuda",)
    assert "ultraep_plan" in text and "callback" not in text


def test_imbalance():
    np.testing.assert_allclose(uep.imbalance(np.array([3, 1, 1, 3])), 1.5)
    np.testing.assert_allclose(uep.imbalance(np.array([[2, 2], [4, 0]])), [1.0, 2.0])
    assert float(uep.imbalance(np.zeros(4))) == 1.0
