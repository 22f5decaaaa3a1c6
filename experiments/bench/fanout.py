"""Fan-out of the replica weight transfer on the real traces: what the busiest sender sends.

        python -m experiments.bench.fanout                  # every trace, EP size and mode
        python -m experiments.bench.fanout --traces=deepseek-r1 --ep=64 --json_out=/tmp/f.json

Each layer of each trace is turned into a load matrix (`experiments.lab.loads.traces.trace_batch`,
the trace's own top-k, ``--tokens_per_rank`` tokens per rank) and planned by the real planner
(`ultraep_jax.plan`, the FFI custom call, ``--slots_per_rank`` spare slots, at ``--balance_eps``
and in exact mode, ``balance_eps=0``). The plan's replica transfer sends each replica its
expert's weights, from the master's rank (direct) or through relays (`replicas.relay`, each
``--max_fanout`` bound f): the busiest sender's count of expert copies is the layer's figure,
reported as its distribution over layers (median, p90, max), with the largest fan-out of one
expert, the transfer's modelled length (each hop as long as its busiest link, in copies) and its
hops beside it.

Modelled by the step model (`experiments.lab.stepmodel`), stated in the output: one copy is an
expert of the anchor's model (DeepSeek-V3, bf16; `stepmodel.shapes.ANCHOR`) over ``--link_gbps``
per rank and direction; the expert compute beside it is the forward pass of one rank's mean rows
(``tokens_per_rank`` x its top-k) at ``--gpu_tflops``. Qwen1.5-MoE's 60 experts divide no
power of two, so it runs at the EP sizes of ``--qwen_ep``.
"""

from __future__ import annotations

import time

import numpy as np
from absl import flags

import ultraep_jax as uep
from experiments.lab import cli
from experiments.lab.batched import batched_planner
from experiments.lab.loads import ranks, traces
from experiments.lab.output_files import write_json
from experiments.lab.program import run_main
from experiments.lab.stepmodel import calibration, layer, links, shapes
from experiments.lab.summaries import summary

_TRACES = flags.DEFINE_list("traces", list(traces.TRACE_NAMES), "Traces to measure.")
_EP = flags.DEFINE_list("ep", ["32", "64", "128"], "EP sizes (DeepSeek-R1 and Switch).")
_QWEN_EP = flags.DEFINE_list("qwen_ep", ["30", "60"], "EP sizes of Qwen1.5-MoE (60 experts).")
_TOKENS = flags.DEFINE_integer(
    "tokens_per_rank", shapes.ANCHOR.tokens_per_rank, "Tokens per source rank."
)
_BALANCER = cli.define_balancer_flags()
_STRIDE = flags.DEFINE_integer("stride", 1, "Keep every n-th layer of each trace (1: all).")
_FANOUTS = flags.DEFINE_list(
    "max_fanout", ["1", "2", "3"], "Relay bounds f to compare with the direct transfer (f = 0)."
)
_LINK = flags.DEFINE_float(
    "link_gbps",
    shapes.CLUSTERS["hgx-h100"].ib_gbps,
    "Link bandwidth, GB/s per rank and direction.",
)
_TFLOPS = flags.DEFINE_float(
    "gpu_tflops",
    calibration.GPU_GMM_TFLOPS,
    f"Assumed grouped-matmul rate in TFLOP/s ({calibration.GPU_GMM}, docs/gpu.md).",
)
_TRACES_DIR = cli.define_traces_dir()
_JSON = cli.define_json_out()

flags.register_validator("stride", lambda v: v >= 1, "must be >= 1")
flags.register_validator("tokens_per_rank", lambda v: v >= 1, "must be >= 1")
flags.register_validator("link_gbps", lambda v: v > 0, "must be > 0")
flags.register_validator("gpu_tflops", lambda v: v > 0, "must be > 0")
flags.register_validator(
    "traces",
    lambda v: set(v) <= set(traces.TRACE_NAMES),
    f"each must be one of {', '.join(traces.TRACE_NAMES)}",
)
flags.register_validator(
    "max_fanout", lambda v: all(s.isdigit() and int(s) > 0 for s in v), "each must be an int > 0"
)
for _name in ("ep", "qwen_ep"):
    flags.register_validator(
        _name, lambda v: all(s.isdigit() and int(s) > 1 for s in v), "EP sizes must be ints > 1"
    )

#: The expert the copies carry: the anchor's model, w_gate, w_up and w_down at its itemsize.
MODEL = shapes.ANCHOR.shape
COPY_BYTES = MODEL.experts(shapes.ANCHOR.itemsize).expert_bytes()


def max_fanout_of_one_expert(slot_expert_NRS: np.ndarray, num_experts: int) -> np.ndarray:
    """int [N]: the most replicas of one expert, per plan."""
    flat = slot_expert_NRS.reshape(slot_expert_NRS.shape[0], -1)
    return np.stack([np.bincount(s[s >= 0], minlength=num_experts).max() for s in flat])


def masters_replicated(slot_expert_RS: np.ndarray, num_experts: int, ep: int) -> int:
    """The most replicated experts one rank masters (a lower bound on its copies sent)."""
    experts = np.unique(slot_expert_RS[slot_expert_RS >= 0])
    return int(np.bincount(ranks.home_ranks(num_experts, ep)[experts], minlength=ep).max())


def distribution(values) -> dict:
    """median, p90 and max of per-layer values."""
    return summary(values, ("median", "p90", "max"))


def copy_ms(copies: float, link_gbps: float) -> float:
    """Milliseconds to send ``copies`` experts of `MODEL` over one rank's link (one class)."""
    return 1e3 * copies * links.copy_seconds(COPY_BYTES, 2, links.Links.single(link_gbps))


def expert_forward_ms(tokens_per_rank: int, tflops: float) -> float:
    """Milliseconds of one rank's expert forward pass at the mean rows (tokens x top-k)."""
    flops = layer.expert_fwd_flops(tokens_per_rank * MODEL.top_k, MODEL.hidden, MODEL.expert_ffn)
    return 1e3 * layer.compute_seconds(flops, tflops, "prefill")


def measure(name: str, ep: int, eps: float) -> dict:
    """The fan-out figures of one (trace, EP size, balance_eps) cell."""
    batch = traces.trace_batch(name, ep, _TOKENS.value, _STRIDE.value, _TRACES_DIR.value)
    num_experts = batch.shape[-1]
    cfg = uep.BalancerConfig(num_experts, ep, **{**_BALANCER(), "balance_eps": eps})
    plans = batched_planner(cfg)(batch)
    slot_expert = np.asarray(plans.slot_expert)
    schedules = {
        f: links.relay_copies(slot_expert, num_experts, f)
        for f in [0] + [int(v) for v in _FANOUTS.value]
    }
    # Any schedule: each rank sends at least one copy of each of its replicated masters.
    masters = np.stack([masters_replicated(s, num_experts, ep) for s in slot_expert])
    return {
        "trace": name,
        "ep": ep,
        "balance_eps": eps,
        "layers": int(batch.shape[0]),
        "replicas_mean": float(np.asarray(plans.num_replicas).mean()),
        "max_fanout": distribution(max_fanout_of_one_expert(slot_expert, num_experts)),
        "lower_bound_copies": distribution(masters),
        "schedules": {
            str(f): {key: distribution(v) for key, v in r.items()} for f, r in schedules.items()
        },
    }


def _triple(d: dict, scale: float = 1.0, fmt: str = "g") -> str:
    return " / ".join(format(d[k] * scale, fmt) for k in ("median", "p90", "max"))


def direct_table(cells: list[dict], link_gbps: float) -> list[str]:
    """One line per cell, direct transfer: the largest fan-out of one expert, the busiest
    sender's copies and their send time (median / p90 / max over layers)."""
    ms = copy_ms(1, link_gbps)
    lines = [
        f"{'trace':16s} {'EP':>4s} {'eps':>5s} {'layers':>6s} {'replicas':>8s} "
        f"{'fan-out med/p90/max':>20s} {'send copies med/p90/max':>24s} "
        f"{'send ms med/p90/max':>22s}"
    ]
    for c in cells:
        s = c["schedules"]["0"]["send"]
        lines.append(
            f"{c['trace']:16s} {c['ep']:4d} {c['balance_eps']:5g} {c['layers']:6d} "
            f"{c['replicas_mean']:8.1f} {_triple(c['max_fanout']):>20s} {_triple(s):>24s} "
            f"{_triple(s, ms, '.1f'):>22s}"
        )
    return lines


def relay_table(cells: list[dict]) -> list[str]:
    """One line per cell and bound f: the busiest sender's copies, the modelled transfer length
    in copies and the hops (median / p90 / max over layers), and the lower bound."""
    lines = [
        f"{'trace':16s} {'EP':>4s} {'eps':>5s} {'f':>2s} {'send copies':>14s} "
        f"{'length, copies':>15s} {'hops':>11s} {'lower bound':>12s}"
    ]
    for c in cells:
        for f, r in c["schedules"].items():
            lines.append(
                f"{c['trace']:16s} {c['ep']:4d} {c['balance_eps']:5g} {f:>2s} "
                f"{_triple(r['send']):>14s} {_triple(r['length']):>15s} "
                f"{_triple(r['hops']):>11s} {_triple(c['lower_bound_copies']):>12s}"
            )
    return lines


def main(argv):
    """Plans every layer of every trace at every EP size and mode; prints the table."""
    del argv
    start = time.perf_counter()
    eps_values = list(dict.fromkeys([_BALANCER()["balance_eps"], 0.0]))
    cells = []
    for name in _TRACES.value:
        eps_list = _QWEN_EP.value if name == "qwen1.5-moe" else _EP.value
        for ep in dict.fromkeys(int(s) for s in eps_list):
            for eps in eps_values:
                cells.append(measure(name, ep, eps))
                print("\n".join(direct_table(cells[-1:], _LINK.value)[1:]), flush=True)
    fwd = expert_forward_ms(_TOKENS.value, _TFLOPS.value)
    b = _BALANCER()
    print(
        f"\nFan-out of the replica transfer (direct: each master sends every copy), "
        f"{b['slots_per_rank']} slots/rank, min_tokens_per_replica="
        f"{b['min_tokens_per_replica']}, {_TOKENS.value} tokens/rank, the trace's own top-k:"
    )
    print("\n".join(direct_table(cells, _LINK.value)))
    print(
        "\nRelay (f = max_fanout; 0 = direct): the busiest sender's copies, the transfer's "
        "modelled length (each hop as long as its busiest link, sending or receiving, in copies) "
        "and its hops; lower bound = the most replicated experts one rank masters (it sends one "
        "copy of each in any schedule):"
    )
    print("\n".join(relay_table(cells)))
    print(
        f"\nModelled: one copy = an expert of {MODEL.name}, 3 x {MODEL.hidden} x "
        f"{MODEL.expert_ffn} x {shapes.ANCHOR.itemsize} B = {COPY_BYTES / 1e6:.1f} MB, "
        f"{copy_ms(1, _LINK.value):.2f} ms at {_LINK.value:g} GB/s per rank and direction (the "
        f"gradients return the same bytes in backward). Expert forward of one rank at the mean "
        f"rows ({_TOKENS.value} x {MODEL.top_k} = {_TOKENS.value * MODEL.top_k} rows, 3 GEMMs of "
        f"{MODEL.hidden} x {MODEL.expert_ffn}) at {_TFLOPS.value:g} TFLOP/s: {fwd:.2f} ms "
        "(backward 2x that)."
    )
    print(f"({time.perf_counter() - start:.0f} s)")
    write_json(
        _JSON.value,
        {
            "copy_bytes": COPY_BYTES,
            "link_gbps": _LINK.value,
            "gpu_tflops": _TFLOPS.value,
            "expert_forward_ms": fwd,
            "tokens_per_rank": _TOKENS.value,
            "balancer": b,
            "cells": cells,
        },
    )


if __name__ == "__main__":
    run_main(main)
