"""The figures of `experiments.stepmodel_programs.topology` (its doc says what they are): the
topologies, each trace's loads at its model shape, the plans and relay schedules of the policies
none / blind / aware, and each layer's rows through the one step model.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

import ultraep_jax as uep
from experiments.lab.batched import batched_schedule
from experiments.lab.loads import policies, ranks, traces, workloads
from experiments.lab.stepmodel import layer, links
from experiments.lab.stepmodel.layer import CostParams
from experiments.lab.stepmodel.shapes import CLUSTERS, MODELS, TRACE_MODELS, Cluster, ModelShape
from experiments.lab.summaries import summary

#: The traces, in table order.
TRACES = ("deepseek-r1", "qwen1.5-moe", "switch-base-128")
#: The topologies, in table order (`topology`).
TOPOLOGIES = ("hgx-h100", "gb200-nvl72")
#: The policies, in table order.
POLICIES = ("none", "blind", "aware")


@dataclasses.dataclass(frozen=True)
class Topology:
    """A cluster as an EP group of ``ep`` ranks sees it.

    Attributes:
      name: the cluster's key in `shapes.toml`.
      cluster: the cluster, its ``nvlink_domain`` the fast domain modelled (for the step model's
        all-to-all and links).
      domain: d, ranks per fast domain of the group (dividing ``ep``; ``ep``: one domain).
      layout: the layout in words.
    """

    name: str
    cluster: Cluster
    domain: int
    layout: str


def topology(name: str, ep: int) -> Topology:
    """``name``'s cluster for an EP group of ``ep`` ranks: its NVLink domains when ``ep`` fills
    whole ones or fits in one; otherwise (EP128 on NVL72 racks) the largest power of two that
    fits a domain, used in each (``ep`` must be a multiple of it)."""
    cluster = CLUSTERS[name]
    size = cluster.nvlink_domain
    if ep <= size:
        return Topology(name, cluster, ep, f"one {size}-GPU NVLink domain, {ep} used")
    if ep % size == 0:
        return Topology(name, cluster, size, f"{ep // size} NVLink domains of {size}")
    used = 2 ** int(math.log2(size))
    if ep % used:
        raise ValueError(f"{name}: EP{ep} fills neither whole domains of {size} nor of {used}")
    layout = f"{ep // used} NVLink domains of {size}, {used} GPUs used in each"
    return Topology(name, dataclasses.replace(cluster, nvlink_domain=used), used, layout)


def trace_model(trace: str) -> ModelShape:
    """The model shape the step model charges ``trace`` at: the first in `shapes.toml` (models,
    then trace models) whose ``trace`` it is."""
    for model in [*MODELS.values(), *TRACE_MODELS.values()]:
        if model.trace == trace:
            return model
    raise ValueError(f"no model shape in shapes.toml has trace {trace!r}")


def padded_experts(num_experts: int, ep: int) -> int | None:
    """The experts an EP group of ``ep`` plans over: ``num_experts`` when ``ep`` divides it,
    else padded with idle experts to the next power of two (None when ``ep`` divides neither)."""
    if num_experts % ep == 0:
        return num_experts
    padded = 2 ** math.ceil(math.log2(num_experts))
    return padded if padded % ep == 0 else None


def trace_loads(trace, model, ep, experts, tokens, *, stride=1, seed=0, traces_dir=None):
    """``(labels, loads)``: every ``stride``-th (run, layer) of ``trace`` as an int32 load
    matrix ``[N, R, experts]`` the simulator's way (`traces.trace_layer_counts`,
    `workloads.loads_from_expert_counts`); experts beyond the trace's own (padding) carry no
    load."""
    labels, loads = [], []
    runs = traces.trace_runs(trace, traces_dir)
    items = [(r, li) for r, run in enumerate(runs) for li in range(run.shape[0])][::stride]
    for run, li in items:
        counts = traces.trace_layer_counts(trace, run, li, model.top_k, traces_dir)
        counts = np.concatenate([counts, np.zeros(experts - counts.size, counts.dtype)])
        draw = int(np.random.SeedSequence([seed, run, li]).generate_state(1)[0])
        labels.append(f"run{run:03d}/layer{li:02d}")
        loads.append(workloads.loads_from_expert_counts(counts, ep, tokens, model.top_k, draw))
    return labels, np.stack(loads)


@dataclasses.dataclass(frozen=True)
class Plans:
    """The library planner's plans for a batch ``[N, R, E]``: ``held`` int32 [N, R, C], the
    weights each slot receives (instances off their home rank, -1 elsewhere: what the relay
    schedule moves); ``balanced_rows`` and ``none_rows`` float [N], the busiest rank's rows
    with the plan and with every expert on its master."""

    held: np.ndarray
    balanced_rows: np.ndarray
    none_rows: np.ndarray


def plan(loads_NRE, cfg: uep.BalancerConfig) -> Plans:
    """`Plans` of ``loads_NRE`` under ``cfg`` (one batched planner call)."""
    loads = np.asarray(loads_NRE, np.int32)
    balanced = policies.ultraep_balanced(loads, cfg)
    held = ranks.held_off_home(np.stack([b.layout for b in balanced]), loads.shape[2])
    home = [ranks.home_rank_loads(x.sum(axis=0), loads.shape[1]).max() for x in loads]
    top = [b.rank_load.max() for b in balanced]
    return Plans(held, np.asarray(top, np.float64), np.asarray(home, np.float64))


def schedule(held_NRC, experts_per_rank: int, fanout: int, domain: int | None):
    """``(hop, sender)`` int32 [N, R, C] of the relay schedule of every held matrix, with fast
    domains of ``domain`` ranks (None, or the EP size: one domain)."""
    ep = held_NRC.shape[1]
    d = None if domain is None or domain >= ep else domain
    hop, sender = batched_schedule(ep, experts_per_rank, fanout, d)(held_NRC)
    return np.asarray(hop), np.asarray(sender)


def layer_figures(rows, hop, sender, model, ep, topo: Topology, params) -> dict:
    """Per layer (float [N] each) of one policy on ``topo``: ``slow_gb`` (bytes crossing domains,
    one direction, GB), ``transfer_ms`` (one direction), ``exposed_ms`` (both directions, what
    outlasts the all-to-alls), ``exposed_pct`` (of the ideal layer), ``pct_ideal`` (the ideal
    layer's time over this one's). ``hop`` None: nothing moves."""
    copy_bytes = layer.replica_bytes(model, params)
    n = len(rows)
    if hop is None:
        moved = {"seconds": np.zeros(n), "slow_copies": np.zeros(n)}
    else:
        moved = links.relay_seconds(hop, sender, copy_bytes, params.calibration.links(topo.cluster))
    ideal = layer.ideal_layer_time(model, ep, topo.cluster, params).total
    times = [
        layer.layer_time(r, 0.0, 0.0, model, ep, topo.cluster, params, transfer_s=float(x))
        for r, x in zip(rows, moved["seconds"], strict=True)
    ]
    exposed = np.asarray([t.transfer_exposed for t in times])
    return {
        "slow_gb": moved["slow_copies"] * copy_bytes / 1e9,
        "transfer_ms": 1e3 * moved["seconds"],
        "exposed_ms": 1e3 * exposed,
        "exposed_pct": 100.0 * exposed / ideal,
        "pct_ideal": 100.0 * ideal / np.asarray([t.total for t in times]),
    }


def regime(model, ep, topo: Topology, params) -> dict:
    """What a layer's transfer is weighed against on ``topo``: one replica's bytes, one token
    all-to-all at the mean rows and the ideal layer (ms)."""
    ideal = layer.ideal_layer_time(model, ep, topo.cluster, params)
    a2a = layer.a2a_seconds(
        params.tokens_per_rank * model.top_k, ep, model.hidden, topo.cluster, params
    )
    return {
        "copy_mb": layer.replica_bytes(model, params) / 1e6,
        "a2a_ms": 1e3 * a2a,
        "ideal_layer_ms": 1e3 * ideal.total,
    }


def cell_rows(
    trace, ep, plans: Plans, model, experts, topo, fanout, params, schedules, aware_plans=None
) -> list:
    """The rows of one (trace, EP, topology), one per policy: none and blind on ``plans`` (one
    domain), aware on ``aware_plans`` (planned with ``ranks_per_domain = topo.domain``; None: on
    ``plans``); ``schedules`` caches ``schedule`` per (plans' domain, schedule's domain)."""
    epr = experts // ep
    base = {
        "trace": trace,
        "model": model.name,
        "ep": ep,
        "experts": experts,
        "topology": topo.name,
        "domain": topo.domain,
        "layout": topo.layout,
        "layers": len(plans.balanced_rows),
        **regime(model, ep, topo, params),
    }
    figures = {}
    for policy in POLICIES:
        own = policy == "aware" and aware_plans is not None
        source = aware_plans if own else plans
        rows = source.none_rows if policy == "none" else source.balanced_rows
        hop = sender = None
        if policy != "none":
            domain = topo.domain if policy == "aware" else None
            key = None if domain is None or domain >= ep else domain
            cached = (key if own else None, key)
            if cached not in schedules:
                schedules[cached] = schedule(source.held, epr, fanout, key)
            hop, sender = schedules[cached]
        figures[policy] = layer_figures(rows, hop, sender, model, ep, topo, params)
    out = []
    for policy, f in figures.items():
        row = {**base, "policy": policy, **{k: summary(v) for k, v in f.items()}}
        if policy == "aware":
            blind = figures["blind"]
            row["vs_blind"] = {
                "slow_fewer": int(np.sum(f["slow_gb"] < blind["slow_gb"] - 1e-12)),
                "slow_more": int(np.sum(f["slow_gb"] > blind["slow_gb"] + 1e-12)),
                "transfer_shorter": int(np.sum(f["transfer_ms"] < blind["transfer_ms"] - 1e-9)),
                "transfer_longer": int(np.sum(f["transfer_ms"] > blind["transfer_ms"] + 1e-9)),
                "exposed_shorter": int(np.sum(f["exposed_ms"] < blind["exposed_ms"] - 1e-9)),
                "exposed_longer": int(np.sum(f["exposed_ms"] > blind["exposed_ms"] + 1e-9)),
            }
        out.append(row)
    return out


@dataclasses.dataclass(frozen=True)
class Run:
    """What one run evaluates (each field is a flag)."""

    traces: tuple = TRACES
    ep_sizes: tuple = (32, 64, 128)
    topologies: tuple = TOPOLOGIES
    max_fanout: int = 2
    stride: int = 1
    seed: int = 0


def evaluate(run: Run, cfg_kwargs: dict, params: CostParams, traces_dir=None, log=print) -> list:
    """Every row of ``run``: per trace and EP size, the plans once per domain size (one domain
    for none and blind, each topology's for aware), then per topology and policy (`cell_rows`);
    cells the trace's experts cannot fill are skipped, with a line to ``log``."""
    out = []
    for trace in run.traces:
        model = trace_model(trace)
        for ep in run.ep_sizes:
            experts = padded_experts(model.num_experts, ep)
            if experts is None or experts < ep:
                log(f"skipped: {trace} ({model.num_experts} experts) at EP{ep}")
                continue
            start = time.perf_counter()
            _, loads = trace_loads(
                trace,
                model,
                ep,
                experts,
                params.tokens_per_rank,
                stride=run.stride,
                seed=run.seed,
                traces_dir=traces_dir,
            )
            cfg = uep.BalancerConfig(num_experts=experts, ep_size=ep, **cfg_kwargs)
            by_domain, schedules = {None: plan(loads, cfg)}, {}
            for name in run.topologies:
                topo = topology(name, ep)
                d = None if topo.domain >= ep else topo.domain
                if d not in by_domain:
                    by_domain[d] = plan(loads, dataclasses.replace(cfg, ranks_per_domain=d))
                out += cell_rows(
                    trace,
                    ep,
                    by_domain[None],
                    model,
                    experts,
                    topo,
                    run.max_fanout,
                    params,
                    schedules,
                    aware_plans=by_domain[d],
                )
            log(f"{trace} EP{ep}: {len(loads)} layers, {time.perf_counter() - start:.0f} s")
    return out
