"""`ultraep_jax.layout`: the instance layout against hand-computed ids."""

import numpy as np
import pytest

from ultraep_jax.layout import Layout

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
