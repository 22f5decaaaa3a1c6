"""The per-step records of a training step's MoE layers, from their stats (``uep.MoEStats``
with a leading layer axis): `layer_record` for ``metrics.jsonl``, `load_profile` for
``loads.jsonl``."""

from __future__ import annotations

import jax
import numpy as np

import ultraep_jax as uep

__all__ = ["layer_record", "load_profile"]


def layer_record(stats: uep.MoEStats) -> dict:
    """The per-layer figures of one step's ``metrics.jsonl`` record: max/mean rank load before
    and after balancing, dropped pairs, replicas and the replica transfer's largest per-rank send
    in bytes (``stats`` with a leading layer axis)."""
    stats = jax.device_get(stats)
    return {
        "imbalance_before": [round(float(v), 5) for v in stats.imbalance_before],
        "imbalance_after": [round(float(v), 5) for v in stats.imbalance_after],
        "dropped": [int(v) for v in stats.dropped],
        "replicas": [int(v) for v in stats.replicas],
        "transfer_send_max": [int(v) for v in stats.transfer_send_max],
    }


def load_profile(step: int, stats: uep.MoEStats) -> dict:
    """Per-layer loads of one step for `<workdir>/loads.jsonl` (the load profiler; ``stats``
    with a leading layer axis)."""
    stats = jax.device_get(stats)
    return {
        "step": step,
        "layers": [
            {
                "expert_load": np.asarray(stats.expert_load[i]).tolist(),
                "rank_load_before": np.asarray(stats.rank_load_before[i]).tolist(),
                "rank_load_after": np.asarray(stats.rank_load_after[i]).tolist(),
                "replicas": int(stats.replicas[i]),
                "dropped": int(stats.dropped[i]),
            }
            for i in range(len(stats.replicas))
        ],
    }
