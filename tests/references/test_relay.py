"""Tests of the relay schedule's reference (tests/references/relay.py) on small layouts worked by
hand from ffi/TRANSFER.md: each expert's replicas ordered by (the rank masters a replicated
expert, distance from the master), the master sends the first ``max(1, f // replicated masters of
its rank)`` (all of them with f = 0), each later level ``f`` per replica of the level above,
round robin; an empty slot gets hop 0, sender R, source 0."""

from __future__ import annotations

import numpy as np
import pytest

from tests.references.relay import reference_schedule, reference_send_copies

# R = 4, one master each (E_m = 1), one slot: expert 0 (master rank 0) on ranks 1, 2, 3.
CHAIN = [[-1], [0], [0], [0]]

# R = 4, E_m = 2, two slots: expert 1 (master rank 0, local 1) on ranks 1, 2, 3; expert 4
# (master rank 2, local 0) on rank 0. Ranks 0 and 2 master a replicated expert, so expert 1's
# replicas go in the order rank 1, rank 3 (distances 1, 3), then rank 2 (distance 2, but it
# masters expert 4).
MIXED = [[-1, 4], [1, -1], [-1, 1], [1, -1]]

# R = 4, E_m = 2: both of rank 0's experts on ranks 1, 2, 3 (rank 0 masters 2 replicated experts).
SHARED_ROOT = [[-1, -1], [0, 1], [0, 1], [0, 1]]

CASES = {
    # f = 0: every copy from the master in hop 1.
    "direct": (CHAIN, 1, 0, [[0], [1], [1], [1]], [[4], [0], [0], [0]], [[0], [0], [0], [0]]),
    # f = 1: a chain, each rank relaying from the one before (source: the sender's slot 0).
    "chain": (CHAIN, 1, 1, [[0], [1], [2], [3]], [[4], [0], [1], [2]], [[0], [0], [0], [0]]),
    # f = 1: expert 1 from rank 0 to rank 1 (source: local group 1), rank 1's slot 0 to rank 3,
    # rank 3's slot 0 to rank 2's slot 1; expert 4 from rank 2 (local group 0) to rank 0.
    "mixed_f1": (
        MIXED,
        2,
        1,
        [[0, 1], [1, 0], [0, 3], [2, 0]],
        [[4, 2], [0, 4], [4, 3], [1, 4]],
        [[0, 0], [1, 0], [0, 0], [0, 0]],
    ),
    # f = 2: the master sends expert 1 to ranks 1 and 3; rank 1 relays it to rank 2.
    "mixed_f2": (
        MIXED,
        2,
        2,
        [[0, 1], [1, 0], [0, 2], [1, 0]],
        [[4, 2], [0, 4], [4, 1], [0, 4]],
        [[0, 0], [1, 0], [0, 0], [1, 0]],
    ),
    # f = 2 shared by rank 0's two replicated experts: one copy of each from the master (to rank
    # 1), then rank 1 relays each to ranks 2 and 3 from the slot that holds it.
    "shared_root": (
        SHARED_ROOT,
        2,
        2,
        [[0, 0], [1, 1], [2, 2], [2, 2]],
        [[4, 4], [0, 0], [1, 1], [1, 1]],
        [[0, 0], [0, 1], [0, 1], [0, 1]],
    ),
}
COPIES = {
    "direct": [3, 0, 0, 0],
    "chain": [1, 1, 1, 0],
    "mixed_f1": [1, 1, 1, 1],
    "mixed_f2": [2, 1, 1, 0],
    "shared_root": [2, 4, 0, 0],
}


@pytest.mark.parametrize("name", list(CASES))
def test_schedule_by_hand(name):
    slots, em, f, hop, sender, source = CASES[name]
    got = reference_schedule(np.asarray(slots, np.int32), em, f)
    np.testing.assert_array_equal(got["hop"], hop, err_msg="hop")
    np.testing.assert_array_equal(got["sender"], sender, err_msg="sender")
    np.testing.assert_array_equal(got["source"], source, err_msg="source")
    copies = reference_send_copies(np.asarray(slots, np.int32), em, f)
    np.testing.assert_array_equal(copies, COPIES[name])
    assert copies.sum() == (np.asarray(slots) >= 0).sum()  # one copy per filled slot


def test_no_replicas_schedule_nothing():
    got = reference_schedule(np.full((3, 2), -1, np.int32), 2, 2)
    np.testing.assert_array_equal(got["hop"], 0)
    np.testing.assert_array_equal(got["sender"], 3)
    np.testing.assert_array_equal(got["source"], 0)
    np.testing.assert_array_equal(reference_send_copies(np.full((3, 2), -1), 2, 2), [0, 0, 0])
