"""Planner benchmark: balance quality on generated and real loads, and time per plan.

        python -m experiments.bench_planner                # everything, a minute or two on 2 cores
        python -m experiments.bench_planner --seeds=3 --timing_batch=256

Quality: final max/mean rank load and replicas on the UltraEP reference setup (EP64, 256 experts,
2 spare slots per rank, top-8, 8192 tokens per rank, rank-level Zipf at initial 1.5 / 2.0 / 3.0)
and on every layer of the real traces in shared/traces. Time: one `jax.jit` of `jax.vmap(plan)`
over a batch of load matrices (so dispatch is amortised), median over repeats, per plan.
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np
from absl import app, flags

import ultraep_jax as uep
from experiments import workloads

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
_JSON = flags.DEFINE_string("json_out", None, "Also write the results to this JSON file.")

# UltraEP (arXiv 2606.04101), EP64 / 256 experts / 2 slots / top-8 / 8192 tokens per rank.
_ULTRAEP_REPLICAS = {1.5: 38, 2.0: 46, 3.0: 51}


def _config(num_experts: int, ep_size: int) -> uep.BalancerConfig:
    return uep.BalancerConfig(
        num_experts=num_experts,
        ep_size=ep_size,
        slots_per_rank=_SLOTS.value,
        min_tokens_per_replica=_MIN_TOKENS.value,
        balance_eps=_EPS.value,
    )


def _plan_batch(batch: np.ndarray, cfg: uep.BalancerConfig) -> uep.Plan:
    return jax.jit(jax.vmap(lambda l: uep.plan(l, cfg)))(batch)


def _quality(batch: np.ndarray, cfg: uep.BalancerConfig) -> dict:
    """Before/after imbalance and replica counts of a batch [N, R, E]."""
    plans = _plan_batch(batch, cfg)
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
    fn = jax.jit(jax.vmap(lambda l: uep.plan(l, cfg)))
    batch = jax.device_put(batch)
    jax.block_until_ready(fn(batch))
    times = []
    for _ in range(_REPEATS.value):
        start = time.perf_counter()
        jax.block_until_ready(fn(batch))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / len(batch) * 1e6


def _zipf_batch(initial: float, ep_size: int, num_experts: int, seeds) -> np.ndarray:
    return np.stack(
        [
            workloads.rank_zipf_loads(ep_size, num_experts, _TOKENS.value, 8, initial, s)
            for s in seeds
        ]
    )


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
            top_k = 8 if name == "deepseek-r1" else workloads.TRACE_TOP_K[name]
            try:
                rows = list(workloads.trace_workloads(name, ep, _TOKENS.value, top_k, seed=0))
            except FileNotFoundError as err:
                print(f"{name:>16} skipped: {err}")
                continue
            q = _quality(
                np.stack([loads for _, loads in rows]),
                _config(workloads.TRACE_NUM_EXPERTS[name], ep),
            )
            results["traces"][item] = q
            print(
                f"{name:>16} {ep:4d} {q['n']:6d} {q['initial_mean']:13.3f} {q['final_mean']:11.4f} "
                f"{q['final_p95']:10.4f} {q['final_worst']:12.4f} {q['replicas_mean']:9.1f}"
            )

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
        print(f"  EP{ep:<4} E{experts:<4} S{_SLOTS.value}: {us:7.1f} us per plan")

    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)
