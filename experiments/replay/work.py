"""What every rank of an EP group does for one load matrix under each balancing policy, for
`experiments.replay`: the load matrices (trace layers or generated), each rank's received
rows per local group, the token rows each rank exchanges with each peer and the expert weights
it sends (what those exchanges cost is the step model's, `experiments.lab.stepmodel.links`).

ultraep, exact mode and none are computed as the layer computes them: `ultraep_jax.plan` (with
the layer's receive capacity) and `ultraep_jax.dispatch.group_counts`, the arithmetic
`dispatch.plan_dispatch` runs on every rank. The EPLB baselines (`experiments.lab.loads.baselines`)
re-lay out the experts, so their rows and groups come from their placements: each instance is one
group of the rank that holds it, processing its even share of the expert's tokens.

Shapes: R ranks, E experts, E_m = E / R masters per rank, S spare slots per rank, G groups per
rank, P pairs (rows) each source rank routes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

import ultraep_jax as uep
from experiments.lab.loads import baselines, policies, ranks, traces, workloads
from ultraep_jax.tools import group_counts, masters_only_plan

#: The policies compared, in table order (the force-balanced ideal is reported beside them).
POLICIES = policies.names(without=("eplb_plus",))


@dataclasses.dataclass(frozen=True)
class Sample:
    """One load matrix to replay.

    Attributes:
      label: the trace item (trace/file/.../layer) or the generator and seed.
      loads_RE: int32 [R, E], pairs each source rank routes to each expert.
      history_HRE: int32 [H, R, E], earlier matrices of the same layer, which eplb_periodic plans
        on.
    """

    label: str
    loads_RE: np.ndarray
    history_HRE: np.ndarray


def _layer_key(label: str) -> str:
    """The label without its time axis: the serving run (file) of a deepseek-r1 item, the
    iteration of a HarMoEny item; items with equal keys are one layer at different times."""
    parts = label.split("/")
    if parts[0] == "deepseek-r1":
        return f"{parts[0]}/{parts[-1]}"
    return "/".join(p for p in parts if not p.startswith("iter"))


def trace_samples(
    name: str, ep: int, pairs_per_rank: int, count: int, history: int, seed: int, traces_dir=None
) -> list[Sample]:
    """``count`` layers of trace ``name``, drawn at random (seeded) from its items
    (Switch-Base-128: encoder layers only, see `traces.SWITCH_ENCODER_LAYERS`), as ``[R, E]``
    load matrices of ``pairs_per_rank`` pairs per source rank at the traced model's own top-k,
    each with the ``history`` items of the same layer before it (cyclic). Counts are split over
    source ranks at random, seeded per item (`workloads.loads_from_expert_counts`)."""
    top_k = traces.TRACE_TOP_K[name]
    if pairs_per_rank % top_k:
        raise ValueError(f"pairs_per_rank={pairs_per_rank} is not a multiple of top_k={top_k}")
    items = [
        (label, counts)
        for label, counts in traces.trace_items(name, traces_dir)
        if name != "switch-base-128" or int(label[-2:]) < traces.SWITCH_ENCODER_LAYERS
    ]
    rng = np.random.default_rng([seed, len(items)])
    picks = sorted(rng.choice(len(items), size=min(count, len(items)), replace=False).tolist())

    def loads(index: int) -> np.ndarray:
        item_seed = int(np.random.SeedSequence([seed, index]).generate_state(1)[0])
        counts = items[index][1]
        return workloads.loads_from_expert_counts(
            counts, ep, pairs_per_rank // top_k, top_k, item_seed
        )

    samples = []
    for i in picks:
        key = _layer_key(items[i][0])
        same = [j for j in range(len(items)) if _layer_key(items[j][0]) == key]
        before = [same[(same.index(i) - h) % len(same)] for h in range(history, 0, -1)]
        past = np.stack([loads(j) for j in before]) if before else np.zeros((0, ep, 0), np.int32)
        samples.append(Sample(items[i][0], loads(i), past))
    return samples


def zipf_samples(
    target: float,
    ep: int,
    num_experts: int,
    top_k: int,
    pairs_per_rank: int,
    count: int,
    history: int,
    seed: int,
) -> list[Sample]:
    """``count`` UltraEP-style rank-level Zipf matrices at initial max/mean ``target``
    (`workloads.rank_zipf_loads`), each with ``history`` matrices of other seeds (a popularity
    that moves between steps)."""

    def loads(s: int) -> np.ndarray:
        tokens = pairs_per_rank // top_k
        return workloads.rank_zipf_loads(ep, num_experts, tokens, top_k, target, s)

    return [
        Sample(
            f"rank-zipf {target:g}/seed{seed + i}",
            loads(seed + i),
            np.stack([loads(seed + 1000 * (h + 1) + i) for h in range(history)])
            if history
            else np.zeros((0, ep, num_experts), np.int32),
        )
        for i in range(count)
    ]


def force_balanced_loads(ep: int, num_experts: int, pairs_per_rank: int) -> np.ndarray:
    """int32 [R, E]: every source spreads its pairs over the experts as evenly as integers allow,
    its remainder on experts shifted by its rank, so every rank receives the mean (within E_m)."""
    base, extra = divmod(pairs_per_rank, num_experts)
    loads = np.full((ep, num_experts), base, np.int32)
    for r in range(ep):
        loads[r, (r * extra + np.arange(extra)) % num_experts] += 1
    return loads


@dataclasses.dataclass(frozen=True)
class RankWork:
    """What one policy makes every rank of an EP group do for one load matrix (NumPy).

    Attributes:
      policy: the policy's name.
      group_rows_RG: int [R, G], rows each rank's experts run for each local group: its E_m own
        groups, then ``G - E_m`` groups whose weights arrive from other ranks (replica slots, or
        EPLB's placements beyond E_m).
      capacity: receive-buffer rows per rank (the layer's for ultraep and exact mode; at least the
        busiest rank's rows for the `DROPLESS` policies).
      token_rows_RR: float [R(src), R(dst)], rows each source sends each destination in the
        dispatch (the combine sends them back).
      weight_copies_RR: int [R(src), R(dst)], expert weight sets each rank sends each other rank
        for this layer (their gradients return the same way in training).
      held_RC: int32 [R, C], the experts each rank receives weights of for this layer (-1: none):
        what the relay schedule moves (`ultraep_jax.replicas.relay`).
      dropped: pairs past their destination's capacity.
      plan: the `uep.Plan` whose dispatch bookkeeping the rank runs (EPLB: the masters-only plan,
        the same bookkeeping on the same pairs).
      loads_RE: int32 [R, E], the matrix the bookkeeping runs on.
      host_plan_seconds: host wall time of a NumPy planner on the step's critical path
        (eplb_exact), else 0.
    """

    policy: str
    group_rows_RG: np.ndarray
    capacity: int
    token_rows_RR: np.ndarray
    weight_copies_RR: np.ndarray
    held_RC: np.ndarray
    dropped: int
    plan: uep.Plan
    loads_RE: np.ndarray
    host_plan_seconds: float = 0.0

    @property
    def rows_R(self) -> np.ndarray:
        """int [R]: rows each rank's experts run."""
        return self.group_rows_RG.sum(axis=1)

    @property
    def groups_R(self) -> np.ndarray:
        """int [R]: non-empty groups on each rank."""
        return (self.group_rows_RG > 0).sum(axis=1)

    @property
    def imbalance(self) -> float:
        """max / mean of the rows each rank runs."""
        return ranks.imbalance(self.rows_R)

    @property
    def replicas(self) -> int:
        """Expert weight sets moved for this layer."""
        return int(self.weight_copies_RR.sum())


def layer_capacity(capacity_factor: float, pairs_per_rank: int) -> int:
    """The layer's receive-buffer rows per rank (`uep.ExpertParallel.capacity`)."""
    return max(1, math.ceil(capacity_factor * pairs_per_rank))


def dropless_capacity(max_rows: int, pairs_per_rank: int) -> int:
    """Rows of a buffer that drops nothing: ``max_rows`` rounded up to an eighth of the pairs a
    rank routes (a few buffer sizes, so a few compiled programs)."""
    step = max(1, pairs_per_rank // 8)
    return max(step, -(-max_rows // step) * step)


_jit_plan = jax.jit(uep.plan, static_argnums=(1, 2))
_jit_masters_only = jax.jit(masters_only_plan)
_jit_counts = jax.jit(group_counts, static_argnums=2)


def library_work(
    policy: str, loads_RE: np.ndarray, cfg: uep.BalancerConfig | None, capacity: int
) -> RankWork:
    """ultraep / exact mode (``cfg``) or masters only (``cfg`` None) as the layer runs it: the
    plan of ``loads_RE`` within ``capacity`` rows and every rank's rows per group under it."""
    loads = np.asarray(loads_RE, np.int32)
    if cfg is None:
        plan = _jit_masters_only(loads)
    else:
        plan = _jit_plan(loads, cfg, capacity)
    return plan_work(policy, loads, plan, capacity)


def plan_work(policy: str, loads_RE: np.ndarray, plan: uep.Plan, capacity: int) -> RankWork:
    """Every rank's rows per group under the library's ``plan`` of ``loads_RE`` within
    ``capacity`` rows (`dispatch.group_counts`, as the layer counts them)."""
    loads = np.asarray(loads_RE, np.int32)
    R, E = loads.shape
    counts = jax.device_get(_jit_counts(loads, plan, capacity))
    held, copies = policies.weight_copies(np.asarray(plan.slot_expert), E)
    return RankWork(
        policy=policy,
        group_rows_RG=np.asarray(counts.group_sizes_RG, np.int64),
        capacity=capacity,
        token_rows_RR=np.asarray(counts.kept_RRG.sum(-1), np.float64),
        weight_copies_RR=copies,
        held_RC=held,
        dropped=int(counts.routed_RRG.sum() - counts.kept_RRG.sum()),
        plan=jax.device_get(plan),
        loads_RE=loads,
    )


def placement_work(
    policy: str,
    balanced: baselines.Balanced,
    loads_RE: np.ndarray,
    moves_weights: bool,
    host_plan_seconds: float = 0.0,
) -> RankWork:
    """An EPLB placement as rank work: each instance of layout ``[R, C]`` is a group of its rank
    with its quota of rows; each source splits its pairs for an expert over the expert's
    instances in proportion to their quotas (what routing each token to an instance at random
    gives on average); ``moves_weights``: the layout's instances off their expert's home rank are
    this layer's weight copies (`policies.weight_copies`: a re-layout planned on this step's
    loads), else the layout is already in place."""
    loads = np.asarray(loads_RE, np.int64)
    R, E = loads.shape
    layout, quota = balanced.layout, balanced.quota
    expert_load = loads.sum(axis=0)
    token_rows = np.zeros((R, R))
    for dst, slot in zip(*np.nonzero(layout >= 0), strict=True):
        e = layout[dst, slot]
        if expert_load[e]:
            token_rows[:, dst] += loads[:, e] * quota[dst, slot] / expert_load[e]
    if moves_weights:
        held, copies = policies.weight_copies(layout, E)
    else:
        held, copies = np.full(layout.shape, -1, np.int32), np.zeros((R, R), np.int64)
    masters_only = jax.device_get(_jit_masters_only(loads.astype(np.int32)))
    return RankWork(
        policy=policy,
        group_rows_RG=np.asarray(quota, np.int64),
        capacity=int(quota.sum(axis=1).max()),
        token_rows_RR=token_rows,
        weight_copies_RR=copies,
        held_RC=held,
        dropped=0,
        plan=masters_only,
        loads_RE=loads.astype(np.int32),
        host_plan_seconds=host_plan_seconds,
    )


#: Policies that drop nothing: their buffer holds their busiest rank's rows (`with_buffers`).
DROPLESS = ("none", "eplb_periodic", "eplb_exact")


def policy_work(
    sample: Sample, cfg: uep.BalancerConfig, pairs_per_rank: int, capacity: int
) -> dict[str, RankWork]:
    """Every policy of `POLICIES` on ``sample`` (`policies.run`, eplb_periodic on its history),
    plus ``"ideal"``: the force-balanced ideal, plain EP on `force_balanced_loads` (every rank at
    the mean rows, E_m groups) with the layer's ``capacity``, which ultraep and exact mode also
    use. The library's plans are counted as the layer counts them (`plan_work`), the others'
    layouts as placements (`placement_work`). The `DROPLESS` policies get a buffer of their own
    busiest rank's rows (`dropless_capacity`)."""
    loads = sample.loads_RE
    R, E = loads.shape
    out = {}
    for name in POLICIES:
        run = policies.run(name, loads[None], cfg, sample.history_HRE, capacity=capacity)
        if run.plans is not None:
            plan = jax.tree.map(lambda a: a[0], run.plans)
            out[name] = plan_work(name, loads, plan, capacity)
        else:
            seconds = run.seconds[0] if run.relaid else 0.0
            out[name] = placement_work(name, run.balanced[0], loads, run.relaid, seconds)
    out["ideal"] = library_work("ideal", force_balanced_loads(R, E, pairs_per_rank), None, capacity)
    buffers = {p: dropless_capacity(int(out[p].rows_R.max()), pairs_per_rank) for p in DROPLESS}
    return with_buffers(out, buffers)


def with_buffers(works: dict[str, RankWork], capacity: dict[str, int]) -> dict[str, RankWork]:
    """``works`` with the buffer of each policy named in ``capacity`` set to that many rows (at
    least its busiest rank's), so that one compiled program per shape serves several matrices."""
    return {
        p: dataclasses.replace(w, capacity=capacity.get(p, w.capacity)) for p, w in works.items()
    }
