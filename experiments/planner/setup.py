"""The planner benchmark's flags, and what they select: balancer configs and load matrices.

Shared by `experiments.planner` (the entry) and `experiments.planner.baselines`.
Generated matrices and trace layers are made once per run (cached).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
from absl import flags

import ultraep_jax as uep
from experiments.lab import cli
from experiments.lab.loads import traces, workloads
from experiments.lab.stepmodel.shapes import ANCHOR

SEEDS = flags.DEFINE_integer("seeds", 10, "Seeds per generated setup.")
BALANCER = cli.define_balancer_flags()
TOKENS = flags.DEFINE_integer(
    "tokens_per_rank", ANCHOR.tokens_per_rank, "Tokens per source rank (default: the anchor's)."
)
TIMING_BATCH = flags.DEFINE_integer("timing_batch", 1024, "Load matrices per timed jit call.")
REPEATS = flags.DEFINE_integer("repeats", 15, "Timed repeats (the median is reported).")
TRACES = flags.DEFINE_list(
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
TRACES_DIR = cli.define_traces_dir()
EXACT = flags.DEFINE_bool(
    "exact", True, "Also report exact mode (balance_eps=0) on the UltraEP setup and DeepSeek-R1."
)
TRAIN_LOADS = flags.DEFINE_string(
    "train_loads",
    None,
    "A training run's <workdir>/loads.jsonl (from --profile_loads): replay every layer-step.",
)
TRAIN_EP = flags.DEFINE_integer("train_ep_size", 8, "EP ranks of the --train_loads run.")
TRAIN_MIN_TOKENS = flags.DEFINE_integer(
    "train_min_tokens_per_replica", 8, "min_tokens_per_replica of the --train_loads run."
)
JSON = cli.define_json_out()
BASELINES = flags.DEFINE_bool("baselines", True, "Print the baseline comparison table.")
BASE_SEEDS = flags.DEFINE_integer(
    "baseline_seeds", 30, "Seeds (matrices) per generated Zipf setup in the baseline table."
)
EXPERT_ZIPF = flags.DEFINE_list(
    "expert_zipf", ["0.5", "1.0"], "Expert-level Zipf exponents in the baseline table (EP64/E256)."
)
STREAM_STEPS = flags.DEFINE_integer("stream_steps", 600, "Steps of the drifting stream.")
STREAM_WINDOW = flags.DEFINE_integer("stream_window", 100, "eplb_periodic window on streams.")
STREAM_INTERVAL = flags.DEFINE_integer("stream_interval", 100, "eplb_periodic interval, streams.")
SHORT_WINDOW = flags.DEFINE_integer(
    "short_window", 10, "eplb_periodic window on traces and i.i.d. Zipf draws (short series)."
)
SHORT_INTERVAL = flags.DEFINE_integer(
    "short_interval", 10, "eplb_periodic interval on traces and i.i.d. Zipf draws."
)
TRACE_STRIDE = flags.DEFINE_integer(
    "trace_stride", 1, "Baseline table: keep every n-th time series of each trace (1 = all)."
)


def _trace_pair_ok(item: str) -> bool:
    name, _, ep = item.partition(":")
    return name in traces.TRACE_NAMES and ep.isdigit() and int(ep) > 0


flags.register_validator(
    "traces",
    lambda items: all(map(_trace_pair_ok, items)),
    f"each must be trace:ep_size, trace one of {', '.join(traces.TRACE_NAMES)}",
)
flags.register_validator(
    "expert_zipf", lambda xs: all(x.replace(".", "", 1).isdigit() for x in xs), "numbers >= 0"
)


def config(num_experts: int, ep_size: int, **overrides) -> uep.BalancerConfig:
    """The flags' balancer for ``[ep_size, num_experts]`` loads; ``overrides`` (BalancerConfig
    fields) replace flag values."""
    return uep.BalancerConfig(num_experts, ep_size, **{**BALANCER(), **overrides})


def balancer_note(**overrides) -> str:
    """The flags' balancer settings in words, for table headers."""
    b = {**BALANCER(), **overrides}
    return (
        f"{b['slots_per_rank']} slots/rank, min_tokens_per_replica="
        f"{b['min_tokens_per_replica']}, eps={b['balance_eps']}"
    )


@functools.cache
def _zipf_matrix(initial: float, ep_size: int, num_experts: int, tokens: int, seed: int):
    return workloads.rank_zipf_loads(ep_size, num_experts, tokens, 8, initial, seed)


def zipf_batch(initial: float, ep_size: int, num_experts: int, seeds) -> np.ndarray:
    """int32 ``[len(seeds), R, E]``: rank-level Zipf at initial imbalance ``initial``, top-8,
    ``--tokens_per_rank`` tokens per rank."""
    return np.stack([_zipf_matrix(initial, ep_size, num_experts, TOKENS.value, s) for s in seeds])


def trace_rows(name: str, ep: int) -> tuple:
    """Every ``(label, loads [R, E])`` of a trace at EP ``ep`` (`traces.trace_rows`: seed 0, the
    trace's top-k) at ``--tokens_per_rank``; FileNotFoundError when its files are not in
    ``--traces_dir``."""
    return traces.trace_rows(name, ep, TOKENS.value, TRACES_DIR.value)


def trace_batch(name: str, ep: int) -> np.ndarray:
    """int32 ``[N, R, E]``: every layer of a trace (`traces.trace_batch`, the rows of
    :func:`trace_rows`)."""
    return traces.trace_batch(name, ep, TOKENS.value, 1, TRACES_DIR.value)


def trace_cases() -> Iterator[tuple[str, int, tuple]]:
    """``(trace, ep_size, rows)`` (see :func:`trace_rows`) of every ``--traces`` pair whose files
    are there; the others are announced as skipped."""
    for name, _, ep in (item.partition(":") for item in TRACES.value):
        try:
            rows = trace_rows(name, int(ep))
        except FileNotFoundError as err:
            print(f"{name} EP{ep} skipped: {err}")
            continue
        yield name, int(ep), rows
