"""The step model: one MoE layer's time from its terms, with one overlap rule.

Per MoE layer and microbatch (``mode`` "train": forward + backward; "prefill": forward):

    t = t_other                 attention + router + shared expert (same for every balancer)
      + t_plan                  load all-gather + planner (critical path, forward only)
      + t_launch                kernel-launch latency (`Calibration.launch_s`)
      + A * t_a2a               the token all-to-alls: dispatch + combine (A = 2), and their
                                transposes in training (A = 4); t_a2a from the busiest rank's
                                bytes per link class (`experiments.lab.stepmodel.links`)
      + t_experts               the busiest rank's SwiGLU experts: their FLOPs (3 GEMMs; backward
                                2x forward) at the experts' rate, or the replay's measured fixed +
                                per-row + per-group cost (`Calibration`)
      + M * max(0, t_xfer - t_a2a)   the overlap rule: the replica weights (forward) and their
                                gradients (backward; M = 2 in training, 1 in prefill) depend only
                                on the plan and the weights, so each runs beside the token
                                all-to-all of its pass and only what outlasts it is exposed;
                                t_xfer from the relay schedule's largest per-link copies
  step(group) = sum over microbatches of (sum over MoE layers of t + dense layers + LM head)
  step = max over DP groups (they meet at the gradient all-reduce)   (`group_step_seconds`)

`layer_terms` is the rule; `layer_time` charges a target shape's layer from the busiest rank's
rows (the simulator), and `experiments.replay` charges the same rule with its measured terms.
The force-balanced ideal puts every rank at the mean load with no transfer and no planner.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments.lab.stepmodel import links as links_
from experiments.lab.stepmodel.calibration import GPU_GMM_TILE_ROWS, Calibration
from experiments.lab.stepmodel.shapes import ANCHOR, Cluster, ModelShape

#: Passes over the experts' FLOPs: forward (1) and, in training, backward (2 more).
PASSES = {"train": 3, "prefill": 1}
#: Token all-to-alls per layer (dispatch and combine, and their transposes in training) and the
#: directions the replica weights move (forward copies; their gradients back in training).
EXCHANGES = {"train": (4, 2), "prefill": (2, 1)}


@dataclasses.dataclass(frozen=True)
class CostParams:
    """The workload and layout knobs of the step model (the first three are also flags of
    ``python -m experiments.sim``); the rates are in ``calibration``.

    Attributes:
      tokens_per_rank: tokens per rank per microbatch.
      seq_len: sequence length (attention core FLOPs).
      relay_fanout: the relay tree's fan-out cap of the replica transfer.
      act_bytes: bytes per activation in dispatch and combine (bf16).
      weight_bytes: bytes per expert weight and replica gradient (bf16).
      calibration: the model's rates (`Calibration`).
    """

    tokens_per_rank: int = ANCHOR.tokens_per_rank
    seq_len: int = 4096
    relay_fanout: int = 2
    act_bytes: int = ANCHOR.itemsize
    weight_bytes: int = ANCHOR.itemsize
    calibration: Calibration = Calibration()

    @property
    def expert_cost(self):
        """The calibration's measured expert costs (None: the FLOP model)."""
        return self.calibration.expert_cost


def expert_fwd_flops(rows: float, hidden: int, ffn: int) -> float:
    """Forward FLOPs of SwiGLU experts on ``rows`` (token, choice) rows: 3 GEMMs x 2 x D x F."""
    return float(rows) * 3 * 2 * hidden * ffn


def compute_seconds(fwd_flops: float, tflops: float, mode: str) -> float:
    """Seconds of ``fwd_flops`` forward FLOPs in ``mode`` (`PASSES`) at ``tflops`` TFLOP/s."""
    return PASSES[mode] * fwd_flops / (tflops * 1e12)


def tiled_expert_seconds(rows_G, model: ModelShape, tflops: float) -> float:
    """Forward + backward seconds of one rank's groups of ``rows_G`` rows (float [G]; empty ones
    cost nothing) at ``tflops``, each group's last tile padded to `GPU_GMM_TILE_ROWS` rows (a GPU
    grouped matmul's)."""
    tile = GPU_GMM_TILE_ROWS
    rows = np.asarray(rows_G, np.float64)
    padded = float(np.sum(np.ceil(rows / tile) * tile))
    return compute_seconds(
        expert_fwd_flops(padded, model.hidden, model.expert_ffn), tflops, "train"
    )


def train_seconds(fwd_flops: float, cluster: Cluster, params: CostParams) -> float:
    """Forward + backward time (3x forward FLOPs) at ``gemm_efficiency`` of the BF16 peak."""
    return compute_seconds(fwd_flops, params.calibration.gemm_tflops(cluster), "train")


def expert_train_seconds(rows: float, model: ModelShape, cluster: Cluster, params) -> float:
    """Forward + backward time of ``rows`` rows through ``model``'s experts at the experts'
    rate (`Calibration.expert_tflops`, else the GEMMs' rate)."""
    cal = params.calibration
    tflops = cal.expert_tflops or cal.gemm_tflops(cluster)
    return compute_seconds(expert_fwd_flops(rows, model.hidden, model.expert_ffn), tflops, "train")


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


def a2a_seconds(rows: float, ep: int, hidden: int, cluster: Cluster, params: CostParams) -> float:
    """One all-to-all in which the busiest rank moves ``rows`` rows of ``hidden`` activations
    uniformly over its group."""
    links = params.calibration.links(cluster)
    return links_.uniform_seconds(float(rows) * hidden * params.act_bytes, ep, links)


def replica_bytes(model: ModelShape, params: CostParams) -> float:
    """Bytes of one replica's weights (w_gate, w_up, w_down). Under expert tensor parallelism
    (`uep.ExpertParallel(tensor_axis=...)`, F split over t devices) each tensor rank sends only
    its F / t slice, over its own links: the bytes per link fall by t (model such a run with
    ``expert_ffn`` / t)."""
    return float(model.experts(params.weight_bytes).expert_bytes())


def copy_seconds(nbytes: float, ep: int, cluster: Cluster, params: CostParams) -> float:
    """Expected time to send one replica to a uniformly random other rank of the group."""
    return links_.copy_seconds(nbytes, ep, params.calibration.links(cluster))


def gather_seconds(ep: int, num_experts: int, cluster: Cluster, params: CostParams) -> float:
    """All-gather of the int32 load matrix ``[R, E]`` before planning (each rank receives it)."""
    return links_.gather_seconds(ep, num_experts, params.calibration.links(cluster))


@dataclasses.dataclass(frozen=True)
class LayerTime:
    """Seconds of one MoE layer and microbatch (forward + backward), by term."""

    other: float
    plan: float
    a2a: float
    experts: float
    transfer_exposed: float
    transfer: float = 0.0  # the whole replica transfer, both directions; only its exposed part
    launch: float = 0.0  # counts in total

    @property
    def total(self) -> float:
        """Seconds of all the terms together (the transfer's exposed part only)."""
        exposed = self.a2a + self.experts + self.transfer_exposed
        return self.other + self.plan + self.launch + exposed


def layer_terms(
    experts_s: float,
    one_a2a_s: float,
    one_transfer_s: float,
    mode: str,
    *,
    other_s: float = 0.0,
    plan_s: float = 0.0,
    launch_s: float = 0.0,
) -> LayerTime:
    """The one overlap rule (module docstring): ``EXCHANGES[mode]`` token all-to-alls of
    ``one_a2a_s`` each in series with the experts, and the replica transfer (``one_transfer_s``
    a direction) beside the all-to-all of its pass, exposed by what outlasts it."""
    a2as, moves = EXCHANGES[mode]
    return LayerTime(
        other=other_s,
        plan=plan_s,
        a2a=a2as * one_a2a_s,
        experts=experts_s,
        transfer_exposed=moves * max(0.0, one_transfer_s - one_a2a_s),
        transfer=moves * one_transfer_s,
        launch=launch_s,
    )


def layer_time(
    max_rank_load: float,
    copy_times: float,
    plan_seconds: float,
    model: ModelShape,
    ep: int,
    cluster: Cluster,
    params: CostParams,
    expert_s: float | None = None,
    transfer_s: float | None = None,
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
      transfer_s: one direction of the replica transfer in seconds when the caller times it per
        link class (`links.relay_seconds`); None: ``copy_times`` copies at one copy's expected
        time to a random rank of the group (`copy_seconds`).
    """
    tokens = params.tokens_per_rank
    other = train_seconds(
        other_fwd_flops_per_moe_layer(model, tokens, params.seq_len), cluster, params
    )
    rows = max(float(max_rank_load), float(tokens * model.top_k))  # every source sends T*k rows
    one_a2a = a2a_seconds(rows, ep, model.hidden, cluster, params)
    experts = expert_s
    if experts is None:
        experts = expert_train_seconds(max_rank_load, model, cluster, params)
    xfer = transfer_s
    if xfer is None:
        xfer = copy_times * copy_seconds(replica_bytes(model, params), ep, cluster, params)
    plan = (
        plan_seconds + gather_seconds(ep, model.num_experts, cluster, params)
        if plan_seconds > 0
        else 0.0
    )
    launch = params.calibration.launch_s
    return layer_terms(experts, one_a2a, xfer, "train", other_s=other, plan_s=plan, launch_s=launch)


def fixed_seconds(model: ModelShape, cluster: Cluster, params: CostParams) -> float:
    """Per-microbatch time outside the MoE layers (dense layers, LM head); same for everyone."""
    flops = fixed_fwd_flops_per_microbatch(model, params.tokens_per_rank, params.seq_len)
    return train_seconds(flops, cluster, params)


def group_step_seconds(
    moe_s: float, sampled_layers: int, model: ModelShape, fixed_s: float, microbatches: int
) -> float:
    """One DP group's step: ``moe_s``, the seconds of its ``sampled_layers`` sampled MoE layers
    summed over its ``microbatches``, scaled to the model's ``moe_layers``, plus the dense layers
    and LM head (``fixed_s``, `fixed_seconds`) in every microbatch. The step is the max of this
    over the DP groups (they meet at the gradient all-reduce)."""
    return model.moe_layers / sampled_layers * moe_s + microbatches * fixed_s


def rank_expert_seconds(rows, groups, model: ModelShape, params: CostParams) -> float | None:
    """The busiest rank's calibrated expert seconds, for ranks with ``rows`` rows in ``groups``
    non-empty local groups (arrays [R]); None without a calibration."""
    cost = params.calibration.expert_cost
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
    fixed = fixed_seconds(model, cluster, params)
    return group_step_seconds(microbatches * per_layer, 1, model, fixed, microbatches)
