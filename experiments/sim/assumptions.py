"""The simulator's assumptions, printed before its tables: the model shapes and the traces that
stand in for their routing, the hardware, the calibration, the cost terms and the plans, one
line each."""

from __future__ import annotations

from collections.abc import Mapping

from experiments.lab.loads.traces import TOPK_DRAWS
from experiments.lab.stepmodel.layer import CostParams
from experiments.lab.stepmodel.shapes import CLUSTERS, MODELS, SCENARIOS
from experiments.sim.streams import Sampling


def assumption_lines(params: CostParams, cfg_kwargs: Mapping, sampling: Sampling) -> list[str]:
    """Every assumption of the model, one line each, printed before the table."""
    return [
        "Assumptions",
        "-----------",
        *_model_assumptions(),
        *_hardware_assumptions(),
        *_calibration_assumption(params),
        *_cost_assumptions(params),
        *_plan_assumptions(params, cfg_kwargs, sampling),
    ]


def _model_assumptions() -> list[str]:
    """The model shapes and the traces that stand in for their routing."""
    lines = ["Models (published configs; D = hidden, F = routed expert FFN):"]
    for m in MODELS.values():
        lines.append(
            f"  {m.name:17s} {m.source}: D={m.hidden} F={m.expert_ffn} E={m.num_experts} "
            f"top-{m.top_k}, {m.moe_layers} MoE + {m.dense_layers} dense layers (dense F="
            f"{m.dense_ffn}), {m.shared_experts} shared expert(s), attention {m.attention}, "
            f"vocab {m.vocab}; real trace: {m.trace}"
        )
    lines.append(
        "  GLM/Qwen3 shapes have 128 experts: the 128-expert Switch-Base-128 trace (HarMoEny "
        "datasets CSV, 4 datasets x 30 iterations, encoder layers 0-5 only: its decoder layers "
        "6-11 hold 512 tokens a row, mostly on one expert) stands in for their routing. Switch is "
        f"top-1, so each row becomes top-k shares by letting {TOPK_DRAWS} tokens each draw k "
        "distinct experts with the row's probabilities (Gumbel top-k): no expert exceeds 1/k of "
        "the pairs. Qwen1.5-MoE's 60-expert trace fits no shape. DeepSeek-V3 uses the "
        "DeepSeek-R1 SGLang serving trace (12 runs x 58 MoE layers, top-8 as is; each run sums a "
        "whole serving run, so it is smoother than one training microbatch). Traces count tokens "
        "per expert only: scaled to T*k pairs per rank and split over source ranks at random "
        "(seeded). DP group g, microbatch m reads run g*M+m; model layer l reads trace layer "
        "l*layers/moe_layers."
    )
    return lines


def _hardware_assumptions() -> list[str]:
    """The clusters' nominal rates and the layouts."""
    lines = ["Hardware (nominal, per GPU; sources in experiments/lab/stepmodel/shapes.toml):"]
    for c in CLUSTERS.values():
        lines.append(
            f"  {c.name:12s} {c.gpu}: BF16 dense peak {c.peak_bf16_tflops:g} TFLOPS, NVLink "
            f"{c.nvlink_gbps:g} GB/s per direction in a {c.nvlink_domain}-GPU domain, IB "
            f"{c.ib_gbps:g} GB/s per direction [{c.sources}]"
        )
    lines.append("Layouts:")
    for s in SCENARIOS.values():
        lines.append(f"  {s.name:11s} {s.note}")
    return lines


def _cost_assumptions(params: CostParams) -> list[str]:
    """How compute, links, the all-to-alls, their overlap and a replica's copy are charged."""
    rates = params.calibration
    return [
        (
            f"Compute: every GEMM (experts, attention, dense, LM head) at "
            f"{rates.gemm_efficiency:.0%} of the dense BF16 peak (H100/H200 BF16 GEMMs reach "
            "about 60-70 %); expert FLOPs = rows x 3 GEMMs x 2 x D x F per forward, forward + "
            "backward = 3x forward."
        ),
        (
            f"Links: {rates.link_efficiency:.0%} of nominal per-direction bandwidth (DeepEP's "
            "README measures 153-158 GB/s NVLink on H800 against ~160 GB/s achievable, and 43-58 "
            "GB/s RDMA on 400 Gb/s ConnectX-7). All-to-all rows are spread uniformly over source "
            "ranks: (g-1)/R of them cross NVLink and (R-g)/R cross IB (g = GPUs of the EP group "
            "per NVLink domain), both concurrently; bf16 activations, no FP8 dispatch, no token "
            "dedup per node, no node-limited routing."
        ),
        (
            "All-to-all: 4 per layer and microbatch (dispatch + combine, forward + backward), each "
            "timed by the busiest rank, which receives (and later sends back) max(rank load) rows; "
            "every source sends T*k rows."
        ),
        (
            "Overlap: none between all-to-all and GEMMs (serial layer: attention -> router -> load "
            "all-gather -> planner -> dispatch -> experts -> combine; the conservative choice, as "
            "a2a/compute overlap would need DualPipe-style scheduling). The planner and the load "
            "all-gather are on the critical path (forward only; backward reuses the plan). Replica "
            "weights cannot move before the plan, which needs this layer's router output, so they "
            "cannot hide behind this layer's attention: they run beside the forward dispatch (the "
            "hot master sends weights on its send side while it receives tokens) and only the part "
            "longer than the dispatch is exposed; replica gradients return beside the backward "
            "all-to-all that carries the dispatch's transpose, likewise. Every replica is moved "
            "in every layer and microbatch (no caching across microbatches)."
        ),
        (
            f"Replica = 3 x D x F x {params.weight_bytes} bytes (bf16), gradient return the same "
            "bytes by the reverse hops. Charged from the largest per-link bytes: the copies each "
            "layout moves (its instances off their home rank) are scheduled by the library's "
            "relay schedule (ultraep_jax.replicas.relay, ffi/TRANSFER.md) with max_fanout = "
            f"{params.relay_fanout} (relay) or 0 (direct: every copy from its home rank in one "
            "hop); each hop lasts as long as the most copies one rank sends or receives in it, "
            "times one copy's time to a uniformly random other rank of the group (expected "
            "NVLink/IB time), and the hops run one after another (a relay forwards a copy only "
            "once it has all of it; no chunk pipelining, no per-hop latency)."
        ),
    ]


def _plan_assumptions(params: CostParams, cfg_kwargs: Mapping, sampling: Sampling) -> list[str]:
    """The balancers' configs and planners, the sampled sizes and the ideal."""
    return [
        (
            f"Balancer config: {dict(cfg_kwargs)}; none = masters only; ultraep = "
            "ultraep_jax.plan on the exact load of every layer and microbatch, its time per plan "
            "CPU-measured on this machine (one jit(vmap(plan)) batch, median, per plan) -- "
            "UltraEP's GPU kernel takes 0.067-0.078 ms per layer. eplb_exact / eplb_plus "
            "(experiments.lab.loads.baselines, NumPy) also plan on the exact load, so their "
            "CPU-measured wall time per call is on the critical path too; every expert keeps a "
            "home rank (its optimizer state), and each rank a layout puts it on elsewhere gets one "
            "weight copy plus one gradient return per layer and microbatch, a second instance on "
            "the same rank none (experiments.lab.loads.policies.weight_copies; eplb_exact's full "
            "re-layout: all off-home instances; eplb_plus: its replicas). eplb_periodic plans off "
            f"the critical path on the {sampling.history} earlier load matrices of the same layer "
            "(trace: other iterations / serving runs; generated Zipf: other seeds, i.e. popularity "
            "that jumps) and keeps that layout; SGLang re-plans every 1000 iterations "
            "(eplb_rebalance_num_iterations), so its re-layout moves are amortised to ~0 and its "
            "persistent replicas sync gradients once per step with the DP all-reduce (hidden)."
        ),
        (
            f"Sizes: {params.tokens_per_rank} tokens per rank per microbatch (sequences of "
            f"{params.seq_len}), {sampling.microbatches} microbatches per step sampled, "
            f"{sampling.layers_sampled} MoE layers sampled evenly per model (time scaled to all "
            f"layers), {sampling.dp_groups} DP groups sampled where DP > 1 (the step waits for "
            "the slowest group; the full 10-40 groups would straggle more), generated Zipf drawn "
            f"from a pool of {sampling.zipf_pool} seeded matrices. No pipeline bubbles (PP splits "
            "layers but leaves each layer's time unchanged); the DP gradient all-reduce is the "
            "same for every balancer and assumed hidden behind backward."
        ),
        (
            "Force-balanced ideal: every rank at the mean load T*k, no transfer, no planner. "
            "Throughput vs ideal = ideal step / step; speedup = none step / step; final imbalance "
            "= mean over sampled layers of max/mean rank load; peak receive-buffer rows = largest "
            "per-rank load seen (activation memory of the dispatch buffer)."
        ),
    ]


def _calibration_assumption(params: CostParams) -> list[str]:
    """The assumption line of a calibrated run (none without a calibration)."""
    cost = params.expert_cost
    if cost is None:
        return []
    return [
        f"Experts (calibrated): measured by the per-rank replay on {cost.device} at "
        f"D={cost.d_model} F={cost.d_ff}, {cost.pairs_per_rank} rows per rank: "
        f"{1e3 * cost.fixed_s:.3f} ms fixed + {1e6 * cost.per_row_s:.3f} us per row + "
        f"{1e6 * cost.per_group_s:.3f} us per non-empty group, forward + backward, the busiest "
        "rank's by these; scaled to each model by FLOPs per row (and the fixed buffer work by "
        "the buffer's rows), which is modelled. The FLOP model below then applies to every "
        "other GEMM only."
    ]
