"""The step model's whole training step (`experiments.lab.stepmodel.cpu_step`) beside the steps
`python -m experiments.bench.step --pinned_ranks=2` measured, then projected, as a model, to
EP32 and EP64 with the imbalance of the real load traces.

    python -m experiments.stepmodel_programs.wholestep

First, for each ``--cases`` JSON of bench.step: each mode's median step and each ratio,
measured beside predicted (the rates of ``--rates`` alone: the layer's rates and the rest of the
step, `experiments.bench.rates`; nothing fitted to a step).

Then the projection, a model and no measurement: the bench's EP2 rank (T tokens, top-2, D=128,
F=512, E/R = 4 masters, its measured rest) on this machine's CPU rates, with only each MoE
layer's max/mean rank load taken from the traces at EP32 and EP64: plain the home ranks' loads
(`experiments.lab.loads.ranks.home_rank_loads`) of each trace layer's load matrix
(`experiments.lab.loads.workloads.loads_from_expert_counts` at the traced model's top-k), balanced
`uep.plan`'s (`experiments.lab.loads.policies.ultraep_balanced`, the trainer's planner settings) on
the same matrix; the model's layers at the mean over the trace's layers (a layer's time is
linear in its rows). What it holds fixed: the all-to-all at its EP2 bytes and gloo rate (the
links are not scaled: the portable exchange's R x T x k rows would grow with R, a ragged
exchange's would not), one replica's stage per balanced layer (the rates time 0 or 1), the
rest's gradient all-reduce at two ranks. What grows with R: plain dropless's buffer, R x T x k
rows as the trainer sizes it (its per-row costs are the bench's). Not the GPU `Calibration`.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
from absl import flags

import ultraep_jax as uep
from experiments.lab.loads import policies, ranks, traces, workloads
from experiments.lab.loads.traces import trace_layer_counts, trace_runs
from experiments.lab.program import run_main
from experiments.lab.stepmodel import cpu_step
from experiments.lab.training.config import TrainConfig

#: The bench's figures the report sets beside the model's: ratio name -> how it prints.
SHOWN = {
    "balanced_pct_of_ideal": "{:.1f} %",
    "balanced_x_over_plain": "{:.3f}x",
    "balanced_x_over_plain@1.25": "{:.3f}x",
    "plain_pct_of_ideal": "{:.1f} %",
}


def case_lines(rates: cpu_step.StepRates, name: str, case: dict) -> list[str]:
    """One bench.step case: each mode's median step and each ratio, measured and predicted."""
    p = cpu_step.predict_case(rates, case)
    lines = [f"case {name}: median step, measured vs model (ms)"]
    for mode, (measured, model) in p["steps"].items():
        lines.append(
            f"  {mode:10s} {measured * 1e3:7.1f} {model * 1e3:7.1f}  ({model / measured - 1:+.0%})"
        )
    for ratio, (measured, model) in p["ratios"].items():
        fmt = SHOWN[ratio]
        lines.append(
            f"  {ratio:27s} measured {fmt.format(measured):>8s}  model {fmt.format(model):>8s}"
        )
    return lines


def trace_imbalances(trace: str, ep: int, tokens: int, runs: int, traces_dir=None) -> dict:
    """Mean over the layers of ``runs`` runs of ``trace`` at ``ep`` ranks: max/mean of the home
    ranks' loads (``plain``) and of `uep.plan`'s rank loads (``balanced``), and its replicas
    per layer (``replicas``); ``layers``: how many load matrices."""
    E, k = traces.TRACE_NUM_EXPERTS[trace], traces.TRACE_TOP_K[trace]
    matrices = []
    for run, layers in enumerate(trace_runs(trace, traces_dir)[:runs]):
        for layer in range(layers.shape[0]):
            counts = trace_layer_counts(trace, run, layer, k, traces_dir)
            matrices.append(workloads.loads_from_expert_counts(counts, ep, tokens, k, seed=layer))
    batch = np.stack(matrices).astype(np.int32)
    defaults = TrainConfig()
    cfg = uep.BalancerConfig(
        num_experts=E,
        ep_size=ep,
        slots_per_rank=defaults.slots_per_rank,
        min_tokens_per_replica=defaults.min_tokens_per_replica,
        balance_eps=defaults.balance_eps,
        min_tokens_per_rank=0,
    )
    plans = policies.ultraep_balanced(batch, cfg)
    plain = [ranks.imbalance(ranks.home_rank_loads(m.sum(axis=0), ep)) for m in batch]
    masters = E // ep
    return {
        "plain": float(np.mean(plain)),
        "balanced": float(np.mean([b.imbalance for b in plans])),
        "replicas": float(np.mean([np.sum(b.layout[:, masters:] >= 0) for b in plans])),
        "layers": len(batch),
    }


def projection_lines(rates: cpu_step.StepRates, eps, names, runs: int, traces_dir) -> list[str]:
    """The projection's table (module docstring): per trace and EP, the mean max/mean before and
    after balancing, and the model's balanced / ideal and balanced / plain dropless."""
    lines = [
        "projection (a model, not a measurement): the bench's EP2 rank on this machine's CPU "
        "rates, each layer's max/mean from the traces at EP R (the all-to-all not scaled; "
        "plain dropless's buffer R x T x k rows)",
        f"{'trace':>16} {'EP':>3} {'layers':>6} {'plain':>6} {'after':>6} {'replicas':>8} "
        f"{'balanced/ideal':>14} {'balanced/plain':>14} {'bal % of ideal':>14} "
        f"{'bal x plain':>11}",
    ]
    L = rates.num_layers
    for name in names:
        E = traces.TRACE_NUM_EXPERTS[name]
        for ep in eps:
            if E % ep:
                lines.append(f"{name:>16} {ep:3d}  (skipped: {E} experts over {ep} ranks)")
                continue
            imb = trace_imbalances(name, ep, rates.tokens, runs, traces_dir)
            ideal = cpu_step.mode_step_seconds(rates, "ideal", [1.0] * L, ep)
            balanced = cpu_step.mode_step_seconds(rates, "balanced", [imb["balanced"]] * L, ep)
            plain = cpu_step.mode_step_seconds(rates, "plain", [imb["plain"]] * L, ep)
            lines.append(
                f"{name:>16} {ep:3d} {imb['layers']:6d} {imb['plain']:6.3f} "
                f"{imb['balanced']:6.3f} {imb['replicas']:8.1f} {balanced / ideal:14.3f} "
                f"{balanced / plain:14.3f} {100 * ideal / balanced:13.1f}% "
                f"{plain / balanced:10.3f}x"
            )
    return lines


def main(argv):
    """Prints each case measured vs predicted, then the projection."""
    del argv
    f = flags.FLAGS
    rates = cpu_step.StepRates.read(f.rates)
    p = rates.layer.pinned.provenance
    print(f"rates: {f.rates} ({p['date']}; rest: {p.get('remeasured_rest', p['date'])})")
    print(
        f"rest of the step {rates.rest_s * 1e3:.1f} ms at {rates.tokens} tokens per rank, "
        f"{rates.num_layers} MoE layers; balanced layers charged {cpu_step.REPLICAS} replica"
    )
    for path in sorted(pathlib.Path(f.results).glob(f.cases)):
        for name, case in json.loads(path.read_text())["cases"].items():
            print(f"\n{path.name}: " + "\n".join(case_lines(rates, name, case)))
    print()
    eps = [int(e) for e in f.eps]
    print("\n".join(projection_lines(rates, eps, f.traces, f.trace_runs, f.traces_dir)))


if __name__ == "__main__":
    # Defined here, not on import: the tests import this module beside programs with flags.
    flags.DEFINE_string("rates", "experiments/results/rates_cpu.json", "The rates file.")
    flags.DEFINE_string("results", "experiments/results", "Where the bench.step JSONs are.")
    flags.DEFINE_string("cases", "bench_step_*.json", "Glob of bench.step JSONs in --results.")
    flags.DEFINE_list("eps", ["32", "64"], "EP sizes of the projection.")
    flags.DEFINE_multi_enum(
        "traces", list(traces.TRACE_NAMES), traces.TRACE_NAMES, "Traces of the projection."
    )
    flags.DEFINE_integer("trace_runs", 2, "Runs of each trace (every layer of each).")
    flags.DEFINE_string("traces_dir", None, "The traces' folder (default: the repository's).")
    run_main(main)
