"""Tests of the dispatch reference (tests/references/dispatch.py) on small cases worked by hand
from its rules: the instances, the locality-first prefix transport and the capacity rule."""

from __future__ import annotations

import numpy as np
import pytest

from tests.references.dispatch import instances, kept_pairs, prefix_transport


def test_instances_masters_then_slots():
    # R = 2, E = 4 (E_m = 2), S = 2: masters 0..3 on ranks 0, 0, 1, 1 in groups 0, 1, 0, 1; then
    # the slots in (rank, slot) order, on groups E_m + slot = 2, 3.
    expert, host, group = instances([[-1, 2], [0, -1]], 4)
    np.testing.assert_array_equal(expert, [0, 1, 2, 3, -1, 2, 0, -1])
    np.testing.assert_array_equal(host, [0, 0, 1, 1, 0, 0, 1, 1])
    np.testing.assert_array_equal(group, [0, 1, 0, 1, 2, 3, 2, 3])


# R = 2, E = 2 (E_m = 1), S = 1; rank 1's slot holds a replica of expert 0. Instances: 0 (expert
# 0 on rank 0), 1 (expert 1 on rank 1), 2 (rank 0's empty slot), 3 (expert 0 on rank 1's slot).
# Loads [[3, 1], [2, 2]]: expert totals [5, 3]; quotas 4 and 1 for expert 0's instances 0 and 3,
# 3 for expert 1's master.
LOADS = [[3, 1], [2, 2]]
SLOT_EXPERT = [[-1], [0]]
SLOT_QUOTA = [[0], [1]]
MASTER_QUOTA = [4, 3]


def test_prefix_transport_by_hand():
    # Expert 0, locality first: source 0 fills its own instance 0 with 3 (of 4), source 1 its own
    # instance 3 with 1 (of 1); then sources in rank order against what the instances still need:
    # source 0 has nothing left, source 1 sends its last pair to instance 0.
    # Expert 1: source 1 fills its own instance 1 with 2 (of 3); source 0 sends it its 1 pair.
    got = prefix_transport(LOADS, SLOT_EXPERT, SLOT_QUOTA, MASTER_QUOTA)
    np.testing.assert_array_equal(got, [[3, 1, 0, 0], [1, 2, 0, 1]])
    assert got.dtype == np.int64


def test_prefix_transport_refuses_quotas_above_the_load():
    with pytest.raises(AssertionError, match="quotas exceed"):
        prefix_transport(LOADS, SLOT_EXPERT, [[0], [2]], MASTER_QUOTA)


# The pairs in pair order: source 0 [e0, e1, e0, e0], source 1 [e1, e0, e0, e1]. With the
# transport above: source 0's e0 pairs all go to instance 0 (its count there is 3), its e1 pair
# to instance 1; source 1's first e0 pair to instance 0 (count 1), its second to instance 3, its
# e1 pairs to instance 1. Rows at each destination (sources in rank order, then local group,
# then pair order):
#   rank 0 (instance 0, group 0): s0 n0, s0 n2, s0 n3, s1 n1
#   rank 1 (instance 1 group 0, instance 3 group 1): s0 n1, s1 n0, s1 n3 (group 0), s1 n2 (group 1)
EXPERTS = [[0, 1, 0, 0], [1, 0, 0, 1]]


@pytest.mark.parametrize(
    "capacity, want",
    [
        (4, [[True] * 4, [True] * 4]),
        # rank 0 drops s1 n1 (its row 3), rank 1 drops s1 n2 (its row 3)
        (3, [[True, True, True, True], [True, False, False, True]]),
        # rank 0 keeps s0 n0, s0 n2; rank 1 keeps s0 n1, s1 n0
        (2, [[True, True, True, False], [True, False, False, False]]),
        (0, [[False] * 4, [False] * 4]),
    ],
)
def test_kept_pairs_by_hand(capacity, want):
    assign = prefix_transport(LOADS, SLOT_EXPERT, SLOT_QUOTA, MASTER_QUOTA)
    got = kept_pairs(EXPERTS, assign, SLOT_EXPERT, capacity)
    np.testing.assert_array_equal(got, want)


def test_kept_pairs_refuses_counts_that_miss_a_pair():
    assign = prefix_transport(LOADS, SLOT_EXPERT, SLOT_QUOTA, MASTER_QUOTA)
    with pytest.raises(AssertionError, match="do not cover"):
        kept_pairs([[0, 0, 0, 0], [1, 0, 0, 1]], assign, SLOT_EXPERT, 4)
