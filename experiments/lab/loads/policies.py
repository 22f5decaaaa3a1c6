"""The balancing policies the programs compare, in one registry (`POLICIES`, in table order),
and the one runner from a policy's name to its plans (`run`: a stream of load matrices ->
per matrix a layout with its quotas, the planning time, whether it moves weights in that layer,
and the library's plans for ours), which `experiments.sim`, `experiments.replay` and
`experiments.planner` all use. Ours is ``ultraep_jax.plan`` (the FFI planner) as a
`baselines.Balanced`; the others are in `experiments.lab.loads.baselines`. Each program reports the
registry's policies it runs, in its order (`names`). `weight_copies` is the one adapter from a
policy's layout to the weight copies each rank receives, which the step model charges.

Shapes: M matrices of a stream, H earlier matrices, R ranks, E experts, C slots per rank.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from experiments.lab.batched import batched_planner
from experiments.lab.loads import baselines, ranks
from experiments.lab.loads.baselines import Balanced, master_layout

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
    return _balanced(batch, batched_planner(cfg)(batch))


def _balanced(batch, plans) -> list[Balanced]:
    """The batched ``plans`` of ``batch`` [N, R, E] as N `Balanced` (masters, then slots)."""
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


def ultraep(loads, cfg) -> Balanced:
    """ultraep's plan for one ``loads [R, E]`` as a :class:`Balanced`."""
    return ultraep_balanced(np.asarray(loads)[None], cfg)[0]


@dataclasses.dataclass(frozen=True)
class Run:
    """One policy on a stream of M load matrices (`run`).

    Attributes:
      balanced: M `Balanced`, each matrix's layout ``[R, C]`` and its instances' tokens.
      seconds: float [M], each matrix's planning wall time (ours: the timer's per plan, 0 without
        one; eplb_periodic: 0, its re-plans are off the step, see ``periodic``).
      relaid: True when each layout is planned on its own matrix, so that its instances off their
        home rank receive weights in that layer (`weight_copies`); False when the layout is
        already in place (none, eplb_periodic).
      plans: ours (ultraep, exact): the library's `uep.Plan` of each matrix, NumPy with a
        leading axis M; else None.
      periodic: eplb_periodic's `baselines.Periodic` (its re-plans' placements and times).
    """

    balanced: list
    seconds: list
    relaid: bool
    plans: object = None
    periodic: baselines.Periodic | None = None


#: (loads [N, R, E], config, capacity) -> seconds per plan of our planner on them.
PlanTimer = Callable[[np.ndarray, object, "int | None"], float]


def _timed(stream, balance) -> tuple[list, list]:
    """``balance(loads)`` on every matrix of ``stream``: the results and their wall times."""
    results, seconds = [], []
    for loads in stream:
        start = time.perf_counter()
        results.append(balance(loads))
        seconds.append(time.perf_counter() - start)
    return results, seconds


def _ours(stream, cfg, capacity, plan_timer) -> Run:
    """``uep.plan`` on every matrix (one batched call within ``capacity``) as a `Run`."""
    import jax  # as `experiments.lab.batched`: JAX only where a planner runs

    batch = np.asarray(stream, np.int32)
    plans = jax.device_get(batched_planner(cfg, capacity)(batch))
    per_plan = 0.0 if plan_timer is None else plan_timer(batch, cfg, capacity)
    return Run(_balanced(batch, plans), [per_plan] * len(batch), True, plans)


def run(
    name: str,
    stream,
    cfg,
    past=None,
    *,
    window: int | None = None,
    interval: int | None = None,
    lag: int = 1,
    capacity: int | None = None,
    plan_timer: PlanTimer | None = None,
) -> Run:
    """Policy ``name`` (of `POLICIES`) on ``stream`` [M, R, E] (oldest first) under ``cfg``
    (a `uep.BalancerConfig`; none needs none).

    none, eplb_exact and eplb_plus plan each matrix on its own, each call timed; eplb_periodic
    plans on ``past`` [H, R, E] (earlier matrices of the same layer, none by default) and the
    stream with ``window`` = ``interval`` = max(H, 1) unless given and ``lag`` (1: past steps
    only), reporting the stream's steps; ultraep and exact (``balance_eps`` = 0) are
    ``uep.plan`` within ``capacity`` rows (None: unbounded), timed by ``plan_timer``."""
    stream = np.asarray(stream)
    if name == "none":
        return Run(*_timed(stream, baselines.none), relaid=False)
    if name in ("eplb_exact", "eplb_plus"):
        eplb = getattr(baselines, name)
        return Run(*_timed(stream, lambda x: eplb(x, cfg.slots_per_rank)), relaid=True)
    if name == "eplb_periodic":
        if past is None:
            past = np.zeros((0,) + stream.shape[1:], stream.dtype)
        h = len(past)
        win = max(h, 1) if window is None else window
        every = max(h, 1) if interval is None else interval
        history = np.concatenate([past, stream])
        periodic = baselines.eplb_periodic(history, cfg.slots_per_rank, win, every, lag=lag)
        return Run(periodic.steps[h:], [0.0] * len(stream), False, periodic=periodic)
    if name == "ultraep":
        return _ours(stream, cfg, capacity, plan_timer)
    if name == "exact":
        return _ours(stream, dataclasses.replace(cfg, balance_eps=0.0), capacity, plan_timer)
    raise ValueError(f"unknown policy {name!r}; expected one of {list(POLICIES)}")
