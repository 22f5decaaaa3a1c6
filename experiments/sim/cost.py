"""The step-time cost model of the simulator (pure functions of shapes and per-rank rows).

Per MoE layer and microbatch (forward + backward):

    t = t_other                 attention + router + shared expert (same for every balancer)
      + t_plan                  load all-gather + planner (critical path, forward only)
      + 4 * t_a2a(max load)     dispatch + combine, forward + backward
      + t_experts(max load)     3 SwiGLU GEMMs, forward + backward = 3x forward FLOPs; or, with a
                                calibration from the per-rank replay (`ExpertCost`), the
                                busiest rank's measured fixed + per-row + per-group cost
      + 2 * max(0, t_xfer - t_a2a)   replica weights (fwd) / gradients (bwd) beyond what the
                                     dispatch all-to-all of that pass hides; t_xfer from the
                                     largest per-link bytes of each relay hop
                                     (`transfer_copy_times`)
  step(group) = sum over microbatches of (sum over MoE layers of t + dense layers + LM head)
  step = max over DP groups (they meet at the gradient all-reduce)

The force-balanced ideal puts every rank at the mean load with no transfer and no planner.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from experiments import common
from experiments.loads.ranks import held_off_home
from experiments.sim.shapes import Cluster, ModelShape


@dataclasses.dataclass(frozen=True)
class ExpertCost:
    """One rank's expert compute (forward + backward) as measured by the per-rank replay
    (``python -m experiments.replay --calibration_out``): ``fixed + per_row * rows +
    per_group * groups`` seconds at the replay's shape, fitted over every rank it timed.

    Attributes:
      fixed_s, per_row_s, per_group_s: the fitted seconds (training mode).
      d_model, d_ff: the replay's D and F.
      pairs_per_rank: the mean rows per rank the replay ran (the buffer it allocated follows them).
      device: what the replay ran on.
      provenance: machine, commit, command and date of the replay.
      measured: the replay's own ultraep figures (one dict per workload, EP size and mode).
    """

    fixed_s: float
    per_row_s: float
    per_group_s: float
    d_model: int
    d_ff: int
    pairs_per_rank: int
    device: str
    provenance: dict
    measured: tuple

    @classmethod
    def read(cls, path) -> ExpertCost:
        """The training-mode costs of a replay calibration file (ValueError naming the file if it
        has none, or a negative cost: a cost model has no term that pays back time)."""
        with open(path) as f:
            data = json.load(f)
        if "train" not in data:
            raise ValueError(f"{path}: no training-mode costs (run the replay with --mode=train)")
        fit, shape = data["train"], data["shape"]
        for key in ("seconds_fixed", "seconds_per_row", "seconds_per_group"):
            if fit[key] < 0:
                raise ValueError(f"{path}: train {key}={fit[key]} is negative (refit it)")
        return cls(
            fixed_s=fit["seconds_fixed"],
            per_row_s=fit["seconds_per_row"],
            per_group_s=fit["seconds_per_group"],
            d_model=shape["d_model"],
            d_ff=shape["d_ff"],
            pairs_per_rank=fit["pairs_per_rank"],
            device=data["provenance"]["device"],
            provenance=data["provenance"],
            measured=tuple(data.get("measured", ())),
        )

    def seconds(self, rows, groups, hidden: int, ffn: int, mean_rows: int) -> np.ndarray:
        """Expert seconds of ranks with ``rows`` rows in ``groups`` non-empty groups (arrays) for
        experts of width ``hidden`` x ``ffn`` at ``mean_rows`` rows per rank on average: the
        per-row and per-group terms scaled by FLOPs per row (``hidden * ffn`` against the
        replay's), the fixed term (the replay's buffer work) by that and by the buffer's rows."""
        width = hidden * ffn / (self.d_model * self.d_ff)
        buffer = mean_rows / self.pairs_per_rank
        rows, groups = np.asarray(rows, np.float64), np.asarray(groups, np.float64)
        return width * (self.fixed_s * buffer + self.per_row_s * rows + self.per_group_s * groups)


@dataclasses.dataclass(frozen=True)
class CostParams:
    """Cost-model knobs shared by every term (the first five are also flags of ``python -m
    experiments.sim``).

    Attributes:
      tokens_per_rank: tokens per rank per microbatch.
      seq_len: sequence length (attention core FLOPs).
      gemm_efficiency: fraction of the BF16 dense peak the GEMMs reach.
      link_efficiency: fraction of the nominal link bandwidth the transfers reach.
      relay_fanout: the relay tree's fan-out cap of the replica transfer.
      act_bytes: bytes per activation in dispatch and combine (bf16).
      weight_bytes: bytes per expert weight and replica gradient (bf16).
      expert_cost: a replay calibration of the experts' compute, or None for their FLOP model.
    """

    tokens_per_rank: int = 8192
    seq_len: int = 4096
    gemm_efficiency: float = 0.65
    link_efficiency: float = 0.8
    relay_fanout: int = 2
    act_bytes: int = 2
    weight_bytes: int = 2
    expert_cost: ExpertCost | None = None


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


def transfer_copy_times(layouts, num_experts: int, fanout: int | None) -> np.ndarray:
    """Replica transfer time of each layout ``[N, R, C]`` in units of one copy's time, from the
    largest per-link bytes: the schedule of its off-home instances (`ultraep_jax.relay`, with
    ``max_fanout = fanout``; None: direct, every copy from its home rank in one hop), each hop as
    long as the most copies one rank sends or receives in it, the hops one after another.
    Returns float [N]."""
    held = held_off_home(layouts, num_experts)
    ranks = held.shape[1]
    fn = common.batched_transfer(ranks, num_experts // ranks, 0 if fanout is None else fanout)
    _, length, _ = fn(held)
    return np.asarray(length, np.float64)


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
    expert_s: float | None = None,
) -> LayerTime:
    """Time of one MoE layer and microbatch from the busiest rank's rows.

    Args:
      max_rank_load: rows the busiest rank processes (receives, computes, sends back).
      expert_s: the busiest rank's expert seconds when the caller has them (a calibration,
        `rank_expert_seconds`); None: the FLOP model on ``max_rank_load`` rows.
      copy_times: replica transfer time in copies (``transfer_copy_times``); the gradient return
        in backward takes the same time (the reverse hops).
      plan_seconds: planner time on the critical path (0: no planner in the step); the load
        all-gather is added when it is positive.
    """
    tokens = params.tokens_per_rank
    other = train_seconds(
        other_fwd_flops_per_moe_layer(model, tokens, params.seq_len), cluster, params
    )
    rows = max(float(max_rank_load), float(tokens * model.top_k))  # every source sends T*k rows
    one_a2a = a2a_seconds(rows, ep, model.hidden, cluster, params)
    experts = expert_s
    if experts is None:
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


def rank_expert_seconds(rows, groups, model: ModelShape, params: CostParams) -> float | None:
    """The busiest rank's calibrated expert seconds, for ranks with ``rows`` rows in ``groups``
    non-empty local groups (arrays [R]); None without a calibration."""
    cost = params.expert_cost
    if cost is None:
        return None
    mean = params.tokens_per_rank * model.top_k
    return float(np.max(cost.seconds(rows, groups, model.hidden, model.expert_ffn, mean)))


def ideal_layer_time(model: ModelShape, ep: int, cluster: Cluster, params: CostParams) -> LayerTime:
    """Force-balanced ideal layer: every rank at the mean load ``T * k`` in its ``E / R`` master
    groups, no transfer, no planner."""
    mean = params.tokens_per_rank * model.top_k
    expert_s = rank_expert_seconds([mean], [model.num_experts // ep], model, params)
    return layer_time(mean, 0.0, 0.0, model, ep, cluster, params, expert_s)


def ideal_step_seconds(
    model: ModelShape, ep: int, cluster: Cluster, params: CostParams, microbatches: int
) -> float:
    """Force-balanced ideal step (`ideal_layer_time` in every MoE layer and microbatch)."""
    per_layer = ideal_layer_time(model, ep, cluster, params).total
    return microbatches * (model.moe_layers * per_layer + fixed_seconds(model, cluster, params))
