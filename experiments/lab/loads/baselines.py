"""Baseline expert-load balancers, side by side with ultraep (NumPy, host only).

Our own implementations, written from the published descriptions of each method (no code copied):

  * :func:`none` -- masters only: every expert stays on its home rank (`ranks.home_ranks`) and
    keeps all of its tokens.
  * :func:`eplb_exact` -- DeepSeek's EPLB greedy (as described in the deepseek-ai/EPLB README):
    (1) replicate: while physical slots remain (``R * (E/R + S)`` in all), give one more replica to
    the logical expert with the highest load per replica; (2) pack: visit the physical experts from
    the heaviest (load / replicas of its expert) down and put each on the least-loaded rank that
    still has a free slot (cap ``E/R + S`` per rank). Tokens of an expert are split evenly over its
    instances. Planned on the current step's loads, so every step is a full re-layout (masters
    move too): an upper bound for EPLB.
  * :func:`eplb_periodic` -- the same greedy as SGLang and vLLM run it: planned on the summed loads
    of a history window, re-planned every ``interval`` steps, and the layout in force applied to
    each step's own loads. Counts the (rank, expert) placements that each re-plan adds.
  * :func:`eplb_plus` -- replication only, masters fixed, every spare slot used: each spare slot
    (taken on the currently least-loaded rank that still has one) goes to the currently heaviest
    expert by load per instance that the rank does not hold yet; tokens split evenly.
  * ours, the FFI planner ``ultraep_jax.plan``, as a :class:`Balanced`: in
    `experiments.lab.loads.policies`, with the registry of every policy the programs compare.

Every balancer returns a :class:`Balanced`: a physical layout ``[R, C]`` (the logical expert in
each physical slot of each rank, ``-1`` when empty) and the tokens each instance processes
``[R, C]``; the per-rank load after balancing is ``quota.sum(1)``. ``loads`` is always the
``[R, E]`` int matrix of the planner (``loads[r, e]``: pairs from source rank ``r`` to
expert ``e``). Even splits are done in integers: an expert with load ``l`` and ``n`` instances gives
``l // n`` to each instance and one more to the first ``l % n`` of them in row-major layout order,
so every expert's tokens are conserved exactly.

Tie-breaks (deterministic): replication picks the lowest expert index among equal loads per
replica; packing visits equal-weight physical experts in expert order and picks the lowest rank
among equally loaded ranks; eplb_plus picks the lowest rank and the lowest expert index on ties.
As in the published greedy, EPLB's packing does not forbid two replicas of one expert on the same
rank (it only caps slots per rank); such a pair simply shares that expert's tokens.
"""

from __future__ import annotations

import dataclasses
import heapq
import time

import numpy as np

from experiments.lab.loads import ranks

__all__ = [
    "Balanced",
    "Periodic",
    "apply_layout",
    "eplb_exact",
    "eplb_layout",
    "eplb_pack",
    "eplb_periodic",
    "eplb_plus",
    "eplb_replicate",
    "expert_loads",
    "held_matrix",
    "master_layout",
    "new_placements",
    "none",
    "split_evenly",
]


@dataclasses.dataclass(frozen=True)
class Balanced:
    """What a balancer did to one load matrix.

    Attributes:
      layout: int32 ``[R, C]``: logical expert in each physical slot of each rank, ``-1`` if empty.
      quota: int64 ``[R, C]``: tokens the instance in that slot processes (0 when empty).
    """

    layout: np.ndarray
    quota: np.ndarray

    @property
    def rank_load(self) -> np.ndarray:
        """int64 ``[R]``: tokens each rank processes after balancing."""
        return self.quota.sum(axis=1)

    @property
    def imbalance(self) -> float:
        """``max / mean`` of :attr:`rank_load` (1.0 when there are no tokens)."""
        return ranks.imbalance(self.rank_load)

    @property
    def num_replicas(self) -> int:
        """Instances beyond one per expert present in the layout."""
        present = self.layout[self.layout >= 0]
        return int(present.size - np.unique(present).size)


@dataclasses.dataclass(frozen=True)
class Periodic:
    """Result of :func:`eplb_periodic` over a stream of ``T`` steps.

    Attributes:
      steps: ``T`` :class:`Balanced`, the layout in force applied to each step's loads.
      replan_steps: the steps at which a new layout was planned (``0, interval, 2*interval, ...``).
      new_placements: per re-plan, (rank, expert) placements the new layout holds that the layout
        in force before did not (the first re-plan compares with the master layout).
      plan_seconds: per re-plan, wall time of the EPLB greedy (``time.perf_counter``).
    """

    steps: list
    replan_steps: list
    new_placements: list
    plan_seconds: list


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _check_loads(loads) -> np.ndarray:
    loads = np.asarray(loads)
    if loads.ndim != 2:
        raise ValueError(f"loads must be 2-D [R, E], got shape {loads.shape}")
    if not np.issubdtype(loads.dtype, np.integer):
        raise TypeError(f"loads must be integer, got {loads.dtype}")
    num_ranks, num_experts = loads.shape
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} is not divisible by R={num_ranks}")
    if loads.size and loads.min() < 0:
        raise ValueError("loads must be non-negative")
    return loads


def expert_loads(loads) -> np.ndarray:
    """int64 ``[E]``: ``load_e = sum_r loads[r, e]`` of ``loads [R, E]``."""
    return _check_loads(loads).sum(axis=0, dtype=np.int64)


def master_layout(num_ranks: int, num_experts: int) -> np.ndarray:
    """int32 ``[R, E/R]``: the master experts of each rank."""
    return ranks.masters_of_ranks(num_experts, num_ranks)


def split_evenly(layout, expert_load) -> np.ndarray:
    """Split every expert's load evenly (in integers) over its instances in ``layout``.

    Args:
      layout: int ``[R, C]``, logical expert per slot or ``-1``.
      expert_load: int ``[E]``; every expert with a non-zero load must have an instance.

    Returns:
      int64 ``[R, C]``: ``load_e // n_e`` per instance, plus one for the first ``load_e % n_e``
      instances of ``e`` in row-major order; 0 in empty slots. Sums to ``expert_load`` per expert.
    """
    layout = np.asarray(layout)
    expert_load = np.asarray(expert_load, dtype=np.int64)
    flat = layout.ravel()
    valid = flat >= 0
    experts = flat[valid].astype(np.int64)
    count = np.bincount(experts, minlength=expert_load.size)
    if np.any((count == 0) & (expert_load > 0)):
        missing = np.flatnonzero((count == 0) & (expert_load > 0))
        raise ValueError(f"experts {missing.tolist()} carry load but have no instance")
    # Position of each instance among its expert's instances, in row-major order.
    order = np.argsort(experts, kind="stable")
    start = np.concatenate([[0], np.cumsum(count)[:-1]])
    position = np.empty_like(experts)
    position[order] = np.arange(experts.size) - start[experts[order]]
    n = np.maximum(count[experts], 1)
    share = expert_load[experts] // n + (position < expert_load[experts] % n)
    quota = np.zeros(flat.shape, dtype=np.int64)
    quota[valid] = share
    return quota.reshape(layout.shape)


def apply_layout(layout, loads) -> Balanced:
    """Apply a physical ``layout [R, C]`` to ``loads [R, E]``: each expert split evenly."""
    return Balanced(np.asarray(layout, dtype=np.int32), split_evenly(layout, expert_loads(loads)))


def held_matrix(layout, num_experts: int) -> np.ndarray:
    """bool ``[R, E]``: whether rank ``r`` holds expert ``e`` (master or replica) in ``layout``."""
    layout = np.asarray(layout)
    held = np.zeros((layout.shape[0], num_experts), dtype=bool)
    rows, cols = np.nonzero(layout >= 0)
    held[rows, layout[rows, cols]] = True
    return held


def new_placements(old_layout, new_layout, num_experts: int) -> int:
    """Number of (rank, expert) pairs held in ``new_layout [R, C]`` but not in ``old_layout``.

    Each is one expert's state that has to be moved onto a rank when switching layouts.
    """
    old = held_matrix(old_layout, num_experts)
    new = held_matrix(new_layout, num_experts)
    return int(np.count_nonzero(new & ~old))


# --------------------------------------------------------------------------------------------
# none
# --------------------------------------------------------------------------------------------


def none(loads) -> Balanced:
    """Masters only. ``loads [R, E]`` -> layout ``[R, E/R]``, every expert on its master."""
    loads = _check_loads(loads)
    num_ranks, num_experts = loads.shape
    return apply_layout(master_layout(num_ranks, num_experts), loads)


# --------------------------------------------------------------------------------------------
# EPLB greedy
# --------------------------------------------------------------------------------------------


def eplb_replicate(expert_load, num_physical: int) -> np.ndarray:
    """EPLB step 1: instance counts per expert.

    Starts from one instance per expert; while instances < ``num_physical``, adds one to the expert
    with the highest ``load_e / count_e`` (lowest index on ties).

    Args:
      expert_load: int ``[E]``; num_physical: total physical slots, ``>= E``.

    Returns:
      int64 ``[E]`` counts summing to ``num_physical``.
    """
    expert_load = np.asarray(expert_load, dtype=np.int64)
    num_experts = expert_load.size
    if num_physical < num_experts:
        raise ValueError(f"num_physical={num_physical} < num_experts={num_experts}")
    count = np.ones(num_experts, dtype=np.int64)
    heap = [(-float(w), e) for e, w in enumerate(expert_load.tolist())]
    heapq.heapify(heap)
    for _ in range(num_physical - num_experts):
        _, e = heapq.heappop(heap)
        count[e] += 1
        heapq.heappush(heap, (-float(expert_load[e]) / float(count[e]), e))
    return count


def eplb_pack(expert_load, count, num_ranks: int, cap: int) -> np.ndarray:
    """EPLB step 2: pack the physical experts onto ranks, at most ``cap`` per rank.

    Physical experts (``count[e]`` copies of each ``e``, weight ``load_e / count_e``) are visited
    from the heaviest down (equal weights in expert order) and each goes to the rank with the least
    packed weight that still has a free slot (lowest rank on ties).

    Args:
      expert_load: int ``[E]``; count: int ``[E]`` with ``sum(count) <= num_ranks * cap``.

    Returns:
      int32 ``[R, cap]``: expert per slot, ``-1`` where a slot stays empty.
    """
    expert_load = np.asarray(expert_load, dtype=np.float64)
    count = np.asarray(count, dtype=np.int64)
    if count.sum() > num_ranks * cap:
        raise ValueError(f"{count.sum()} physical experts do not fit {num_ranks} x {cap} slots")
    weight = expert_load / count
    experts = np.repeat(np.arange(expert_load.size), count)
    order = np.argsort(-weight[experts], kind="stable")
    layout = np.full((num_ranks, cap), -1, dtype=np.int32)
    filled = [0] * num_ranks
    heap = [(0.0, r) for r in range(num_ranks)]  # (packed weight, rank) of ranks with a free slot
    for e in experts[order].tolist():
        w_rank, r = heapq.heappop(heap)
        layout[r, filled[r]] = e
        filled[r] += 1
        if filled[r] < cap:
            heapq.heappush(heap, (w_rank + float(weight[e]), r))
    return layout


def eplb_layout(expert_load, num_ranks: int, slots_per_rank: int) -> np.ndarray:
    """EPLB's layout for per-expert loads ``[E]``: int32 ``[R, E/R + S]``, every slot filled."""
    expert_load = np.asarray(expert_load, dtype=np.int64)
    cap = expert_load.size // num_ranks + slots_per_rank
    count = eplb_replicate(expert_load, num_ranks * cap)
    return eplb_pack(expert_load, count, num_ranks, cap)


def eplb_exact(loads, slots_per_rank: int) -> Balanced:
    """EPLB planned on, and applied to, the current ``loads [R, E]`` (a full re-layout).

    Returns a :class:`Balanced` with layout ``[R, E/R + S]``.
    """
    loads = _check_loads(loads)
    layout = eplb_layout(expert_loads(loads), loads.shape[0], slots_per_rank)
    return apply_layout(layout, loads)


def eplb_periodic(
    stream, slots_per_rank: int, window: int, interval: int, *, lag: int = 0
) -> Periodic:
    """EPLB re-planned every ``interval`` steps from a history window, over a stream of loads.

    At each re-plan step ``t0`` (``0, interval, 2*interval, ...``) the layout is planned on the
    summed loads of steps ``max(0, t0 - lag - window + 1) .. t0 - lag`` (``lag=0`` includes the
    re-plan step itself, so ``window=1, interval=1`` is :func:`eplb_exact`; ``lag=1`` uses past
    steps only). Until the first window exists (``t0 - lag < 0``) the master layout stays in force.
    Each step's own loads are split evenly over the instances of the layout in force.

    Args:
      stream: int ``[T, R, E]`` (or a sequence of ``[R, E]``), in time order.
      slots_per_rank: ``S``; window, interval: steps (``>= 1``); lag: steps (``>= 0``).

    Returns:
      A :class:`Periodic`.
    """
    if window < 1 or interval < 1 or lag < 0:
        raise ValueError(
            f"need window >= 1, interval >= 1, lag >= 0; got {window}, {interval}, {lag}"
        )
    stream = [_check_loads(x) for x in stream]
    if not stream:
        return Periodic([], [], [], [])
    num_ranks, num_experts = stream[0].shape
    layout = master_layout(num_ranks, num_experts)
    per_expert = np.stack([x.sum(axis=0, dtype=np.int64) for x in stream])  # [T, E]
    steps, replans, moved, seconds = [], [], [], []
    for t, loads in enumerate(stream):
        end = t - lag
        if t % interval == 0 and end >= 0:
            history = per_expert[max(0, end - window + 1) : end + 1].sum(axis=0)
            start = time.perf_counter()
            new = eplb_layout(history, num_ranks, slots_per_rank)
            seconds.append(time.perf_counter() - start)
            replans.append(t)
            moved.append(new_placements(layout, new, num_experts))
            layout = new
        steps.append(apply_layout(layout, loads))
    return Periodic(steps, replans, moved, seconds)


# --------------------------------------------------------------------------------------------
# eplb_plus: replication only, masters fixed
# --------------------------------------------------------------------------------------------


def eplb_plus(loads, slots_per_rank: int) -> Balanced:
    """Replication only with masters fixed; every spare slot used; tokens split evenly.

    ``R * S`` times: take a free spare slot on the least-loaded rank that still has one, and give
    it to the expert with the highest load per instance that this rank does not hold yet; the
    expert's load is then spread evenly over its instances (which lowers the load of every rank
    that holds it). A slot stays empty only if its rank already holds every expert.

    Args:
      loads: int ``[R, E]``; slots_per_rank: ``S``.

    Returns:
      :class:`Balanced` with layout ``[R, E/R + S]``: the masters in the first ``E/R`` columns
      (unchanged), replicas in the last ``S``.
    """
    loads = _check_loads(loads)
    num_ranks, num_experts = loads.shape
    masters = master_layout(num_ranks, num_experts)
    load = expert_loads(loads).astype(np.float64)
    count = np.ones(num_experts, dtype=np.float64)
    held = held_matrix(masters, num_experts)
    rank_load = ranks.home_rank_loads(load, num_ranks)
    free = np.full(num_ranks, slots_per_rank, dtype=np.int64)
    slots = np.full((num_ranks, slots_per_rank), -1, dtype=np.int32)
    for _ in range(num_ranks * slots_per_rank):
        r = int(np.argmin(np.where(free > 0, rank_load, np.inf)))
        per_instance = np.where(held[r], -np.inf, load / count)
        e = int(np.argmax(per_instance))
        if per_instance[e] == -np.inf:  # rank r already holds every expert
            free[r] = 0
            continue
        old = load[e] / count[e]
        count[e] += 1
        new = load[e] / count[e]
        rank_load[held[:, e]] -= old - new
        held[r, e] = True
        rank_load[r] += new
        slots[r, slots_per_rank - free[r]] = e
        free[r] -= 1
    return apply_layout(np.concatenate([masters, slots], axis=1), loads)
