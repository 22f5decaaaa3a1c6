"""What a run reports: the progress line and the figures of ``summary.json`` (each step's layer
records: `experiments.lab.training.layer_stats`)."""

from __future__ import annotations

import pathlib

import numpy as np

from experiments.lab.training.config import TrainConfig
from experiments.train.plot import timed_records


def capacity_text(capacity_factor: float | None) -> str:
    """The capacity factor as the run's first line states it."""
    return "none (dropless)" if capacity_factor is None else f"{capacity_factor:g}"


def summarize_run(records: list[dict], cfg: TrainConfig, workdir: pathlib.Path) -> dict:
    """The figures of ``summary.json`` from the metrics records of every step so far.

    Keys: ``final_loss`` and ``final_eval_loss`` (with ``final_eval_step``); per layer, the mean
    and max over steps of the max/mean rank load before and after balancing
    (``imbalance_before`` / ``imbalance_after`` = ``{"mean": [L], "max": [L]}``);
    ``dropped_pairs`` (total over steps and layers); ``mean_replicas`` (replicas summed over
    layers, mean over steps) and ``mean_replicas_per_layer``; ``median_step_time_s`` and
    ``median_tokens_per_s`` (medians over ``timed_steps`` steps: all but the first step of each
    start, which includes compiling the step; None when no step is left); ``metrics_steps``
    (steps with a record); ``workdir``; ``config``.
    """
    last = records[-1]
    evals = [r for r in records if r.get("eval_loss") is not None]

    def per_layer(key: str) -> np.ndarray:
        return np.asarray([r[key] for r in records if key in r], dtype=np.float64)

    summary = {
        "workdir": str(workdir),
        "balance": cfg.balance,
        "final_loss": last["loss"],
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "final_eval_step": evals[-1]["step"] if evals else None,
    }
    for key in ("imbalance_before", "imbalance_after"):
        values = per_layer(key)
        summary[key] = {
            "mean": [round(float(v), 5) for v in values.mean(axis=0)] if values.size else [],
            "max": [round(float(v), 5) for v in values.max(axis=0)] if values.size else [],
        }
    replicas = per_layer("replicas")
    summary["dropped_pairs"] = int(per_layer("dropped").sum())
    summary["mean_replicas"] = round(float(replicas.sum(axis=1).mean()), 3) if replicas.size else 0
    summary["mean_replicas_per_layer"] = (
        [round(float(v), 3) for v in replicas.mean(axis=0)] if replicas.size else []
    )
    timed = timed_records(records)
    times = [r["step_time"] for r in timed if "step_time" in r]
    speeds = [r["tokens_per_s"] for r in timed if "tokens_per_s" in r]
    summary["median_step_time_s"] = round(float(np.median(times)), 5) if times else None
    summary["median_tokens_per_s"] = round(float(np.median(speeds)), 1) if speeds else None
    summary["timed_steps"] = len(times)
    summary["metrics_steps"] = len(records)
    summary["config"] = cfg.to_json()
    return summary


def progress_line(r: dict) -> str:
    """The line printed for one step's ``metrics.jsonl`` record ``r``."""
    layers = " ".join(
        f"{b:.2f}->{a:.2f}"
        for b, a in zip(r["imbalance_before"], r["imbalance_after"], strict=True)
    )
    line = (
        f"step {r['step']:5d}  loss {r['loss']:.4f}  {r['tokens_per_s']:8.0f} tok/s  "
        f"max/mean per layer {layers}  dropped {sum(r['dropped'])}  "
        f"replicas {sum(r['replicas'])}"
    )
    if "eval_loss" in r:
        line += f"  eval {r['eval_loss']:.4f}"
    return line
