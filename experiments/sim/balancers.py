"""The balancers the simulator compares, and what the cost model charges for each result.

A balancer (``BalancerFn``) takes a batch of load streams ``int32 [n, M, R, E]`` (M consecutive
microbatches of one layer in one DP group, oldest first), a ``BalancerConfig`` and the streams'
histories ``int32 [n, H, R, E]`` (earlier matrices of the same layer, for balancers that plan from
the past), and returns per stream and microbatch a :class:`Costed`: the balancer's
`experiments.lab.loads.baselines.Balanced` layout and quotas, the weight copies it sends and the
planner time on the critical path. Each balancer is its policy's
`experiments.lab.loads.policies.run` (the one runner from a name to its plans; the EPLB baselines
are `experiments.lab.loads.baselines`):

  * ``none`` -- masters only: nothing moves, no planner.
  * ``eplb_exact`` / ``eplb_plus`` -- plan on the exact load of every layer and microbatch, so
    their CPU-measured wall time per call is on the critical path, and every instance off its
    expert's home rank is a weight copy (and a gradient return) in that layer, once per rank
    (`policies.weight_copies`).
  * ``eplb_periodic`` -- plans on the ``H`` history matrices (``window = interval = H``,
    ``lag=1``; with ``H = 0`` on the previous microbatch) and keeps that layout for the current
    microbatches; planning is off the critical path and its re-layout is amortised over the
    re-plan interval, so nothing moves per microbatch.
  * ``ultraep`` -- ``uep.plan`` on the exact load of every layer and microbatch, with the
    CPU-measured per-plan time on the critical path; its replicas are the copies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

import ultraep_jax as uep
from experiments.lab.loads import policies
from experiments.lab.loads.baselines import Balanced
from experiments.lab.walltime import time_batched_plan

#: The balancers in table order.
BASELINE_ORDER = policies.names(without=("exact",))


@dataclasses.dataclass(frozen=True)
class Costed:
    """A balancer's result on one load matrix, with what the cost model charges for it.

    Attributes:
      balanced: the layout ``[R, C]`` and the tokens of each instance ``[R, C]``.
      copies: int64 ``[E]``, weight copies of each expert sent for this matrix (replicas or moved
        experts; the home rank ``e // (E / R)`` is taken as the source).
      copies_in: int64 ``[R]``, copies each rank receives.
      plan_seconds: planner time on the critical path of this layer (0: none, or off the path).
    """

    balanced: Balanced
    copies: np.ndarray
    copies_in: np.ndarray
    plan_seconds: float = 0.0

    @property
    def rank_load(self) -> np.ndarray:
        """int64 ``[R]``: rows each rank processes after balancing."""
        return self.balanced.rank_load


#: (streams int32 [n, M, R, E], config, history int32 [n, H, R, E]) -> [n][M] Costed.
BalancerFn = Callable[[np.ndarray, uep.BalancerConfig, np.ndarray], Sequence[Sequence[Costed]]]


def off_home_copies(layout, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Weight copies implied by a physical ``layout`` [R, C] (expert per slot, -1 = empty), as
    `policies.weight_copies` counts them (each instance off its expert's home rank, once per
    rank). Returns ``(copies [E], copies_in [R])``.
    """
    held, copies_RR = policies.weight_copies(layout, num_experts)
    copies = np.bincount(held[held >= 0].astype(np.int64), minlength=num_experts)
    return copies.astype(np.int64), copies_RR.sum(axis=0)


def costed(balanced: Balanced, num_experts: int, plan_seconds: float = 0.0) -> Costed:
    """``balanced`` with its off-home instances (once per rank) as this matrix's copies
    (``off_home_copies``)."""
    copies, copies_in = off_home_copies(balanced.layout, num_experts)
    return Costed(balanced, copies, copies_in, float(plan_seconds))


def resident(balanced: Balanced, num_experts: int) -> Costed:
    """``balanced`` with a layout already in place: nothing is copied, no planner."""
    ranks = balanced.layout.shape[0]
    return Costed(balanced, np.zeros(num_experts, np.int64), np.zeros(ranks, np.int64))


def balancer(name: str, plan_timer: policies.PlanTimer | None = None) -> BalancerFn:
    """Policy ``name`` as a balancer: `policies.run` on each stream (with its history), each
    matrix charged as `costed` where the policy plans it on its own load (its planning time on the
    critical path, its off-home instances copied) and as `resident` where its layout is already in
    place; ``plan_timer`` times our planner."""

    def balance(streams, cfg=None, history=None) -> list[list[Costed]]:
        streams = np.asarray(streams)
        num_experts = streams.shape[-1]
        out = []
        for i, stream in enumerate(streams):
            past = None if history is None else history[i]
            r = policies.run(name, stream, cfg, past, plan_timer=plan_timer)
            each = zip(r.balanced, r.seconds, strict=True)
            if r.relaid:
                out.append([costed(b, num_experts, s) for b, s in each])
            else:
                out.append([resident(b, num_experts) for b, _ in each])
        return out

    return balance


#: Masters only: rank loads as routed, nothing moves, no planner.
none_balancer = balancer("none")
#: EPLB re-laid out on every matrix (``baselines.eplb_exact``), timed per call.
eplb_exact_balancer = balancer("eplb_exact")
#: Replication only, masters fixed (``baselines.eplb_plus``), timed per call.
eplb_plus_balancer = balancer("eplb_plus")
#: EPLB planned on each stream's history and kept for its microbatches
#: (``baselines.eplb_periodic`` with ``window = interval = max(H, 1)``, ``lag=1``).
eplb_periodic_balancer = balancer("eplb_periodic")


_PLAN_SECONDS: dict = {}


def measure_plan_seconds(sample: np.ndarray, cfg: uep.BalancerConfig, batch: int = 256) -> float:
    """CPU-measured planner time per plan: `experiments.lab.walltime.time_batched_plan` over
    ``batch`` matrices (``sample`` [N, R, E] tiled), median of 5, divided by ``batch``. Cached per
    config (the first sample seen is timed)."""
    if cfg not in _PLAN_SECONDS:
        tiled = np.resize(sample, (batch,) + sample.shape[1:])
        _PLAN_SECONDS[cfg] = time_batched_plan(tiled, cfg, repeats=5) / batch
    return _PLAN_SECONDS[cfg]


def plan_timer(timing_batch: int) -> policies.PlanTimer:
    """Our planner's time per plan as the simulator charges it: `measure_plan_seconds` over
    ``timing_batch`` matrices (any receive buffer: the simulator plans unbounded)."""
    return lambda batch, cfg, capacity: measure_plan_seconds(batch, cfg, timing_batch)


def make_ultraep_balancer(timing_batch: int = 256) -> BalancerFn:
    """Our planner: ``uep.plan`` on the exact load of every layer and microbatch, with the
    CPU-measured per-plan time (`measure_plan_seconds`) on the critical path."""
    return balancer("ultraep", plan_timer(timing_batch))


def make_balancers(names: Sequence[str], timing_batch: int) -> dict[str, BalancerFn]:
    """The balancers ``names`` (from :data:`BASELINE_ORDER`) in table order, ``none`` always
    first (the speedups are over it); ``timing_batch``: matrices per timed planner call."""
    unknown = sorted(set(names) - set(BASELINE_ORDER))
    if unknown:
        raise ValueError(f"unknown baselines {unknown}; expected some of {BASELINE_ORDER}")
    timer = plan_timer(timing_batch)
    return {
        name: balancer(name, timer) for name in BASELINE_ORDER if name == "none" or name in names
    }
