"""Load streams per (DP group, sampled layer): the real traces and generated Zipf workloads.

A stream holds the load matrices ``[R, E]`` of one model layer in one DP group over consecutive
microbatches; its history holds earlier matrices of the same layer (for balancers that plan from
the past, never costed).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from experiments.lab.loads import drift, workloads
from experiments.lab.loads.traces import trace_layer_counts, trace_runs
from experiments.lab.stepmodel.layer import CostParams
from experiments.lab.stepmodel.shapes import ModelShape


@functools.cache
def _zipf_pool(kind: str, value: float, ep: int, experts: int, tokens: int, top_k: int, size: int):
    """int32 ``[size, R, E]``: the generated matrices of one Zipf setting (seeds ``0..size-1``)."""
    if kind == "zipf":
        make = workloads.rank_zipf_loads
    else:
        make = drift.expert_zipf_loads
    return np.stack([make(ep, experts, tokens, top_k, value, seed) for seed in range(size)])


def layer_samples(num_layers: int, count: int) -> list[int]:
    """``count`` evenly spaced indices out of ``num_layers`` layers (all if count >= num_layers)."""
    count = min(count, num_layers)
    return sorted({round(i * (num_layers - 1) / max(count - 1, 1)) for i in range(count)})


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How much of each cell the simulator samples (each field is also a flag of ``python -m
    experiments.sim``).

    Attributes:
      layers_sampled: MoE layers sampled evenly per model (time is scaled to all layers).
      microbatches: microbatches per step.
      dp_groups: DP groups sampled where DP > 1 (the step waits for the slowest).
      zipf_pool: distinct generated matrices per Zipf setting.
      history: earlier load matrices per stream handed to the balancers (eplb_periodic plans on
        them; 0: it plans on the previous microbatch), never costed.
      seed: seed of the trace splits.
    """

    layers_sampled: int = 12
    microbatches: int = 4
    dp_groups: int = 8
    zipf_pool: int = 6
    history: int = 4
    seed: int = 0


def workload_streams(
    workload: str,
    model: ModelShape,
    ep: int,
    groups: int,
    layers: Sequence[int],
    params: CostParams,
    sampling: Sampling,
    traces_dir: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Load streams and their histories, group-major over (DP group, sampled layer).

    Returns ``(streams, past)``: int32 ``[groups * len(layers), M, R, E]`` and
    ``[groups * len(layers), H, R, E]`` (``M = sampling.microbatches``, ``H = sampling.history``).
    Position ``q`` (``q = m`` for microbatch ``m``, ``q = M + h`` for history matrix ``h``) of
    group ``g``:

    ``trace``: reads trace run ``g * M + q`` (cyclic; switch-base-128 runs are the iterations of
    one dataset in order, so a group's history is other iterations of the same data; deepseek-r1
    runs are other serving runs) at the trace layer proportional to the model layer; counts are
    scaled to ``T * k`` per source rank and split over source ranks at random (seeded).
    ``zipfX``: UltraEP-style rank-level Zipf at initial imbalance X; ``ezipfX``: expert-level Zipf
    with exponent X; both drawn cyclically from a pool of ``sampling.zipf_pool`` seeded matrices
    (each seed has its own hot ranks, so the history says nothing about the present).
    ``traces_dir``: the folder holding the trace folders (default:
    `experiments.lab.loads.traces.default_traces_dir`).
    """
    shape = (groups * len(layers), sampling.microbatches + sampling.history, ep, model.num_experts)
    if workload == "trace":
        out = _trace_matrices(shape, model, layers, params, sampling, traces_dir)
    else:
        out = _zipf_matrices(shape, workload, model, params, sampling)
    return out[:, : sampling.microbatches], out[:, sampling.microbatches :]


def _trace_matrices(shape, model, layers, params, sampling, traces_dir) -> np.ndarray:
    """int32 ``shape`` [groups * layers, M + H, R, E] of the ``trace`` workload (see
    `workload_streams`)."""
    out = np.empty(shape, dtype=np.int32)
    runs = trace_runs(model.trace, traces_dir)
    ep, k, tokens = shape[2], model.top_k, params.tokens_per_rank
    for i, q in np.ndindex(shape[:2]):
        g, li = divmod(i, len(layers))
        run = (g * sampling.microbatches + q) % len(runs)
        trace_layer = layers[li] * runs[run].shape[0] // model.moe_layers
        counts = trace_layer_counts(model.trace, run, trace_layer, k, traces_dir)
        seed = np.random.SeedSequence([sampling.seed, g, layers[li], q]).generate_state(1)[0]
        out[i, q] = workloads.loads_from_expert_counts(counts, ep, tokens, k, int(seed))
    return out


def _zipf_matrices(shape, workload: str, model, params, sampling) -> np.ndarray:
    """int32 ``shape`` [streams, M + H, R, E] of a ``zipfX`` / ``ezipfX`` workload (see
    `workload_streams`)."""
    kind = "ezipf" if workload.startswith("ezipf") else "zipf"
    value = float(workload[len(kind) :])
    ep, experts = shape[2:]
    pool = _zipf_pool(
        kind, value, ep, experts, params.tokens_per_rank, model.top_k, sampling.zipf_pool
    )
    out = np.empty(shape, dtype=np.int32)
    for i, q in np.ndindex(shape[:2]):
        out[i, q] = pool[(i * sampling.microbatches + q) % len(pool)]
    return out


def workload_label(workload: str, model: ModelShape) -> str:
    """Human label naming the trace or the generator."""
    if workload == "trace":
        return f"trace:{model.trace}"
    if workload.startswith("ezipf"):
        return f"expert-zipf s={workload[5:]}"
    return f"rank-zipf {workload[4:]}"
