"""One (model, layout, workload) cell of the simulator's table: every balancer on the same load
streams, turned into step times by the cost model."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

import ultraep_jax as uep
from experiments.lab.loads import ranks, workloads
from experiments.lab.stepmodel.layer import (
    CostParams,
    LayerTime,
    copy_seconds,
    fixed_seconds,
    group_step_seconds,
    ideal_layer_time,
    ideal_step_seconds,
    layer_time,
    rank_expert_seconds,
    replica_bytes,
)
from experiments.lab.stepmodel.links import transfer_copy_times
from experiments.lab.stepmodel.shapes import (
    CLUSTERS,
    MODELS,
    SCENARIOS,
    Cluster,
    ModelShape,
    Scenario,
)
from experiments.sim.balancers import BalancerFn, Costed
from experiments.sim.streams import Sampling, layer_samples, workload_label, workload_streams


def slowest_group_step(
    results: Sequence[Sequence[Costed]],
    groups: int,
    model: ModelShape,
    ep: int,
    cluster: Cluster,
    params: CostParams,
    fanout: int | None,
) -> tuple[float, LayerTime]:
    """Step time (max over DP groups) and the summed term breakdown of the slowest group.

    ``results`` is ``[groups * n_layers][M]`` (group-major); sampled layers are scaled up to
    ``model.moe_layers``. ``fanout``: the relay bound of the replica transfer (None: direct).
    """
    n_streams = len(results)
    n_layers = n_streams // groups
    microbatches = len(results[0])
    scale = model.moe_layers / n_layers
    fixed = fixed_seconds(model, cluster, params)
    # Every matrix's transfer in one batched call, in the order the loops below visit them; a
    # layout already in place (no copies charged) moves nothing.
    moved = [
        b.balanced.layout if b.copies.any() else np.full_like(b.balanced.layout, -1)
        for stream in results
        for b in stream
    ]
    copy_times = iter(transfer_copy_times(moved, model.num_experts, fanout))
    best, best_terms = -1.0, None
    for g in range(groups):
        terms = np.zeros(5)
        for stream in results[g * n_layers : (g + 1) * n_layers]:
            for b in stream:
                groups = (b.balanced.quota > 0).sum(axis=1)
                t = layer_time(
                    float(b.rank_load.max()),
                    next(copy_times),
                    b.plan_seconds,
                    model,
                    ep,
                    cluster,
                    params,
                    rank_expert_seconds(b.rank_load, groups, model, params),
                )
                terms += [t.other, t.plan, t.a2a, t.experts, t.transfer_exposed]
        total = group_step_seconds(float(terms.sum()), n_layers, model, fixed, microbatches)
        if total > best:
            best, best_terms = total, LayerTime(*(terms * scale))
    return best, best_terms


def _rows(name: str, results, ideal: float, mean: int, step) -> dict:
    """The table rows of balancer ``name`` from its ``results`` [streams][M]: one with relay and,
    when it moves weights, ``"<name> (direct)"``; ``step(results, fanout)`` gives the step time
    and its terms."""
    flat = [b for stream in results for b in stream]
    moves = any(int(b.copies.sum()) > 0 for b in flat)
    rows = {}
    for label, relay in [(name, True)] + ([(f"{name} (direct)", False)] if moves else []):
        seconds, terms = step(results, relay)
        rows[label] = {
            "step_s": seconds,
            "pct_ideal": 100.0 * ideal / seconds,
            "final_imbalance": float(np.mean([ranks.imbalance(b.rank_load) for b in flat])),
            "peak_rows": int(max(b.rank_load.max() for b in flat)),
            "replicas": float(np.mean([b.copies.sum() for b in flat])),
            "plan_ms": 1e3 * float(np.mean([b.plan_seconds for b in flat])),
            "terms_s": dataclasses.asdict(terms),
        }
    return rows


def simulate_cell(
    model: ModelShape,
    scenario: Scenario,
    workload: str,
    balancers: Mapping[str, BalancerFn],
    cfg_kwargs: Mapping,
    params: CostParams,
    sampling: Sampling,
    traces_dir: str | None = None,
) -> dict:
    """Every balancer on one (model, scenario, workload); returns a dict of rows and metadata.

    Rows are keyed by baseline name; balancers that move weights get a second row
    ``"<name> (direct)"`` (the first uses relay with ``params.relay_fanout``). ``traces_dir``:
    where the ``trace`` workload reads (default `experiments.lab.loads.traces.default_traces_dir`).
    """
    cluster = CLUSTERS[scenario.cluster]
    ep = scenario.ep_size(model)
    groups = min(scenario.dp_size(model), sampling.dp_groups)
    layers = layer_samples(model.moe_layers, sampling.layers_sampled)
    microbatches = sampling.microbatches
    streams, past = workload_streams(
        workload, model, ep, groups, layers, params, sampling, traces_dir
    )
    cfg = uep.BalancerConfig(num_experts=model.num_experts, ep_size=ep, **cfg_kwargs)
    mean = params.tokens_per_rank * model.top_k
    ideal = ideal_step_seconds(model, ep, cluster, params, microbatches)

    def step(results, relay: bool):
        fanout = params.relay_fanout if relay else None
        return slowest_group_step(results, groups, model, ep, cluster, params, fanout)

    rows = {}
    for name, fn in balancers.items():
        rows.update(_rows(name, fn(streams, cfg, past), ideal, mean, step))
    if "none" in rows:
        for row in rows.values():
            row["speedup"] = rows["none"]["step_s"] / row["step_s"]
    ideal_layer = ideal_layer_time(model, ep, cluster, params)
    return {
        "model": model.name,
        "scenario": scenario.name,
        "workload": workload_label(workload, model),
        "ep": ep,
        "dp": scenario.dp_size(model),
        "groups_sampled": groups,
        "layers_sampled": layers,
        "initial_imbalance": float(
            np.mean([workloads.initial_imbalance(x) for s in streams for x in s])
        ),
        "ideal_step_s": ideal,
        "ideal_layer_ms": {k: 1e3 * v for k, v in dataclasses.asdict(ideal_layer).items()},
        "mean_rows": mean,
        # Share of the ideal step in the terms that scale with the busiest rank's rows.
        "expert_share": microbatches * model.moe_layers * ideal_layer.experts / ideal,
        "a2a_share": microbatches * model.moe_layers * ideal_layer.a2a / ideal,
        "planned_layers": microbatches * model.moe_layers,
        "copy_ms": 1e3 * copy_seconds(replica_bytes(model, params), ep, cluster, params),
        "rows": rows,
    }


def run_all(
    models: Sequence[str],
    scenarios: Sequence[str],
    workload_names: Sequence[str],
    balancers: Mapping[str, BalancerFn],
    cfg_kwargs: Mapping,
    params: CostParams,
    sampling: Sampling,
    traces_dir: str | None = None,
) -> list[dict]:
    """Every (model, scenario, workload) cell, in that order (see `simulate_cell`)."""
    return [
        simulate_cell(
            MODELS[m], SCENARIOS[s], w, balancers, cfg_kwargs, params, sampling, traces_dir
        )
        for m in models
        for s in scenarios
        for w in workload_names
    ]
