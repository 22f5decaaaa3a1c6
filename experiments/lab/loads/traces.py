"""The measured expert-load traces: where they are and how their files read (NumPy, host only).

Real routing counts of public models; the data is in the repository's ``traces/`` folder, whose
README names the sources (see :func:`default_traces_dir`):
  * ``deepseek-r1`` -- DeepSeek-V3/R1 serving runs (SGLang), 256 experts:
    :func:`deepseek_trace_expert_counts`.
  * ``qwen1.5-moe`` (60 experts) and ``switch-base-128`` (128 experts) -- HarMoEny's
    expert-frequency CSVs: :func:`harmoeny_trace_rows`.

A trace read as runs of per-layer counts (`trace_runs`) and one (run, layer) for a top-k router
(`trace_layer_counts`, `topk_counts`) feeds the simulator and the step model's programs. The
traces count tokens per expert only; every layer of a trace becomes a load matrix ``[R, E]``
(`trace_workloads`, by `experiments.lab.loads.workloads.loads_from_expert_counts`), and the
programs that plan them read them as one batch ``[N, R, E]`` at the traced model's own top-k
(`trace_batch`, `trace_top_k`).
"""

from __future__ import annotations

import csv
import functools
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from experiments.lab.loads.workloads import loads_from_expert_counts, pairs_per_rank
from ultraep_jax.tools import check_int

__all__ = [
    "DEEPSEEK_DENSE_LAYERS",
    "HARMOENY_RUNS",
    "SWITCH_ENCODER_LAYERS",
    "TOPK_DRAWS",
    "TRACE_NAMES",
    "TRACE_NUM_EXPERTS",
    "TRACE_TOP_K",
    "deepseek_trace_expert_counts",
    "default_traces_dir",
    "harmoeny_trace_rows",
    "topk_counts",
    "trace_batch",
    "trace_items",
    "trace_layer_counts",
    "trace_rows",
    "trace_runs",
    "trace_top_k",
    "trace_workloads",
    "traces_dir_for",
]

#: Trace names (folder names under the traces directory).
TRACE_NAMES = ("deepseek-r1", "qwen1.5-moe", "switch-base-128")
#: Logical (routed) experts of each traced model.
TRACE_NUM_EXPERTS = {"deepseek-r1": 256, "qwen1.5-moe": 60, "switch-base-128": 128}
#: The traced model's own top-k (for reference; callers pick ``top_k`` when scaling a trace).
TRACE_TOP_K = {"deepseek-r1": 8, "qwen1.5-moe": 4, "switch-base-128": 1}
#: DeepSeek-V3/R1 has 61 layers, the first 3 dense (no routed experts; the JSON holds a constant).
DEEPSEEK_DENSE_LAYERS = 3
#: Switch-Base-128 layers 6-11 are decoder layers with 512 tokens per row, mostly all on one
#: expert; experiments use the encoder layers 0-5 (524288 tokens per row).
SWITCH_ENCODER_LAYERS = 6
_DEEPSEEK_NUM_LAYERS = 61


def traces_dir_for(checkout: Path) -> Path:
    """The trace folder a repository ``checkout`` reads: ``<checkout>/../shared/traces`` when it
    exists (a workspace's shared copy), else the copy kept in the repository,
    ``<checkout>/traces``."""
    checkout = Path(checkout)
    shared = checkout.parent / "shared" / "traces"
    return shared if shared.is_dir() else checkout / "traces"


def default_traces_dir() -> Path:
    """The trace folder of this checkout (see :func:`traces_dir_for`)."""
    return traces_dir_for(Path(__file__).resolve().parents[3])


def _resolve_traces_dir(traces_dir) -> Path:
    path = default_traces_dir() if traces_dir is None else Path(traces_dir)
    if not path.is_dir():
        raise FileNotFoundError(
            f"trace folder not found: {path} (pass traces_dir=... pointing at a folder that holds "
            f"{', '.join(TRACE_NAMES)})"
        )
    return path


def deepseek_trace_expert_counts(path) -> np.ndarray:
    """Per-layer routed-expert counts of one DeepSeek-V3/R1 trace file.

    The file (SGLang-reproduce, ``attachment_ep_statistics/``) is JSON ``{"logical_count":
    [61][256]}``: tokens routed to each of the 256 routed experts (each top-8 choice counts once),
    summed over a whole serving run. Its first 3 layers are dense and hold a constant row; they
    are checked to be constant (ValueError otherwise) and dropped.

    Args:
      path: a ``*.json`` file of the ``deepseek-r1`` trace folder.

    Returns:
      int64 ``[58, 256]``: row ``i`` is model layer ``i + 3``.
    """
    path = Path(path)
    with path.open() as f:
        data = json.load(f)
    if "logical_count" not in data:
        raise ValueError(f"{path}: no 'logical_count' key")
    counts = np.asarray(data["logical_count"], dtype=np.float64)
    if counts.ndim != 2 or counts.shape[0] != _DEEPSEEK_NUM_LAYERS:
        raise ValueError(
            f"{path}: logical_count has shape {counts.shape}, expected "
            f"({_DEEPSEEK_NUM_LAYERS}, num_experts)"
        )
    dense = counts[:DEEPSEEK_DENSE_LAYERS]
    if not np.all(dense == dense[:, :1]):
        raise ValueError(f"{path}: the first {DEEPSEEK_DENSE_LAYERS} layers are not constant rows")
    moe = counts[DEEPSEEK_DENSE_LAYERS:]
    if np.any(np.all(moe == moe[:, :1], axis=1)):
        raise ValueError(f"{path}: a routed (MoE) layer holds a constant row")
    if np.any(moe < 0) or not np.all(moe == np.round(moe)):
        raise ValueError(f"{path}: counts must be non-negative integers")
    return moe.astype(np.int64)


def harmoeny_trace_rows(csv_path) -> list[tuple[dict, np.ndarray]]:
    """Rows of a HarMoEny expert-frequency CSV (Qwen1.5-MoE-A2.7B or Switch-Base-128).

    Header: an unnamed row-index column, then either ``dataset`` (bookcorpus / wikitext / wmt19 /
    random) or ``router_skew`` (0.0 / 0.5 / 0.9), then ``iteration``, ``layer_idx`` and one column
    per expert named ``0 .. E-1`` (60 for Qwen1.5-MoE, 128 for Switch-Base-128). Each row counts
    the tokens routed to each expert (each top-k choice once) in one (iteration, layer).

    Args:
      csv_path: one of the ``expert_freq_*.csv`` files.

    Returns:
      list, in file order, of ``(meta, counts)``: ``meta`` is a dict with ``"row"`` (int, the
      index column), ``"dataset"`` (str) or ``"router_skew"`` (float), ``"iteration"`` (int),
      ``"layer"`` (int); ``counts`` is int64 ``[E]``.
    """
    csv_path = Path(csv_path)
    with csv_path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        if (
            len(header) < 5
            or header[2:4] != ["iteration", "layer_idx"]
            or header[1]
            not in (
                "dataset",
                "router_skew",
            )
        ):
            raise ValueError(f"{csv_path}: unexpected header {header[:5]}")
        expert_cols = header[4:]
        if expert_cols != [str(i) for i in range(len(expert_cols))]:
            raise ValueError(f"{csv_path}: expert columns are not 0..E-1")
        key = header[1]
        rows = []
        for line_no, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != len(header):
                raise ValueError(f"{csv_path}:{line_no}: {len(row)} fields, expected {len(header)}")
            values = np.asarray([float(x) for x in row[4:]], dtype=np.float64)
            if np.any(values < 0) or not np.all(values == np.round(values)):
                raise ValueError(f"{csv_path}:{line_no}: counts must be non-negative integers")
            meta = {
                "row": int(row[0]),
                key: float(row[1]) if key == "router_skew" else row[1],
                "iteration": int(row[2]),
                "layer": int(row[3]),
            }
            rows.append((meta, values.astype(np.int64)))
    return rows


def trace_items(name: str, traces_dir=None) -> Iterator[tuple[str, np.ndarray]]:
    """``(label, counts)`` for every layer / row of the trace ``name``, in a fixed order: int64
    ``[E]`` tokens per expert, labelled by trace, file and layer (see
    `trace_workloads`).

    ``traces_dir``: the folder holding the trace folders (default :func:`default_traces_dir`).
    FileNotFoundError, before the first item, when it, the trace's folder or its files are missing.
    """
    folder = _resolve_traces_dir(traces_dir) / name
    if not folder.is_dir():
        raise FileNotFoundError(f"trace folder not found: {folder}")
    pattern = "*.json" if name == "deepseek-r1" else "*.csv"
    files = sorted(folder.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no {pattern} files in {folder}")
    return _items(name, files)


def _items(name: str, files: list[Path]) -> Iterator[tuple[str, np.ndarray]]:
    """The items of :func:`trace_items`, read lazily from ``files``."""
    for path in files:
        if name == "deepseek-r1":
            for i, counts in enumerate(deepseek_trace_expert_counts(path)):
                yield f"{name}/{path.stem}/layer{i + DEEPSEEK_DENSE_LAYERS:02d}", counts
            continue
        for meta, counts in harmoeny_trace_rows(path):
            group = meta["dataset"] if "dataset" in meta else f"skew{meta['router_skew']:g}"
            label = (
                f"{name}/{path.stem}/{group}/iter{meta['iteration']:02d}/layer{meta['layer']:02d}"
            )
            yield label, counts


#: Tokens drawn to turn a top-1 trace row into top-k expert shares.
TOPK_DRAWS = 16384


#: The HarMoEny file each of its traces is read from as runs, and the layers kept of it.
HARMOENY_RUNS = {
    "switch-base-128": ("expert_freq_switch128_datasets.csv", SWITCH_ENCODER_LAYERS),
    "qwen1.5-moe": ("expert_freq_qwen_policy_datasets.csv", None),
}


@functools.cache
def trace_runs(trace: str, traces_dir: str | None = None) -> tuple[np.ndarray, ...]:
    """A trace as runs of per-layer counts, each ``[layers, E]``.

    deepseek-r1: one run per file (12 serving runs x 58 MoE layers). switch-base-128: one run per
    (dataset, iteration) of ``expert_freq_switch128_datasets.csv`` (4 x 30 runs), encoder layers
    0-5 only (see `SWITCH_ENCODER_LAYERS`). qwen1.5-moe: one run per (dataset, iteration)
    of ``expert_freq_qwen_policy_datasets.csv`` (4 x 20 runs x 12 layers). ``traces_dir`` is the
    folder holding the trace folders (default `default_traces_dir`); FileNotFoundError
    when the trace is not there.
    """
    base = default_traces_dir() if traces_dir is None else Path(traces_dir)
    root = base / trace
    if not root.is_dir():
        raise FileNotFoundError(f"trace folder not found: {root} (see --traces_dir)")
    if trace == "deepseek-r1":
        return tuple(deepseek_trace_expert_counts(p) for p in sorted(root.glob("*.json")))
    file, kept = HARMOENY_RUNS[trace]
    runs: dict = {}
    for meta, counts in harmoeny_trace_rows(root / file):
        if kept is None or meta["layer"] < kept:
            runs.setdefault((meta["dataset"], meta["iteration"]), {})[meta["layer"]] = counts
    return tuple(
        np.stack([layers[k] for k in sorted(layers)]) for _, layers in sorted(runs.items())
    )


def topk_counts(counts, top_k: int, draws: int, seed: int) -> np.ndarray:
    """Expert pair counts of ``draws`` tokens that each pick ``top_k`` distinct experts.

    Each token draws its experts without replacement with probabilities proportional to
    ``counts`` (Gumbel top-k), so no expert exceeds ``1 / top_k`` of the pairs, as in a real
    top-k router; a top-1 trace scaled naively to top-k could put more than one token's worth of
    choices on one expert. Returns int64 ``[E]`` summing to ``draws * top_k``.
    """
    counts = np.asarray(counts, dtype=np.float64)
    log_p = np.log(np.maximum(counts / counts.sum(), 1e-300))
    gumbel = np.random.default_rng(seed).gumbel(size=(draws, counts.size))
    picks = np.argpartition(-(log_p + gumbel), top_k - 1, axis=1)[:, :top_k]
    return np.bincount(picks.ravel(), minlength=counts.size).astype(np.int64)


@functools.cache
def trace_layer_counts(
    trace: str, run: int, layer: int, top_k: int, traces_dir: str | None = None
) -> np.ndarray:
    """Counts of one trace (run, layer) for a ``top_k`` router (``topk_counts`` when the traced
    model routed to fewer experts than ``top_k``)."""
    counts = trace_runs(trace, traces_dir)[run][layer]
    if TRACE_TOP_K[trace] >= top_k:
        return counts
    return topk_counts(counts, top_k, TOPK_DRAWS, seed=run * 1000 + layer)


def trace_workloads(
    name: str, ep_size: int, tokens_per_rank: int, top_k: int, seed: int, traces_dir=None
) -> Iterator[tuple[str, np.ndarray]]:
    """Every layer of a measured trace as a load matrix.

    Yields one ``(label, loads)`` per (file, MoE layer) for ``"deepseek-r1"`` (12 files x 58
    layers) and per CSV row for ``"qwen1.5-moe"`` (60 experts) and ``"switch-base-128"`` (128
    experts); files are visited in sorted order. ``loads`` is int32 ``[R, E]`` built by
    :func:`loads_from_expert_counts` (the traces have no per-source-rank split: it is drawn at
    random, seeded) with a per-item seed derived from ``(seed, item index)``. Labels name the
    trace, the file (without extension) and the layer, e.g.
    ``deepseek-r1/prefill_in512/layer03`` or
    ``qwen1.5-moe/expert_freq_qwen_policy_skew/skew0.9/iter07/layer11``.

    Args:
      name: one of `TRACE_NAMES`.
      ep_size: ``R``; must divide the model's expert count (checked before the first item).
      tokens_per_rank, top_k: each matrix holds ``R * tokens_per_rank * top_k`` pairs (the
        model's own top-k is in `TRACE_TOP_K`; any value works).
      seed: integer seed.
      traces_dir: the folder holding the trace folders (see `default_traces_dir`).
    """
    if name not in TRACE_NAMES:
        raise ValueError(f"unknown trace {name!r}; expected one of {', '.join(TRACE_NAMES)}")
    ep_size = check_int("ep_size", ep_size)
    num_experts = TRACE_NUM_EXPERTS[name]
    if num_experts % ep_size != 0:
        raise ValueError(f"{name} has {num_experts} experts, not divisible by ep_size={ep_size}")
    pairs_per_rank(ep_size, tokens_per_rank, top_k)
    items = trace_items(name, traces_dir)  # raises here when the files are missing

    def generate() -> Iterator[tuple[str, np.ndarray]]:
        for index, (label, counts) in enumerate(items):
            if counts.shape[0] != num_experts:
                raise ValueError(f"{label}: {counts.shape[0]} experts, expected {num_experts}")
            item_seed = int(np.random.SeedSequence([int(seed), index]).generate_state(1)[0])
            loads = loads_from_expert_counts(counts, ep_size, tokens_per_rank, top_k, item_seed)
            yield label, loads

    return generate()


def trace_top_k(name: str) -> int:
    """The traced model's own top-k (`TRACE_TOP_K`), at which the programs that plan a trace's
    layers read them (`trace_rows`, `trace_batch`)."""
    return TRACE_TOP_K[name]


@functools.cache
def trace_rows(
    name: str, ep_size: int, tokens_per_rank: int, traces_dir: str | None = None
) -> tuple[tuple[str, np.ndarray], ...]:
    """Every ``(label, loads [R, E])`` of the trace ``name`` (`trace_workloads`, seed 0, the
    traced model's own top-k, `trace_top_k`), read once per arguments (cached: do not write to
    the arrays); FileNotFoundError when its files are not in ``traces_dir``."""
    rows = trace_workloads(name, ep_size, tokens_per_rank, trace_top_k(name), 0, traces_dir)
    return tuple(rows)


@functools.cache
def trace_batch(
    name: str, ep_size: int, tokens_per_rank: int, stride: int = 1, traces_dir: str | None = None
) -> np.ndarray:
    """int32 ``[N, R, E]``: every ``stride``-th layer of the trace ``name`` as a load matrix
    (`trace_rows`: seed 0, the traced model's own top-k), in the traces' fixed order (cached: do
    not write to it)."""
    rows = trace_rows(name, ep_size, tokens_per_rank, traces_dir)
    return np.stack([loads for i, (_, loads) in enumerate(rows) if i % stride == 0])
