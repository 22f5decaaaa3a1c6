"""Planner benchmark: balance quality on generated and real loads, and time per plan.

        python -m experiments.bench.planner                # everything, a few minutes on 2 cores
        python -m experiments.bench.planner --seeds=3 --timing_batch=256 --nobaselines
        python -m experiments.bench.planner --train_loads=/tmp/run/loads.jsonl   # a training run

Quality: final max/mean rank load and replicas on the UltraEP reference setup (EP64, 256 experts,
2 spare slots per rank, top-8, 8192 tokens per rank, rank-level Zipf at initial 1.5 / 2.0 / 3.0)
and on every layer of the real traces (``--traces_dir``, default
`experiments.loads.traces.default_traces_dir()`); exact mode (``balance_eps=0``) next to
``--balance_eps`` on the UltraEP setup and DeepSeek-R1 EP32/EP64; optionally the per-layer loads a
training run recorded with ``--profile_loads`` (``--train_loads``). Time: one `jax.jit` of
`jax.vmap(plan)` over a batch of load matrices (so dispatch is amortised), median over repeats,
per plan.

Baselines (experiments/baselines.py): none, eplb_exact, eplb_periodic, eplb_plus and ultraep on the
same load matrices: every trace, rank-level Zipf 1.5 / 2 / 3, expert-level Zipf and a drifting
stream; final max/mean (mean, p95, worst), replicas, placements moved per re-plan, and planning
time per matrix; per trace, whether ultraep is the best replication-only planner, within 0.02
of eplb_exact, and faster than it.
"""

from __future__ import annotations

import functools
import json
import time

import jax
import numpy as np
from absl import app, flags

import ultraep_jax as uep
from experiments import common
from experiments.loads import baselines, traces, workloads
from experiments.train import plot

_SEEDS = flags.DEFINE_integer("seeds", 10, "Seeds per generated setup.")
_SLOTS = flags.DEFINE_integer("slots_per_rank", 2, "Spare slots per rank.")
_MIN_TOKENS = flags.DEFINE_integer("min_tokens_per_replica", 1024, "Least tokens per replica.")
_EPS = flags.DEFINE_float("balance_eps", 0.01, "Balance tolerance above the mean.")
_TOKENS = flags.DEFINE_integer("tokens_per_rank", 8192, "Tokens per source rank.")
_TIMING_BATCH = flags.DEFINE_integer("timing_batch", 1024, "Load matrices per timed jit call.")
_REPEATS = flags.DEFINE_integer("repeats", 15, "Timed repeats (the median is reported).")
_TRACES = flags.DEFINE_list(
    "traces",
    [
        "deepseek-r1:32",
        "deepseek-r1:64",
        "qwen1.5-moe:12",
        "switch-base-128:32",
        "switch-base-128:64",
    ],
    "trace:ep_size pairs to evaluate (empty for none).",
)
_TRACES_DIR = flags.DEFINE_string(
    "traces_dir", None, "Folder of the trace folders (default: traces.default_traces_dir())."
)
_EXACT = flags.DEFINE_bool(
    "exact", True, "Also report exact mode (balance_eps=0) on the UltraEP setup and DeepSeek-R1."
)
_TRAIN_LOADS = flags.DEFINE_string(
    "train_loads",
    None,
    "A training run's <workdir>/loads.jsonl (from --profile_loads): replay every layer-step.",
)
_TRAIN_EP = flags.DEFINE_integer("train_ep_size", 8, "EP ranks of the --train_loads run.")
_TRAIN_MIN_TOKENS = flags.DEFINE_integer(
    "train_min_tokens_per_replica", 8, "min_tokens_per_replica of the --train_loads run."
)
_JSON = flags.DEFINE_string("json_out", None, "Also write the results to this JSON file.")
_BASELINES = flags.DEFINE_bool("baselines", True, "Print the baseline comparison table.")
_BASE_SEEDS = flags.DEFINE_integer(
    "baseline_seeds", 30, "Seeds (matrices) per generated Zipf setup in the baseline table."
)
_EXPERT_ZIPF = flags.DEFINE_list(
    "expert_zipf", ["0.5", "1.0"], "Expert-level Zipf exponents in the baseline table (EP64/E256)."
)
_STREAM_STEPS = flags.DEFINE_integer("stream_steps", 600, "Steps of the drifting stream.")
_STREAM_WINDOW = flags.DEFINE_integer("stream_window", 100, "eplb_periodic window on streams.")
_STREAM_INTERVAL = flags.DEFINE_integer("stream_interval", 100, "eplb_periodic interval, streams.")
_SHORT_WINDOW = flags.DEFINE_integer(
    "short_window", 10, "eplb_periodic window on traces and i.i.d. Zipf draws (short series)."
)
_SHORT_INTERVAL = flags.DEFINE_integer(
    "short_interval", 10, "eplb_periodic interval on traces and i.i.d. Zipf draws."
)
_TRACE_STRIDE = flags.DEFINE_integer(
    "trace_stride", 1, "Baseline table: keep every n-th time series of each trace (1 = all)."
)

# UltraEP (arXiv 2606.04101), EP64 / 256 experts / 2 slots / top-8 / 8192 tokens per rank.
_ULTRAEP_REPLICAS = {1.5: 38, 2.0: 46, 3.0: 51}


def _config(num_experts: int, ep_size: int, eps: float | None = None) -> uep.BalancerConfig:
    """The flags' balancer for [ep_size, num_experts] loads; ``eps`` overrides --balance_eps."""
    return uep.BalancerConfig(
        num_experts=num_experts,
        ep_size=ep_size,
        slots_per_rank=_SLOTS.value,
        min_tokens_per_replica=_MIN_TOKENS.value,
        balance_eps=_EPS.value if eps is None else eps,
    )


def _traces_dir():
    return traces.default_traces_dir() if _TRACES_DIR.value is None else _TRACES_DIR.value


def _quality(batch: np.ndarray, cfg: uep.BalancerConfig) -> dict:
    """Before/after imbalance and replica counts of a batch [N, R, E]."""
    plans = common.batched_planner(cfg)(batch)
    before = np.asarray(uep.imbalance(np.stack([workloads.master_rank_loads(l) for l in batch])))
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


def _time_per_plan_us(batch: np.ndarray, cfg: uep.BalancerConfig) -> float:
    return common.time_batched_plan(batch, cfg, _REPEATS.value) / len(batch) * 1e6


_ZIPF_CACHE: dict = {}
_TRACE_CACHE: dict = {}


def _zipf_batch(initial: float, ep_size: int, num_experts: int, seeds) -> np.ndarray:
    for s in seeds:
        key = (initial, ep_size, num_experts, _TOKENS.value, s)
        if key not in _ZIPF_CACHE:
            _ZIPF_CACHE[key] = workloads.rank_zipf_loads(
                ep_size, num_experts, _TOKENS.value, 8, initial, s
            )
    return np.stack([_ZIPF_CACHE[(initial, ep_size, num_experts, _TOKENS.value, s)] for s in seeds])


def _trace_top_k(name: str) -> int:
    """top-8 for DeepSeek (its own); the model's own top-k for Qwen1.5-MoE (4) and Switch (1)."""
    return 8 if name == "deepseek-r1" else traces.TRACE_TOP_K[name]


def _trace_rows(name: str, ep: int) -> list:
    """Every (label, loads [R, E]) of a trace, seed 0, loaded once per run."""
    key = (name, ep, _TOKENS.value)
    if key not in _TRACE_CACHE:
        _TRACE_CACHE[key] = list(
            workloads.trace_workloads(
                name, ep, _TOKENS.value, _trace_top_k(name), seed=0, traces_dir=_traces_dir()
            )
        )
    return _TRACE_CACHE[key]


# --------------------------------------------------------------------------------------------
# Baseline table
# --------------------------------------------------------------------------------------------


def _trace_series(labels: list) -> list:
    """Time series of a trace's items: lists of indices into ``labels``, each in time order.

    DeepSeek-R1 (``deepseek-r1/<file>/layerLL``): one series per layer over the 12 files in
    sorted file order (each file is a separate serving run, so a plan is applied to another
    workload). HarMoEny CSVs (``name/<file>/<group>/iterII/layerLL``): one series per (file, group,
    layer) over its iterations in order.
    """
    series: dict = {}
    for i, label in enumerate(labels):
        parts = label.split("/")
        if parts[0] == "deepseek-r1":
            key, t = parts[-1], len(series.get(parts[-1], []))
        else:
            key, t = tuple(parts[1:3] + parts[4:5]), int(parts[3].removeprefix("iter"))
        series.setdefault(key, []).append((t, i))
    return [[i for _, i in sorted(v)] for v in series.values()]


def _summary(imb, replicas, moved, seconds) -> dict:
    imb = np.asarray(imb, dtype=np.float64)
    return {
        "n": int(imb.size),
        "final_mean": float(imb.mean()),
        "final_p95": float(np.percentile(imb, 95)),
        "final_worst": float(imb.max()),
        "replicas_mean": float(np.mean(replicas)),
        "moved_per_replan": float(np.mean(moved)) if moved is not None and len(moved) else None,
        "replans": len(moved) if moved is not None else None,
        "plan_us": float(np.mean(seconds)) * 1e6,
    }


def _evaluate(matrices: np.ndarray, series: list, cfg: uep.BalancerConfig, window, interval):
    """All baselines on ``matrices [N, R, E]``; ``series`` orders them in time for eplb_periodic
    and for counting eplb_exact's per-step layout changes. Returns {baseline: summary dict}."""
    S = cfg.slots_per_rank
    R, E = cfg.ep_size, cfg.num_experts
    out = {}
    for name, fn in (
        ("none", baselines.none),
        ("eplb_exact", lambda x: baselines.eplb_exact(x, S)),
        ("eplb_plus", lambda x: baselines.eplb_plus(x, S)),
    ):
        results, seconds = [], []
        for loads in matrices:
            start = time.perf_counter()
            results.append(fn(loads))
            seconds.append(time.perf_counter() - start)
        moved = None
        if name == "eplb_exact":  # every step is a re-plan: placements new vs the step before
            moved = []
            for idx in series:
                prev = baselines.master_layout(R, E)
                for i in idx:
                    moved.append(baselines.new_placements(prev, results[i].layout, E))
                    prev = results[i].layout
        out[name] = _summary(
            [r.imbalance for r in results], [r.num_replicas for r in results], moved, seconds
        )
    imb, replicas, moved, seconds = [], [], [], []
    for idx in series:
        p = baselines.eplb_periodic(matrices[idx], S, window, interval)
        imb += [r.imbalance for r in p.steps]
        replicas += [r.num_replicas for r in p.steps]
        moved += p.new_placements
        seconds += p.plan_seconds
    out["eplb_periodic"] = _summary(imb, replicas, moved, seconds)
    results, batch_seconds = baselines.ultraep_batch(matrices, cfg, repeats=3)
    out["ultraep"] = _summary(
        [r.imbalance for r in results],
        [r.num_replicas for r in results],
        None,
        [batch_seconds / len(matrices)],
    )
    return out


_BASELINE_ORDER = ("none", "eplb_periodic", "eplb_exact", "eplb_plus", "ultraep")


def _print_rows(workload: str, rows: dict) -> None:
    for name in _BASELINE_ORDER:
        q = rows[name]
        moved = "-" if q["moved_per_replan"] is None else f"{q['moved_per_replan']:.1f}"
        replans = "" if q["replans"] is None else f" ({q['replans']})"
        print(
            f"{workload:<28} {name:<14} {q['n']:5d} {q['final_mean']:7.4f} {q['final_p95']:7.4f} "
            f"{q['final_worst']:7.4f} {q['replicas_mean']:8.1f} {moved + replans:>13} "
            f"{q['plan_us']:10.1f}"
        )


def _bar(rows: dict) -> tuple[bool, str]:
    """The baseline check on one trace: ultraep's mean final max/mean is the lowest of the
    replication-only planners (eplb_plus, ultraep), within 0.02 of eplb_exact, and ultraep plans
    faster than eplb_exact."""
    u, x, p = rows["ultraep"], rows["eplb_exact"], rows["eplb_plus"]
    lowest = u["final_mean"] <= p["final_mean"]
    close = u["final_mean"] - x["final_mean"] <= 0.02
    faster = u["plan_us"] < x["plan_us"]
    ratio = x["plan_us"] / u["plan_us"]
    line = (
        f"ultraep - eplb_exact final max/mean: mean {u['final_mean'] - x['final_mean']:+.4f}, "
        f"p95 {u['final_p95'] - x['final_p95']:+.4f}, worst {u['final_worst'] - x['final_worst']:+.4f}"
        f"; ultraep - eplb_plus mean {u['final_mean'] - p['final_mean']:+.4f}; plan time "
        f"eplb_exact/ultraep = {ratio:.1f}x; bar "
        f"{'MET' if lowest and close and faster else 'NOT MET'}"
        f" (lowest replication-only: {'yes' if lowest else 'no'}, within 0.02 of eplb_exact: "
        f"{'yes' if close else 'no'}, faster: {'yes' if faster else 'no'})"
    )
    return lowest and close and faster, line


def _baseline_table(results: dict) -> None:
    S = _SLOTS.value
    print(
        f"\nBaselines on the same load matrices ({S} spare slots/rank, {_TOKENS.value} tokens/rank; "
        f"top-8 for generated loads and DeepSeek-R1, the model's own top-k for Qwen1.5-MoE (4) and "
        f"Switch-Base-128 (1); ultraep: min_tokens_per_replica={_MIN_TOKENS.value}, "
        f"eps={_EPS.value})."
    )
    print(
        "  final = max/mean rank load after balancing over the n matrices. replicas = instances "
        "beyond one per expert (ultraep and eplb_plus rebuild them every step, masters never "
        "move; EPLB fills all R*S)."
    )
    print(
        "  moved/re-plan = (rank, expert) placements a new EPLB layout holds that the one before "
        "did not (masters included; first re-plan vs the master layout), (re-plans in brackets); "
        "eplb_exact re-plans every step."
    )
    print(
        "  eplb_periodic: re-planned at steps 0, N, 2N, ... on the summed loads of the last W "
        "steps up to and including the re-plan step (optimistic: the re-plan step is planned on "
        "its own loads), layout applied to each step's loads."
    )
    print(
        f"  time axis: traces: per DeepSeek layer, the 12 files in sorted order; per HarMoEny "
        f"(file, group, layer), its iterations; W=N={_SHORT_WINDOW.value}/{_SHORT_INTERVAL.value} "
        f"steps. Zipf: the i.i.d. seeds in order (popularity re-drawn every step), "
        f"W/N={_SHORT_WINDOW.value}/{_SHORT_INTERVAL.value}. drift stream: "
        f"W/N={_STREAM_WINDOW.value}/{_STREAM_INTERVAL.value}."
    )
    print(
        "  plan us = planning time per matrix on this CPU: NumPy/Python baselines timed per call "
        "(time.perf_counter); eplb_periodic per re-plan; ultraep = one jit(vmap(plan)) call over "
        "all n matrices / n (median of 3). The baselines are Python loops: part of the ratio is "
        "language, not algorithm."
    )
    if _TRACE_STRIDE.value > 1:
        print(f"  traces subsampled: every {_TRACE_STRIDE.value}-th time series kept.")
    print(
        f"{'workload':<28} {'baseline':<14} {'n':>5} {'mean':>7} {'p95':>7} {'worst':>7} "
        f"{'replicas':>8} {'moved/re-plan':>13} {'plan us':>10}"
    )
    table = results.setdefault("baselines", {})
    bars = []

    for item in _TRACES.value:
        name, ep = item.split(":")
        ep = int(ep)
        try:
            rows = _trace_rows(name, ep)
        except FileNotFoundError as err:
            print(f"{name} EP{ep} skipped: {err}")
            continue
        series = _trace_series([label for label, _ in rows])[:: _TRACE_STRIDE.value]
        keep = sorted(i for idx in series for i in idx)
        where = {i: j for j, i in enumerate(keep)}
        matrices = np.stack([rows[i][1] for i in keep])
        series = [[where[i] for i in idx] for idx in series]
        workload = f"{name} EP{ep} top{_trace_top_k(name)}"
        res = _evaluate(
            matrices,
            series,
            _config(traces.TRACE_NUM_EXPERTS[name], ep),
            _SHORT_WINDOW.value,
            _SHORT_INTERVAL.value,
        )
        table[workload] = res
        _print_rows(workload, res)
        bars.append((workload, *_bar(res)))

    for initial in (1.5, 2.0, 3.0):
        batch = _zipf_batch(initial, 64, 256, range(_BASE_SEEDS.value))
        workload = f"rank-zipf {initial:g} EP64 E256"
        res = _evaluate(
            batch,
            [list(range(len(batch)))],
            _config(256, 64),
            _SHORT_WINDOW.value,
            _SHORT_INTERVAL.value,
        )
        table[workload] = res
        _print_rows(workload, res)

    for exponent in (float(x) for x in _EXPERT_ZIPF.value):
        batch = np.stack(
            [
                workloads.expert_zipf_loads(64, 256, _TOKENS.value, 8, exponent, s)
                for s in range(_BASE_SEEDS.value)
            ]
        )
        workload = f"expert-zipf {exponent:g} EP64 E256"
        res = _evaluate(
            batch,
            [list(range(len(batch)))],
            _config(256, 64),
            _SHORT_WINDOW.value,
            _SHORT_INTERVAL.value,
        )
        table[workload] = res
        _print_rows(workload, res)

    stream = workloads.drifting_stream(64, 256, _TOKENS.value, 8, _STREAM_STEPS.value, seed=0)
    workload = "drift-stream EP64 E256"
    res = _evaluate(
        stream,
        [list(range(len(stream)))],
        _config(256, 64),
        _STREAM_WINDOW.value,
        _STREAM_INTERVAL.value,
    )
    table[workload] = res
    _print_rows(workload, res)

    print("\nPer trace: ultraep vs eplb_exact (best replication-only, within 0.02, faster)")
    for workload, met, line in bars:
        print(f"  {workload}: {line}")
    results["baseline_bar"] = {w: met for w, met, _ in bars}


# --------------------------------------------------------------------------------------------
# Exact mode and training-run loads
# --------------------------------------------------------------------------------------------


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
    print(
        f"\nExact mode (balance_eps=0) vs balance_eps={_EPS.value} on the same loads "
        f"({_SLOTS.value} slots/rank, min_tokens_per_replica={_MIN_TOKENS.value}; final = max/mean "
        f"rank load after balancing: mean, p95, worst over n matrices; replicas: mean, max):"
    )
    print(_QUALITY_HEADER)
    table = results.setdefault("exact_mode", {})
    seeds = range(_SEEDS.value)
    cases = [
        (
            f"rank-zipf {initial:g} EP64 E256",
            functools.partial(_zipf_batch, initial, 64, 256, seeds),
        )
        for initial in _ULTRAEP_REPLICAS
    ]
    cases += [
        (f"deepseek-r1 EP{ep}", functools.partial(_trace_batch, "deepseek-r1", ep))
        for ep in (32, 64)
    ]
    for workload, batch_fn in cases:
        try:
            batch = batch_fn()
        except FileNotFoundError as err:
            print(f"{workload} skipped: {err}")
            continue
        R, E = batch.shape[1:]
        for eps in (_EPS.value, 0.0):
            q = _quality(batch, _config(E, R, eps))
            table[f"{workload} eps={eps:g}"] = q
            print(_quality_row(workload, eps, q))


def _trace_batch(name: str, ep: int) -> np.ndarray:
    """int32 [N, R, E]: every layer of a trace (see _trace_rows)."""
    return np.stack([loads for _, loads in _trace_rows(name, ep)])


def _read_train_loads(path: str, ep_size: int) -> np.ndarray:
    """int32 [N, R, E]: every (step, layer) of a --profile_loads ``loads.jsonl`` (or a saved
    [N, R, E] ``.npy``). The records hold expert totals only; the planner depends on nothing else,
    so each total is spread evenly over the R source rows."""
    if path.endswith(".npy"):
        return np.load(path).astype(np.int32)
    records = plot.read_step_records(path, required=("step", "layers"))
    totals = np.asarray(
        [layer["expert_load"] for r in records for layer in r["layers"]], dtype=np.int64
    )
    loads = np.repeat((totals // ep_size)[:, None, :], ep_size, axis=1)
    loads[:, 0, :] += totals % ep_size
    return loads.astype(np.int32)


def _train_table(results: dict) -> None:
    loads = _read_train_loads(_TRAIN_LOADS.value, _TRAIN_EP.value)
    R, E = loads.shape[1:]
    print(
        f"\nTraining-run loads ({_TRAIN_LOADS.value}): {len(loads)} layer-steps, EP{R}, E{E}, "
        f"{_SLOTS.value} slots/rank, min_tokens_per_replica={_TRAIN_MIN_TOKENS.value}"
    )
    print(f"{_QUALITY_HEADER} {'>1.05':>6} {'>1.01':>6}")
    table = results.setdefault("train_loads", {})
    for eps in (_EPS.value, 0.0):
        cfg = uep.BalancerConfig(E, R, _SLOTS.value, _TRAIN_MIN_TOKENS.value, eps)
        plans = common.batched_planner(cfg)(loads)
        after = np.asarray(uep.imbalance(plans.rank_load))
        q = _quality(loads, cfg)
        q["over_1.05"] = int((after > 1.05).sum())
        q["over_1.01"] = int((after > 1.01).sum())
        table[f"eps={eps:g}"] = q
        print(f"{_quality_row('training run', eps, q)} {q['over_1.05']:6d} {q['over_1.01']:6d}")


def main(argv):
    del argv
    results = {
        "device": str(jax.devices()[0].device_kind),
        "ultraep_setup": {},
        "traces": {},
        "timing_us_per_plan": {},
    }
    cfg = _config(256, 64)
    print(
        f"UltraEP reference setup: EP64, 256 experts, {_SLOTS.value} slots/rank, top-8, "
        f"{_TOKENS.value} tokens/rank, min_tokens_per_replica={_MIN_TOKENS.value}, "
        f"eps={_EPS.value}, {_SEEDS.value} seeds (rank-level Zipf)"
    )
    print(
        f"{'initial':>8} {'final mean':>11} {'final worst':>12} {'replicas':>15} "
        f"{'max/expert':>11} {'UltraEP replicas':>17}"
    )
    for initial, theirs in _ULTRAEP_REPLICAS.items():
        q = _quality(_zipf_batch(initial, 64, 256, range(_SEEDS.value)), cfg)
        results["ultraep_setup"][str(initial)] = q
        print(
            f"{q['initial_mean']:8.3f} {q['final_mean']:11.4f} {q['final_worst']:12.4f} "
            f"{q['replicas_mean']:8.1f} (max {q['replicas_max']:2d}) "
            f"{q['max_replicas_per_expert']:11d} {theirs:17d}"
        )

    if _TRACES.value:
        print(
            f"\nReal traces (per-source split drawn with a seeded multinomial; "
            f"{_TOKENS.value} tokens/rank x the model's top-k):"
        )
        print(
            f"{'trace':>16} {'EP':>4} {'layers':>6} {'initial mean':>13} {'final mean':>11} "
            f"{'final p95':>10} {'final worst':>12} {'replicas':>9}"
        )
        for item in _TRACES.value:
            name, ep = item.split(":")
            ep = int(ep)
            try:
                rows = _trace_rows(name, ep)
            except FileNotFoundError as err:
                print(f"{name:>16} skipped: {err}")
                continue
            q = _quality(
                np.stack([loads for _, loads in rows]),
                _config(traces.TRACE_NUM_EXPERTS[name], ep),
            )
            results["traces"][item] = q
            print(
                f"{name:>16} {ep:4d} {q['n']:6d} {q['initial_mean']:13.3f} {q['final_mean']:11.4f} "
                f"{q['final_p95']:10.4f} {q['final_worst']:12.4f} {q['replicas_mean']:9.1f}"
            )

    if _EXACT.value:
        _exact_table(results)

    if _TRAIN_LOADS.value:
        _train_table(results)

    if _BASELINES.value:
        _baseline_table(results)

    print(
        f"\nPlanner time on {results['device']}: jit(vmap(plan)) over {_TIMING_BATCH.value} "
        f"matrices, median of {_REPEATS.value} repeats"
    )
    for ep, experts in [(32, 256), (64, 256), (128, 512)]:
        # 30 distinct matrices (10 seeds at each initial imbalance), tiled to the batch size.
        distinct = np.stack(
            [
                workloads.rank_zipf_loads(ep, experts, _TOKENS.value, 8, (1.5, 2.0, 3.0)[s % 3], s)
                for s in range(30)
            ]
        )
        batch = np.resize(distinct, (_TIMING_BATCH.value,) + distinct.shape[1:])
        us = _time_per_plan_us(batch, _config(experts, ep))
        results["timing_us_per_plan"][f"EP{ep}/E{experts}"] = us
        line = f"  EP{ep:<4} E{experts:<4} S{_SLOTS.value}: {us:7.1f} us per plan"
        if _EXACT.value:
            exact_us = _time_per_plan_us(batch, _config(experts, ep, 0.0))
            results["timing_us_per_plan"][f"EP{ep}/E{experts} exact"] = exact_us
            line += f" (exact mode: {exact_us:7.1f} us)"
        print(line)

    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)
