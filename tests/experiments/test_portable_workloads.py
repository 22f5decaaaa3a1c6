"""The portable planner (`planning.portable`) against the C++ core, bit for bit, on the real
traces as the benchmarks plan them (the rest: tests/library/test_portable.py)."""

import numpy as np
import pytest

import ultraep_jax as uep
from tests.helpers.planner_cases import FIELDS, batched_plans, trace_batch


@pytest.mark.parametrize(
    "trace, ep_size, eps, g",
    [
        ("deepseek-r1", 64, 0.01, None),
        ("deepseek-r1", 64, 0.0, 8),
        ("qwen1.5-moe", 12, 0.01, 4),
        ("switch-base-128", 64, 0.01, 8),
    ],
)
def test_portable_equals_native_on_traces(trace, ep_size, eps, g):
    batch = trace_batch(trace, ep_size)
    cfg = uep.BalancerConfig(batch.shape[2], ep_size, 2, 1024, eps, ranks_per_domain=g)
    native, portable = (
        batched_plans(cfg, batch, planner="native"),
        batched_plans(cfg, batch, planner="portable"),
    )
    for name in FIELDS:
        np.testing.assert_array_equal(portable[name], native[name], err_msg=f"{trace}: {name}")
    assert (portable["slot_expert"] >= 0).sum() > len(batch)  # the layers were balanced
