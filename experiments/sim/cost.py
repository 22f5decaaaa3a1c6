"""The step-time cost model of the simulator (pure functions of shapes and per-rank rows).

Per MoE layer and microbatch (forward + backward):

    t = t_other                 attention + router + shared expert (same for every balancer)
      + t_plan                  load all-gather + planner (critical path, forward only)
      + 4 * t_a2a(max load)     dispatch + combine, forward + backward
      + t_experts(max load)     3 SwiGLU GEMMs, forward + backward = 3x forward FLOPs
      + 2 * max(0, t_xfer - t_a2a)   replica weights (fwd) / gradients (bwd) beyond what the
                                     dispatch all-to-all of that pass hides
  step(group) = sum over microbatches of (sum over MoE layers of t + dense layers + LM head)
  step = max over DP groups (they meet at the gradient all-reduce)

The force-balanced ideal puts every rank at the mean load with no transfer and no planner.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments.sim.shapes import Cluster, ModelShape


@dataclasses.dataclass(frozen=True)
class CostParams:
    """Cost-model knobs shared by every term."""

    tokens_per_rank: int = 8192
    seq_len: int = 4096
    gemm_efficiency: float = 0.65
    link_efficiency: float = 0.8
    relay_fanout: int = 2
    act_bytes: int = 2  # bf16 activations in dispatch and combine
    weight_bytes: int = 2  # bf16 expert weights and replica gradients


def expert_fwd_flops(rows: float, hidden: int, ffn: int) -> float:
    """Forward FLOPs of SwiGLU experts on ``rows`` (token, choice) rows: 3 GEMMs x 2 x D x F."""
    return float(rows) * 3 * 2 * hidden * ffn


def train_seconds(fwd_flops: float, cluster: Cluster, params: CostParams) -> float:
    """Forward + backward time (3x forward FLOPs) at ``gemm_efficiency`` of the BF16 peak."""
    return 3.0 * fwd_flops / (cluster.peak_bf16_tflops * 1e12 * params.gemm_efficiency)


def attention_fwd_flops_per_token(model: ModelShape, seq_len: int) -> float:
    """Forward FLOPs per token of one attention block (projections + causal core)."""
    d = model.hidden
    if model.attention[0] == "gqa":
        _, heads, kv_heads, head_dim = model.attention
        proj = d * heads * head_dim * 2 + 2 * d * kv_heads * head_dim
        core = 2 * seq_len * heads * head_dim  # QK^T and PV over seq/2 keys on average (causal)
    else:
        _, heads, q_lora, kv_lora, nope, rope, v_dim = model.attention
        proj = (
            d * q_lora
            + q_lora * heads * (nope + rope)
            + d * (kv_lora + rope)
            + kv_lora * heads * (nope + v_dim)
            + heads * v_dim * d
        )
        core = seq_len * heads * (nope + rope + v_dim)
    return 2.0 * proj + core


def other_fwd_flops_per_moe_layer(model: ModelShape, tokens: int, seq_len: int) -> float:
    """Forward FLOPs per rank of a MoE layer's non-routed part (attention, router, shared)."""
    per_token = attention_fwd_flops_per_token(model, seq_len)
    per_token += 2.0 * model.hidden * model.num_experts
    per_token += model.shared_experts * expert_fwd_flops(1, model.hidden, model.shared_ffn)
    return tokens * per_token


def fixed_fwd_flops_per_microbatch(model: ModelShape, tokens: int, seq_len: int) -> float:
    """Forward FLOPs per rank per microbatch outside the MoE layers: dense layers and LM head."""
    dense = model.dense_layers * (
        attention_fwd_flops_per_token(model, seq_len)
        + expert_fwd_flops(1, model.hidden, model.dense_ffn)
    )
    return tokens * (dense + 2.0 * model.hidden * model.vocab)


def link_fractions(ep: int, domain: int) -> tuple[float, float]:
    """Fractions of a rank's all-to-all rows that cross NVLink and InfiniBand.

    Sources (or destinations) are uniform over the ``ep`` ranks of the group, which is laid out
    NVLink-domain-contiguously: ``min(domain, ep) - 1`` peers are on NVLink, ``ep - min(domain,
    ep)`` across InfiniBand, and ``1 / ep`` of the rows stay on the rank.
    """
    g = min(domain, ep)
    return (g - 1) / ep, (ep - g) / ep


def _link_seconds(nbytes: float, ep: int, cluster: Cluster, params: CostParams) -> float:
    """Time for a rank to move ``nbytes`` spread uniformly over the ``ep`` ranks of its group:
    the NVLink and InfiniBand parts proceed concurrently, each at ``link_efficiency`` of its
    nominal per-direction bandwidth."""
    intra, inter = link_fractions(ep, cluster.nvlink_domain)
    eff = params.link_efficiency * 1e9
    return max(
        nbytes * intra / (cluster.nvlink_gbps * eff), nbytes * inter / (cluster.ib_gbps * eff)
    )


def a2a_seconds(rows: float, ep: int, hidden: int, cluster: Cluster, params: CostParams) -> float:
    """One all-to-all in which the busiest rank moves ``rows`` rows of ``hidden`` activations."""
    return _link_seconds(float(rows) * hidden * params.act_bytes, ep, cluster, params)


def replica_bytes(model: ModelShape, params: CostParams) -> float:
    """Bytes of one replica's weights (w_gate, w_up, w_down): 3 x D x F x 2."""
    return 3.0 * model.hidden * model.expert_ffn * params.weight_bytes


def copy_seconds(nbytes: float, ep: int, cluster: Cluster, params: CostParams) -> float:
    """Expected time to send one replica to a uniformly random other rank of the group."""
    if ep <= 1:
        return 0.0
    g = min(cluster.nvlink_domain, ep)
    p_nvl, p_ib = (g - 1) / (ep - 1), (ep - g) / (ep - 1)
    eff = params.link_efficiency * 1e9
    return nbytes * (p_nvl / (cluster.nvlink_gbps * eff) + p_ib / (cluster.ib_gbps * eff))


def relay_schedule(copies: int, fanout: int) -> list[int]:
    """Copies the busiest sender sends in each stage of a relay tree for one expert.

    Stage 1: the master sends to ``min(copies, fanout)`` replicas. In every later stage each rank
    that already holds the weights (master and replicas) sends at most ``fanout`` more, and the
    copies still missing are spread evenly over the holders.
    """
    if fanout < 1:
        raise ValueError(f"fanout must be >= 1, got {fanout}")
    holders, left, stages = 1, int(copies), []
    while left > 0:
        sent = min(left, holders * fanout)
        stages.append(min(fanout, -(-sent // holders)))
        holders += sent
        left -= sent
    return stages


def transfer_copy_times(copies, copies_in, fanout: int | None) -> float:
    """Replica transfer time in units of one copy's time, for the busiest rank.

    Args:
      copies: int [E], weight copies of each expert sent this layer (masters on rank e // E_m).
      copies_in: int [R], copies each rank receives.
      fanout: None for direct (each master sends every copy itself), else the relay fan-out cap.
        With relay, a master sends the first stage of each of its experts back to back, and the
        later stages (sent by replica holders, assumed on distinct ranks) follow the master's
        first stages.

    Returns:
      max over ranks of copies sent (direct) or of the relay critical path, and of copies received.
    """
    copies = np.asarray(copies, dtype=np.int64)
    copies_in = np.asarray(copies_in, dtype=np.int64)
    if copies.sum() == 0:
        return 0.0
    per_master = copies.reshape(copies_in.shape[0], -1)
    recv = float(copies_in.max())
    if fanout is None:
        return max(float(per_master.sum(axis=1).max()), recv)
    worst = 0.0
    for row in per_master:
        scheds = [relay_schedule(int(n), fanout) for n in row if n > 0]
        if scheds:
            first = sum(s[0] for s in scheds)
            rest = max(sum(s[1:]) for s in scheds)
            worst = max(worst, float(first + rest))
    return max(worst, recv)


def gather_seconds(ep: int, num_experts: int, cluster: Cluster, params: CostParams) -> float:
    """All-gather of the int32 load matrix ``[R, E]`` before planning (each rank receives it)."""
    return _link_seconds(float(ep) * num_experts * 4, ep, cluster, params)


@dataclasses.dataclass(frozen=True)
class LayerTime:
    """Seconds of one MoE layer and microbatch (forward + backward), by term."""

    other: float
    plan: float
    a2a: float
    experts: float
    transfer_exposed: float

    @property
    def total(self) -> float:
        """Seconds of all the terms together."""
        return self.other + self.plan + self.a2a + self.experts + self.transfer_exposed


def layer_time(
    max_rank_load: float,
    copy_times: float,
    plan_seconds: float,
    model: ModelShape,
    ep: int,
    cluster: Cluster,
    params: CostParams,
) -> LayerTime:
    """Time of one MoE layer and microbatch from the busiest rank's rows.

    Args:
      max_rank_load: rows the busiest rank processes (receives, computes, sends back).
      copy_times: replica transfer time in copies (``transfer_copy_times``); the gradient return
        in backward takes the same time (reverse tree).
      plan_seconds: planner time on the critical path (0: no planner in the step); the load
        all-gather is added when it is positive.
    """
    tokens = params.tokens_per_rank
    other = train_seconds(
        other_fwd_flops_per_moe_layer(model, tokens, params.seq_len), cluster, params
    )
    rows = max(float(max_rank_load), float(tokens * model.top_k))  # every source sends T*k rows
    one_a2a = a2a_seconds(rows, ep, model.hidden, cluster, params)
    experts = train_seconds(
        expert_fwd_flops(max_rank_load, model.hidden, model.expert_ffn), cluster, params
    )
    xfer = copy_times * copy_seconds(replica_bytes(model, params), ep, cluster, params)
    plan = (
        plan_seconds + gather_seconds(ep, model.num_experts, cluster, params)
        if plan_seconds > 0
        else 0.0
    )
    return LayerTime(
        other=other,
        plan=plan,
        a2a=4.0 * one_a2a,
        experts=experts,
        transfer_exposed=2.0 * max(0.0, xfer - one_a2a),
    )


def fixed_seconds(model: ModelShape, cluster: Cluster, params: CostParams) -> float:
    """Per-microbatch time outside the MoE layers (dense layers, LM head); same for everyone."""
    flops = fixed_fwd_flops_per_microbatch(model, params.tokens_per_rank, params.seq_len)
    return train_seconds(flops, cluster, params)


def ideal_step_seconds(
    model: ModelShape, ep: int, cluster: Cluster, params: CostParams, microbatches: int
) -> float:
    """Force-balanced ideal: every rank at the mean load ``T * k``, no transfer, no planner."""
    mean = params.tokens_per_rank * model.top_k
    per_layer = layer_time(mean, 0.0, 0.0, model, ep, cluster, params).total
    return microbatches * (model.moe_layers * per_layer + fixed_seconds(model, cluster, params))
