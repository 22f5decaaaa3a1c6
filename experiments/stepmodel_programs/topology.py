"""Topology-aware against topology-blind replica transfer, through the one step model.

    python -m experiments.stepmodel_programs.topology   # the tables and plot, into runs/topology/
    python -m experiments.stepmodel_programs.topology --json_out=experiments/results/topology.json \
        --table_out=experiments/results/topology.md --plot=docs/topology.png  # the committed ones
    python -m experiments.stepmodel_programs.topology --traces=deepseek-r1 --ep_sizes=64 --stride=8

Loads: every (run, layer) of each real trace, made into an EP-R load matrix as the simulator
makes them (`experiments.lab.loads.traces`: the trace's counts for the model's top-k, scaled to
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
import pathlib
import time

from absl import flags

from experiments.lab import cli, dataclass_flags
from experiments.lab.output_files import write_json
from experiments.lab.program import run_main
from experiments.lab.stepmodel.calibration import Calibration, provenance
from experiments.lab.stepmodel.layer import CostParams
from experiments.stepmodel_programs.topology_cells import TOPOLOGIES, TRACES, Run, evaluate
from experiments.stepmodel_programs.topology_report import plot, regime_table, table

#: Where the program writes by default (docs/results.md's files only when the flags name them).
JSON_OUT = f"{cli.run_folder('topology')}/topology.json"
TABLE_OUT = f"{cli.run_folder('topology')}/topology.md"
PLOT_OUT = f"{cli.run_folder('topology')}/topology.png"


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
        "Modelled, not measured: the step model (experiments/lab/stepmodel) on the library's plans "
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
        "provenance": provenance("experiments.stepmodel_programs.topology"),
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
    _COST = dataclass_flags.define_flags(CostParams, only=("tokens_per_rank", "seq_len"))
    _RATES = dataclass_flags.define_flags(Calibration, only=("gemm_efficiency", "link_efficiency"))
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
