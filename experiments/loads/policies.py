"""The balancing policies the programs compare, in one registry (`POLICIES`, in table order),
and ours as a `baselines.Balanced` (``ultraep_jax.plan``, the FFI planner): the others are in
`experiments.loads.baselines`. Each program reports the registry's policies it runs, in its
order (`names`). `weight_copies` is the one adapter from a policy's layout to the weight copies
each rank receives, which the step model charges (`experiments.sim` and `experiments.replay` both
use it)."""

from __future__ import annotations

import numpy as np

from experiments.batched import batched_planner
from experiments.loads import ranks
from experiments.loads.baselines import Balanced, master_layout
from experiments.walltime import time_batched_plan

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


def weight_copies(layout_RC, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """The weight copies a layout ``[R, C]`` (expert per slot, -1: empty; the masters and spare
    slots, or the spare slots alone) moves for one layer: each instance off its expert's home rank
    (`ranks.home_ranks`) receives the weights from home (and in training returns the gradient),
    once per rank: a rank holding an expert twice needs no second copy (`ranks.held_off_home`).

    Returns:
      ``(held_RC, copies_RR)``: int32 ``[R, C]``, the expert whose weights each slot receives (-1:
      none), what the relay schedule moves; int64 ``[R(src), R(dst)]``, copies each home rank
      sends each rank.
    """
    held = ranks.held_off_home(np.asarray(layout_RC)[None], num_experts)[0]
    num_ranks = held.shape[0]
    dst, col = np.nonzero(held >= 0)
    src = ranks.home_ranks(num_experts, num_ranks)[held[dst, col]]
    copies = np.zeros((num_ranks, num_ranks), np.int64)
    np.add.at(copies, (src, dst), 1)
    return held, copies


def ultraep_balanced(batch, cfg) -> list[Balanced]:
    """ultraep's plans for a batch ``[N, R, E]`` (one ``jit(vmap(uep.plan))`` call) as ``N``
    :class:`Balanced`, layout ``[R, E/R + S]``: the masters, then the spare slots."""
    batch = np.asarray(batch, dtype=np.int32)
    plans = batched_planner(cfg)(batch)
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
      (`experiments.walltime.time_batched_plan`), so ``seconds / N`` per matrix.
    """
    return ultraep_balanced(batch, cfg), time_batched_plan(batch, cfg, max(1, repeats))


def ultraep(loads, cfg) -> Balanced:
    """ultraep's plan for one ``loads [R, E]`` as a :class:`Balanced`."""
    return ultraep_balanced(np.asarray(loads)[None], cfg)[0]
