"""Tests of the exact solver (ultraep_jax/oracle.py) on cases small enough to decide by hand,
and of the random cases it is asked about."""

from __future__ import annotations

import numpy as np
import pytest

from ultraep_jax.oracle import exact_plan_exists, random_cases


@pytest.mark.parametrize(
    "load_e, R, S, K, tau, exists",
    [
        # Expert 0 (rank 0) holds all 10 tokens: rank 1 can take up to 9 of them in its slot.
        ([10, 0], 2, 1, 1, 5, True),  # 5 and 5
        ([10, 0], 2, 1, 1, 4, False),  # rank 0 <= 4 needs 6 moved, which puts rank 1 at 6
        ([10, 0], 2, 1, 6, 5, False),  # the master keeps 6 > 5
        ([10, 0], 2, 0, 1, 5, False),  # no slot
        ([4, 4], 2, 0, 1, 4, True),  # already at the threshold: nothing to move
        # R = 3, E_m = 1, S = 1: expert 0 (9 tokens) must shed 6 to reach 3, but a rank holds one
        # replica of it, so ranks 1 and 2 take 3 each only if both have slack 3: they are empty.
        ([9, 0, 0], 3, 1, 1, 3, True),
        ([9, 1, 0], 3, 1, 1, 3, False),  # rank 1 has slack 2: 3 + 2 < 6
        # Two experts on rank 0 (E_m = 2), each keeping 1 of its 6: rank 1's two slots take 3
        # of each; one slot takes 5 at most (rank 0 stays at 7).
        ([6, 6, 0, 0], 2, 2, 1, 6, True),
        ([6, 6, 0, 0], 2, 1, 1, 6, False),
    ],
)
def test_exact_plan_exists_by_hand(load_e, R, S, K, tau, exists):
    assert exact_plan_exists(load_e, R, S, K, tau) is exists


def test_random_cases_follow_their_ranges():
    rng = np.random.default_rng(0)
    cases = random_cases(rng, 200, ranks=(3, 4), experts_per_rank=(2, 3))
    assert len(cases) == 200
    for R, load_e, K in cases:
        assert R in (3, 4) and len(load_e) // R in (2, 3) and len(load_e) % R == 0
        assert load_e.dtype == np.int32 and (load_e >= 0).all()
        assert K in (0, 1, 2)
    again = random_cases(np.random.default_rng(0), 200, ranks=(3, 4), experts_per_rank=(2, 3))
    assert all(
        a[0] == b[0] and a[2] == b[2] and np.array_equal(a[1], b[1])
        for a, b in zip(cases, again, strict=True)
    )
