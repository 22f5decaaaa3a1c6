"""Topology-aware against topology-blind replica transfer, through the one step model.

    python -m experiments.stepmodel.topology          # the tables and plot, into runs/topology/
    python -m experiments.stepmodel.topology --json_out=experiments/results/topology.json \
        --table_out=experiments/results/topology.md --plot=docs/topology.png  # the committed ones
    python -m experiments.stepmodel.topology --traces=deepseek-r1 --ep_sizes=64 --stride=8

Loads: every (run, layer) of each real trace, made into an EP-R load matrix as the simulator
makes them (`experiments.sim.streams`: the trace's counts for the model's top-k, scaled to
``tokens_per_rank`` x top-k pairs per rank and split over the source ranks at random, seeded),
planned by the library planner (``BalancerConfig`` at its defaults, or the balancer flags).
Each trace is charged at the model shape the step model maps it to (`shapes.toml`: the first
model whose ``trace`` it is; Qwen1.5-MoE, whose 60 experts divide none of the EP sizes, at its
own shape in ``trace_models``, padded with idle experts to 64, so at EP32 and EP64 only).

Policies:

  none    no balancing: every expert on its master, nothing moves
  blind   the plans of one domain (``ranks_per_domain`` None), the replicas' weights along
          ``relay_schedule(domain_size=None)``: one tree per expert over all ranks, whatever their
          links (today's default)
  aware   ``BalancerConfig.ranks_per_domain = d``: the plans of ``uep.plan`` with the domains (its
          targets prefer ranks in a domain that already gets the expert: ffi/PLANNER.md,
          pick_target), the weights along ``relay_schedule(domain_size=d)``: an expert's copy
          crosses the slow links once per remote domain, to a gateway replica, and fans out
          inside the domain over fast links. With one domain (d = EP) the plans and the schedule
          are blind's.

Topologies (`TOPOLOGIES`), ranks laid out domain-contiguously:

  hgx-h100     8-GPU nodes (d = 8): NVLink 450 GB/s inside a node, InfiniBand 50 GB/s between
  gb200-nvl72  EP32 and EP64 in one 72-GPU NVLink domain (d = EP: aware is blind, by
               construction, and nothing crosses a slow link); EP128 does not fit one rack and is
               modelled as two racks of 64 used GPUs each (d = 64), joined by the cluster's
               50 GB/s per GPU scale-out link

Per layer: the copies that cross domains times one replica's bytes (one direction; the
gradients return as many in backward), the transfer's time (`links.relay_seconds`: per hop each
rank's copies within and across domains, each class at its rate concurrently, the busiest rank
sending or receiving sets the hop, the hops one after another; one direction), the exposed
transfer and the layer as % of the force-balanced ideal (`layer.layer_time`, training: the
transfer runs beside the all-to-all of its pass and only what outlasts it counts, forward and
backward). Rates: the clusters' nominal figures at the step model's link and GEMM efficiencies
(`Calibration`); the planner's time is not charged.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time

import numpy as np
from absl import flags

import ultraep_jax as uep
from experiments import cli
from experiments.batched import batched_schedule
from experiments.loads import policies, ranks, workloads
from experiments.output_files import write_json
from experiments.program import run_main
from experiments.sim import streams
from experiments.stepmodel import layer, links
from experiments.stepmodel.calibration import Calibration, provenance
from experiments.stepmodel.layer import CostParams
from experiments.stepmodel.shapes import CLUSTERS, MODELS, TRACE_MODELS, Cluster, ModelShape
from experiments.summaries import summary

#: The traces, in table order.
TRACES = ("deepseek-r1", "qwen1.5-moe", "switch-base-128")
#: The topologies, in table order (`topology`).
TOPOLOGIES = ("hgx-h100", "gb200-nvl72")
#: The policies, in table order.
POLICIES = ("none", "blind", "aware")
#: Where the program writes by default (docs/results.md's files only when the flags name them).
JSON_OUT = f"{cli.run_folder('topology')}/topology.json"
TABLE_OUT = f"{cli.run_folder('topology')}/topology.md"
PLOT_OUT = f"{cli.run_folder('topology')}/topology.png"


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
    matrix ``[N, R, experts]`` the simulator's way (`streams.trace_layer_counts`,
    `workloads.loads_from_expert_counts`); experts beyond the trace's own (padding) carry no
    load."""
    labels, loads = [], []
    runs = streams.trace_runs(trace, traces_dir)
    items = [(r, li) for r, run in enumerate(runs) for li in range(run.shape[0])][::stride]
    for run, li in items:
        counts = streams.trace_layer_counts(trace, run, li, model.top_k, traces_dir)
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


# --- Report ----------------------------------------------------------------------------------

TRACE_LABELS = {
    "deepseek-r1": "DeepSeek-R1",
    "qwen1.5-moe": "Qwen1.5-MoE",
    "switch-base-128": "Switch-Base-128",
}
TOPOLOGY_LABELS = {"hgx-h100": "8-GPU nodes", "gb200-nvl72": "NVL72"}
#: The plot's panel titles per topology (the layouts EP32-128 take).
PLOT_TITLES = {
    "hgx-h100": "8-GPU nodes (d=8)",
    "gb200-nvl72": "NVL72 (EP32, EP64: one domain; EP128: 2 racks x 64)",
}


def _three(s: dict, digits: int) -> str:
    """``median / p90 / max`` of a `summary`, 0 when all are."""
    if s["max"] == 0:
        return "0"
    return " / ".join(f"{s[k]:.{digits}f}" for k in ("median", "p90", "max"))


def table(rows: list[dict]) -> list[str]:
    """The markdown table: per trace, EP, topology and policy, the per-layer figures (median /
    p90 / max over layers; % of ideal: median / min)."""
    lines = [
        "| trace (model) | EP | topology (d) | policy | slow-link GB per layer | transfer, ms "
        "| exposed, ms | exposed, % of ideal layer | % of ideal (median / min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pct = r["pct_ideal"]
        lines.append(
            f"| {TRACE_LABELS[r['trace']]} ({r['model']}) | {r['ep']} "
            f"| {TOPOLOGY_LABELS[r['topology']]} (d={r['domain']}) | {r['policy']} "
            f"| {_three(r['slow_gb'], 2)} | {_three(r['transfer_ms'], 1)} "
            f"| {_three(r['exposed_ms'], 1)} | {_three(r['exposed_pct'], 1)} "
            f"| {pct['median']:.1f} / {pct['min']:.1f} |"
        )
    return lines


def regime_table(rows: list[dict]) -> list[str]:
    """The markdown table of what each cell's transfer is weighed against."""
    lines = [
        "| trace (model) | EP | topology | layout | layers | one copy, MB | one all-to-all, ms "
        "| ideal layer, ms | aware vs blind, layers: fewer slow-link copies; transfer shorter "
        "/ longer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["policy"] != "aware":
            continue
        vs = r["vs_blind"]
        lines.append(
            f"| {TRACE_LABELS[r['trace']]} ({r['model']}, E={r['experts']}) | {r['ep']} "
            f"| {TOPOLOGY_LABELS[r['topology']]} | {r['layout']} | {r['layers']} "
            f"| {r['copy_mb']:.1f} | {r['a2a_ms']:.2f} | {r['ideal_layer_ms']:.1f} "
            f"| {vs['slow_fewer']}; {vs['transfer_shorter']} / {vs['transfer_longer']} |"
        )
    return lines


def plot(rows: list[dict], path) -> None:
    """Writes a PNG: per topology (rows of panels) the blind and aware schedules' slow-link GB
    and transfer per layer (bars at the median, whiskers to the worst layer) and the worst
    layer's exposed transfer, for each trace and EP size; the transfer panel marks one token
    all-to-all (what the transfer may take before any of it is exposed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    topos = list(dict.fromkeys(r["topology"] for r in rows))
    metrics = [
        ("slow_gb", "median", "slow-link GB per layer"),
        ("transfer_ms", "median", "transfer per layer, ms (one direction)"),
        ("exposed_ms", "max", "worst layer's exposed transfer, ms"),
    ]
    short = {"deepseek-r1": "DS-R1", "qwen1.5-moe": "Qwen1.5", "switch-base-128": "Switch"}
    fig = Figure(figsize=(15, 3.6 * len(topos)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(topos), len(metrics), squeeze=False)
    for i, name in enumerate(topos):
        cells = [r for r in rows if r["topology"] == name]
        groups = list(dict.fromkeys((r["trace"], r["ep"]) for r in cells))
        x = np.arange(len(groups))
        labels = [f"{short[t]}\nEP{ep}" for t, ep in groups]
        for j, (key, stat, title) in enumerate(metrics):
            ax = axes[i][j]
            for k, policy in enumerate(("blind", "aware")):
                got = {(r["trace"], r["ep"]): r[key] for r in cells if r["policy"] == policy}
                bar = np.array([got[g][stat] for g in groups])
                at = x + (k - 0.5) * 0.38
                ax.bar(at, bar, 0.38, label=policy)
                if stat == "median":
                    top = np.array([got[g]["max"] for g in groups])
                    whisker = [0 * bar, top - bar]
                    ax.errorbar(at, bar, yerr=whisker, fmt="none", ecolor="black", capsize=2)
            if key == "transfer_ms":
                a2a = {(r["trace"], r["ep"]): r["a2a_ms"] for r in cells}
                marks = [a2a[g] for g in groups]
                ax.scatter(x, marks, marker="_", s=300, color="red", label="one all-to-all")
            ax.set_xticks(x, labels, fontsize=8)
            ax.set_title(f"{PLOT_TITLES[name]}:\n{title}", fontsize=9)
            ax.grid(True, axis="y", alpha=0.3)
        axes[i][1].legend(fontsize=8)
    fig.suptitle(
        "Replica transfer per layer, topology-blind vs topology-aware relay schedule (f=2): "
        "bars at the median layer, whiskers to the worst. Modelled, not measured.",
        fontsize=10,
    )
    fig.savefig(str(path), dpi=100, format="png")


def _out(path: str) -> pathlib.Path | None:
    """``path`` with its folder created (None for '')."""
    if not path:
        return None
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def main(argv):
    """Prints the assumptions and tables; writes the JSON, the markdown tables and the plot."""
    del argv
    start = time.perf_counter()
    f = flags.FLAGS
    run = Run(
        traces=tuple(f.traces),
        ep_sizes=tuple(int(e) for e in f.ep_sizes),
        topologies=tuple(f.topologies),
        max_fanout=f.max_fanout,
        stride=f.stride,
        seed=f.seed,
    )
    params = CostParams(**_COST(), calibration=Calibration(**_RATES()))
    cfg_kwargs = _BALANCER()
    rows = evaluate(run, cfg_kwargs, params, f.traces_dir)
    text = [
        "Modelled, not measured: the step model (experiments/stepmodel) on the library's plans "
        "(none and blind: one domain; aware: ranks_per_domain=d, its targets chosen by domain) "
        f"and relay schedules; BalancerConfig({cfg_kwargs}), max_fanout={run.max_fanout}, "
        f"{params.tokens_per_rank} tokens per rank, links at nominal x "
        f"{params.calibration.link_efficiency}, GEMMs at {params.calibration.gemm_efficiency} "
        "of peak, training (transfer forward and gradients back), planner not charged.",
        "",
        *table(rows),
        "",
        *regime_table(rows),
    ]
    print("\n".join(text))
    if path := _out(f.table_out):
        path.write_text("\n".join(text) + "\n")
    if path := _out(f.plot):
        plot(rows, path)
    run_info = {**dataclasses.asdict(run), "balancer": cfg_kwargs}
    payload = {
        "provenance": provenance("experiments.stepmodel.topology"),
        "run": run_info,
        "params": dataclasses.asdict(params),
        "rows": rows,
    }
    write_json(_out(f.json_out), payload)
    print(f"({time.perf_counter() - start:.0f} s)")


def _define_flags():
    """The program's flags (defined when it runs, not on import: the tests import this module
    beside programs with flags of the same names)."""
    global _COST, _RATES, _BALANCER
    flags.DEFINE_list("traces", list(TRACES), f"Traces: {', '.join(TRACES)}.")
    flags.DEFINE_list("ep_sizes", ["32", "64", "128"], "EP sizes.")
    flags.DEFINE_list("topologies", list(TOPOLOGIES), f"Clusters: {', '.join(TOPOLOGIES)}.")
    flags.DEFINE_integer("max_fanout", 2, "The relay bound f of both schedules.")
    flags.DEFINE_integer("stride", 1, "Keep every n-th (run, layer) of each trace (1: all).")
    flags.DEFINE_integer("seed", 0, "Seed of the split of each trace layer over source ranks.")
    flags.DEFINE_string("json_out", JSON_OUT, "The figures as JSON ('' for none).")
    flags.DEFINE_string("table_out", TABLE_OUT, "The markdown tables ('' for none).")
    flags.DEFINE_string("plot", PLOT_OUT, "The PNG plot ('' for none).")
    cli.define_traces_dir()
    _COST = cli.define_flags(CostParams, only=("tokens_per_rank", "seq_len"))
    _RATES = cli.define_flags(Calibration, only=("gemm_efficiency", "link_efficiency"))
    _BALANCER = cli.define_balancer_flags()
    flags.register_validator("traces", lambda v: set(v) <= set(TRACES), "unknown trace")
    flags.register_validator("topologies", lambda v: set(v) <= set(TOPOLOGIES), "unknown cluster")
    flags.register_validator(
        "ep_sizes", lambda v: all(e.isdigit() and int(e) > 0 for e in v), "positive integers"
    )
    for name in ("stride", "max_fanout"):
        flags.register_validator(name, lambda v: v >= 1, "must be >= 1")


if __name__ == "__main__":
    _define_flags()
    run_main(main)
