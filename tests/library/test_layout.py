"""`base.layout`: the instance layout against hand-computed ids, and the sizes read from
shapes (`BalancerConfig` without E and R, `plan`, `ExpertParallel`)."""

import jax
import numpy as np
import pytest

import ultraep_jax as uep
from ultraep_jax.base.layout import Layout

# E = 6 experts on R = 3 ranks (E_m = 2), S = 1 slot each: instances 0..5 are the masters
# (expert e on rank e // 2, group e % 2), 6, 7, 8 the slots of ranks 0, 1, 2 (group 2).
RANKS_631 = [0, 0, 1, 1, 2, 2, 0, 1, 2]
GROUPS_631 = [0, 1, 0, 1, 0, 1, 2, 2, 2]
AT_631 = [[0, 1, 6], [2, 3, 7], [4, 5, 8]]

# E = 4 on R = 2 (E_m = 2), S = 2: slots of rank 0 are instances 4, 5, of rank 1 6, 7.
RANKS_422 = [0, 0, 1, 1, 0, 0, 1, 1]
GROUPS_422 = [0, 1, 0, 1, 2, 3, 2, 3]
AT_422 = [[0, 1, 4, 5], [2, 3, 6, 7]]


@pytest.mark.parametrize(
    "sizes, ranks, groups, at",
    [((6, 3, 1), RANKS_631, GROUPS_631, AT_631), ((4, 2, 2), RANKS_422, GROUPS_422, AT_422)],
)
def test_instance_tables_match_hand_computed_ids(sizes, ranks, groups, at):
    layout = Layout(*sizes)
    np.testing.assert_array_equal(layout.instance_ranks(), ranks)
    np.testing.assert_array_equal(layout.instance_groups(), groups)
    np.testing.assert_array_equal(layout.instance_at(), at)
    E, R, S = sizes
    assert (layout.experts_per_rank, layout.num_groups, layout.num_instances) == (
        E // R,
        E // R + S,
        E + R * S,
    )


def test_masters_and_instance_experts():
    layout = Layout(4, 2, 2)
    assert [layout.master_rank(e) for e in range(4)] == [0, 0, 1, 1]
    assert [layout.master_group(e) for e in range(4)] == [0, 1, 0, 1]
    np.testing.assert_array_equal(layout.master_loads(np.array([1, 2, 3, 4])), [3, 7])
    np.testing.assert_array_equal(layout.master_loads(np.array([[1, 0, 0, 5]] * 2)), [[1, 5]] * 2)
    slots = np.array([[3, -1], [0, 1]], np.int32)
    np.testing.assert_array_equal(layout.instance_experts(slots), [0, 1, 2, 3, 3, -1, 0, 1])


def test_layout_of_shapes_and_divisibility():
    assert Layout.of(np.zeros((2, 8)), np.zeros((2, 3))) == Layout(8, 2, 3)
    assert Layout.of(np.zeros((4, 8))) == Layout(8, 4, 0)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by the EP size 4"):
        Layout(6, 4)


def _loads(seed=0, R=4, E=8):
    rng = np.random.default_rng(seed)
    loads = rng.integers(0, 50, size=(R, E)).astype(np.int32)
    loads[:, 0] += 400  # one hot expert, so that the plan has replicas
    return loads


def test_plan_reads_sizes_from_the_loads():
    """A configuration without E and R plans exactly as one that states them."""
    loads = _loads()
    bare = uep.BalancerConfig(slots_per_rank=2, min_tokens_per_replica=8)
    sized = uep.BalancerConfig(8, 4, slots_per_rank=2, min_tokens_per_replica=8)
    got, want = uep.plan(loads, bare), uep.plan(loads, sized)
    assert int(got.num_replicas) > 0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="not divisible") as info:
        uep.plan(np.zeros((3, 8), np.int32), bare)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"leave the sizes out of the BalancerConfig") as info:
        uep.plan(_loads(R=2), sized)
    assert "\n" not in str(info.value)
    assert "= [4, 8]" in str(info.value) and "got [2, 8]" in str(info.value)
    # Only E stated: the message names it (it used to leave the configured size out).
    with pytest.raises(ValueError, match=r"num_experts\] = \[any, 16\] \(or leave the sizes"):
        uep.plan(np.ones((4, 8), np.int32), uep.BalancerConfig(num_experts=16))


def test_config_sizes_are_optional_and_checked_when_given():
    bare = uep.BalancerConfig(slots_per_rank=3)
    assert (bare.num_experts, bare.ep_size) == (None, None)
    assert hash(bare) == hash(uep.BalancerConfig(slots_per_rank=3))
    with pytest.raises(ValueError, match="num_experts and ep_size are not set"):
        _ = bare.experts_per_rank
    sized = bare.sized(16, 8, "the layer")
    assert sized == uep.BalancerConfig(16, 8, slots_per_rank=3)
    assert sized.experts_per_rank == 2
    assert uep.BalancerConfig(num_experts=16).sized(16, 8, "x").ep_size == 8
    with pytest.raises(ValueError, match=r"leave num_experts and ep_size out") as info:
        uep.BalancerConfig(16, 4).sized(16, 8, "the layer and its mesh")
    assert "\n" not in str(info.value)


def test_expert_parallel_fills_in_the_balancer_sizes(dp2ep4_mesh):
    mesh = dp2ep4_mesh
    ep = uep.ExpertParallel(mesh, 8, uep.BalancerConfig(slots_per_rank=1))
    assert ep.balancer == uep.BalancerConfig(8, 4, slots_per_rank=1)
    assert ep == uep.ExpertParallel(mesh, 8, uep.BalancerConfig(8, 4, slots_per_rank=1))
    with pytest.raises(ValueError, match=r"\(8 experts on 4 ranks\): leave num_experts") as info:
        uep.ExpertParallel(mesh, 8, uep.BalancerConfig(8, 8))
    assert "\n" not in str(info.value)
