"""The balancing policies the programs compare, in one registry (`POLICIES`, in table order),
and ours as a `baselines.Balanced` (``ultraep_jax.plan``, the FFI planner): the others are in
`experiments.loads.baselines`. Each program reports the registry's policies it runs, in its
order (`names`)."""

from __future__ import annotations

import numpy as np

from experiments import common
from experiments.loads.baselines import Balanced, master_layout

#: Every policy, in table order: name -> what it does.
POLICIES = {
    "none": "masters only: nothing moves, no planner",
    "eplb_periodic": "EPLB planned on earlier loads and kept (SGLang's and vLLM's use)",
    "eplb_exact": "EPLB re-laid out on each matrix's exact load (masters move too)",
    "eplb_plus": "replication only, masters fixed, planned on the exact load",
    "ultraep": "ours: uep.plan on the exact load of every layer and microbatch",
    "exact": "ours in exact mode (balance_eps = 0)",
}


def names(*, without: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The registry's policies in table order, less ``without`` (ValueError on a name it lacks)."""
    unknown = sorted(set(without) - set(POLICIES))
    if unknown:
        raise ValueError(f"unknown policies {unknown}; expected some of {list(POLICIES)}")
    return tuple(p for p in POLICIES if p not in without)


def ultraep_balanced(batch, cfg) -> list[Balanced]:
    """ultraep's plans for a batch ``[N, R, E]`` (one ``jit(vmap(uep.plan))`` call) as ``N``
    :class:`Balanced`, layout ``[R, E/R + S]``: the masters, then the spare slots."""
    batch = np.asarray(batch, dtype=np.int32)
    plans = common.batched_planner(cfg)(batch)
    num, num_ranks, num_experts = batch.shape
    masters = master_layout(num_ranks, num_experts)
    slot_expert = np.asarray(plans.slot_expert)
    slot_quota = np.asarray(plans.slot_quota, dtype=np.int64)
    master_quota = np.asarray(plans.master_quota, dtype=np.int64).reshape(num, num_ranks, -1)
    return [
        Balanced(
            np.concatenate([masters, slot_expert[i]], axis=1),
            np.concatenate([master_quota[i], slot_quota[i]], axis=1),
        )
        for i in range(num)
    ]


def ultraep_batch(batch, cfg, *, repeats: int = 1) -> tuple[list, float]:
    """:func:`ultraep_balanced` of a batch ``[N, R, E]``, and its planning time.

    Returns:
      ``(results, seconds)``: ``N`` :class:`Balanced`, and the median wall time of one
      already-compiled batched call over ``max(1, repeats)`` calls
      (`experiments.common.time_batched_plan`), so ``seconds / N`` per matrix.
    """
    return ultraep_balanced(batch, cfg), common.time_batched_plan(batch, cfg, max(1, repeats))


def ultraep(loads, cfg) -> Balanced:
    """ultraep's plan for one ``loads [R, E]`` as a :class:`Balanced`."""
    return ultraep_balanced(np.asarray(loads)[None], cfg)[0]
