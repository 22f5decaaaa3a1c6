"""Planner benchmark: balance quality on generated and real loads, and time per plan.

        python -m experiments.planner                # everything, a few minutes on 2 cores
        python -m experiments.planner --seeds=3 --timing_batch=256 --nobaselines
        python -m experiments.planner --train_loads=/tmp/run/loads.jsonl   # a training run

Quality: final max/mean rank load and replicas on the UltraEP reference setup (the step model's
``ANCHOR``, `experiments/lab/stepmodel/shapes.toml`: EP64, DeepSeek-V3's experts, rank-level Zipf at
its initial loads)
and on every layer of the real traces (``--traces_dir``, default
`experiments.lab.loads.traces.default_traces_dir()`); exact mode (``balance_eps=0``) next to
``--balance_eps`` on the UltraEP setup and DeepSeek-R1 EP32/EP64; optionally the per-layer loads a
training run recorded with ``--profile_loads`` (``--train_loads``). Time: one `jax.jit` of
`jax.vmap(plan)` over a batch of load matrices (so dispatch is amortised), median over repeats,
per plan.

Baselines (``--baselines``, `experiments.planner.baselines`): none, eplb_exact,
eplb_periodic, eplb_plus and ultraep on the same load matrices. The flags are defined in
`experiments.planner.setup`.
"""

from __future__ import annotations

import jax
import numpy as np
from absl import flags

import ultraep_jax as uep
from experiments.lab import records
from experiments.lab.batched import batched_planner
from experiments.lab.loads import workloads
from experiments.lab.output_files import write_json
from experiments.lab.stepmodel.shapes import ANCHOR
from experiments.lab.walltime import time_batched_plan
from experiments.planner import baselines as planner_baselines
from experiments.planner import setup

flags.adopt_module_key_flags(setup)  # --help lists the benchmark's flags

# The anchor (UltraEP's EP64 setup, stepmodel/shapes.toml): its replicas per Zipf target.
_ULTRAEP_REPLICAS = dict(zip(ANCHOR.zipf_targets, ANCHOR.replicas, strict=True))
_R, _E = ANCHOR.ep, ANCHOR.shape.num_experts


def _quality(batch: np.ndarray, cfg: uep.BalancerConfig) -> dict:
    """Before/after imbalance and replica counts of a batch [N, R, E]."""
    plans = batched_planner(cfg)(batch)
    before = np.asarray(uep.imbalance(np.stack([workloads.master_rank_loads(x) for x in batch])))
    after = np.asarray(uep.imbalance(plans.rank_load))
    replicas = np.asarray(plans.num_replicas)
    slot_expert = np.asarray(plans.slot_expert).reshape(len(batch), -1)
    per_expert = [np.bincount(s[s >= 0], minlength=cfg.num_experts).max() for s in slot_expert]
    return {
        "n": len(batch),
        "initial_mean": float(before.mean()),
        "initial_max": float(before.max()),
        "final_mean": float(after.mean()),
        "final_p95": float(np.percentile(after, 95)),
        "final_worst": float(after.max()),
        "replicas_mean": float(replicas.mean()),
        "replicas_max": int(replicas.max()),
        "max_replicas_per_expert": int(max(per_expert)),
    }


_REFERENCE_HEADER = (
    f"{'initial':>8} {'final mean':>11} {'final worst':>12} {'replicas':>15} "
    f"{'max/expert':>11} {'UltraEP replicas':>17}"
)


def _reference_table(results: dict) -> None:
    """Quality on the UltraEP reference setup, next to UltraEP's replica counts."""
    print(
        f"UltraEP reference setup: EP{_R}, {_E} experts, top-{ANCHOR.shape.top_k}, "
        f"{setup.TOKENS.value} tokens/rank, {setup.balancer_note()}, "
        f"{setup.SEEDS.value} seeds (rank-level Zipf)"
    )
    print(_REFERENCE_HEADER)
    table = results.setdefault("ultraep_setup", {})
    for initial, theirs in _ULTRAEP_REPLICAS.items():
        batch = setup.zipf_batch(initial, _R, _E, range(setup.SEEDS.value))
        q = table[str(initial)] = _quality(batch, setup.config(_E, _R))
        print(
            f"{q['initial_mean']:8.3f} {q['final_mean']:11.4f} {q['final_worst']:12.4f} "
            f"{q['replicas_mean']:8.1f} (max {q['replicas_max']:2d}) "
            f"{q['max_replicas_per_expert']:11d} {theirs:17d}"
        )


_TRACES_HEADER = (
    f"{'trace':>16} {'EP':>4} {'layers':>6} {'initial mean':>13} {'final mean':>11} "
    f"{'final p95':>10} {'final worst':>12} {'replicas':>9}"
)


def _traces_table(results: dict) -> None:
    """Quality on every layer of each ``--traces`` trace."""
    print(
        "\nReal traces (per-source split drawn with a seeded multinomial; "
        f"{setup.TOKENS.value} tokens/rank x the model's top-k):"
    )
    print(_TRACES_HEADER)
    table = results.setdefault("traces", {})
    for name, ep, rows in setup.trace_cases():
        batch = np.stack([loads for _, loads in rows])
        q = table[f"{name}:{ep}"] = _quality(batch, setup.config(batch.shape[2], ep))
        print(
            f"{name:>16} {ep:4d} {q['n']:6d} {q['initial_mean']:13.3f} {q['final_mean']:11.4f} "
            f"{q['final_p95']:10.4f} {q['final_worst']:12.4f} {q['replicas_mean']:9.1f}"
        )


def _quality_row(workload: str, eps: float, q: dict) -> str:
    return (
        f"{workload:<24} {eps:>6g} {q['n']:5d} {q['initial_mean']:8.3f} {q['final_mean']:9.5f} "
        f"{q['final_p95']:9.5f} {q['final_worst']:9.5f} {q['replicas_mean']:8.1f} "
        f"{q['replicas_max']:5d}"
    )


_QUALITY_HEADER = (
    f"{'workload':<24} {'eps':>6} {'n':>5} {'initial':>8} {'final':>9} {'p95':>9} {'worst':>9} "
    f"{'replicas':>8} {'max':>5}"
)


def _exact_table(results: dict) -> None:
    """Final max/mean and replicas with balance_eps=0 next to --balance_eps on the same loads."""
    eps = setup.BALANCER()["balance_eps"]
    print(
        f"\nExact mode (balance_eps=0) vs balance_eps={eps} on the same loads "
        f"({setup.balancer_note()}; final = max/mean rank load after balancing: mean, p95, worst "
        "over n matrices; replicas: mean, max):"
    )
    print(_QUALITY_HEADER)
    table = results.setdefault("exact_mode", {})
    seeds = range(setup.SEEDS.value)
    cases = [
        (f"rank-zipf {x:g} EP{_R} E{_E}", lambda x=x: setup.zipf_batch(x, _R, _E, seeds))
        for x in _ULTRAEP_REPLICAS
    ]
    cases += [
        (f"deepseek-r1 EP{ep}", lambda ep=ep: setup.trace_batch("deepseek-r1", ep))
        for ep in (32, 64)
    ]
    for workload, make_batch in cases:
        try:
            batch = make_batch()
        except FileNotFoundError as err:
            print(f"{workload} skipped: {err}")
            continue
        R, E = batch.shape[1:]
        for value in (eps, 0.0):
            q = table[f"{workload} eps={value:g}"] = _quality(
                batch, setup.config(E, R, balance_eps=value)
            )
            print(_quality_row(workload, value, q))


def _read_train_loads(path: str, ep_size: int) -> np.ndarray:
    """int32 [N, R, E]: every (step, layer) of a --profile_loads ``loads.jsonl`` (or a saved
    [N, R, E] ``.npy``). The records hold expert totals only; the planner depends on nothing else,
    so each total is spread evenly over the R source rows."""
    if path.endswith(".npy"):
        return np.load(path).astype(np.int32)
    steps = records.read_loads(path)
    totals = np.asarray(
        [layer["expert_load"] for r in steps for layer in r["layers"]], dtype=np.int64
    )
    loads = np.repeat((totals // ep_size)[:, None, :], ep_size, axis=1)
    loads[:, 0, :] += totals % ep_size
    return loads.astype(np.int32)


def _train_table(results: dict) -> None:
    """Quality on every layer-step a training run recorded (``--train_loads``)."""
    loads = _read_train_loads(setup.TRAIN_LOADS.value, setup.TRAIN_EP.value)
    R, E = loads.shape[1:]
    min_tokens = setup.TRAIN_MIN_TOKENS.value
    print(
        f"\nTraining-run loads ({setup.TRAIN_LOADS.value}): {len(loads)} layer-steps, EP{R}, "
        f"E{E}, {setup.balancer_note(min_tokens_per_replica=min_tokens)}"
    )
    print(f"{_QUALITY_HEADER} {'>1.05':>6} {'>1.01':>6}")
    table = results.setdefault("train_loads", {})
    for eps in (setup.BALANCER()["balance_eps"], 0.0):
        cfg = setup.config(E, R, min_tokens_per_replica=min_tokens, balance_eps=eps)
        after = np.asarray(uep.imbalance(batched_planner(cfg)(loads).rank_load))
        q = table[f"eps={eps:g}"] = _quality(loads, cfg)
        q["over_1.05"] = int((after > 1.05).sum())
        q["over_1.01"] = int((after > 1.01).sum())
        print(f"{_quality_row('training run', eps, q)} {q['over_1.05']:6d} {q['over_1.01']:6d}")


def _timing_table(results: dict) -> None:
    """Planner time per plan at the anchor's EP size and experts, half of them and twice them
    (and in exact mode)."""
    print(
        f"\nPlanner time on {results['device']}: jit(vmap(plan)) over "
        f"{setup.TIMING_BATCH.value} matrices, median of {setup.REPEATS.value} repeats"
    )
    table = results.setdefault("timing_us_per_plan", {})
    slots = setup.BALANCER()["slots_per_rank"]
    for ep, experts in [(_R // 2, _E), (_R, _E), (2 * _R, 2 * _E)]:
        # 30 distinct matrices (10 seeds at each initial imbalance), tiled to the batch size.
        distinct = np.stack(
            [setup.zipf_batch(ANCHOR.zipf_targets[s % 3], ep, experts, [s])[0] for s in range(30)]
        )
        batch = np.resize(distinct, (setup.TIMING_BATCH.value,) + distinct.shape[1:])
        modes = {"": {}, " exact": {"balance_eps": 0.0}} if setup.EXACT.value else {"": {}}
        for mode, overrides in modes.items():
            seconds = time_batched_plan(
                batch, setup.config(experts, ep, **overrides), setup.REPEATS.value
            )
            table[f"EP{ep}/E{experts}{mode}"] = seconds / len(batch) * 1e6
        line = f"  EP{ep:<4} E{experts:<4} S{slots}: {table[f'EP{ep}/E{experts}']:7.1f} us per plan"
        if setup.EXACT.value:
            line += f" (exact mode: {table[f'EP{ep}/E{experts} exact']:7.1f} us)"
        print(line)


def main(argv):
    """Prints the benchmark's tables; ``--json_out`` also writes them."""
    del argv
    results = {"device": str(jax.devices()[0].device_kind)}
    _reference_table(results)
    if setup.TRACES.value:
        _traces_table(results)
    if setup.EXACT.value:
        _exact_table(results)
    if setup.TRAIN_LOADS.value:
        _train_table(results)
    if setup.BASELINES.value:
        planner_baselines.baseline_table(results)
    _timing_table(results)
    write_json(setup.JSON.value, results)
