"""The replay's layer at a real model's ratios of transfer to compute (``--transfer_model``).

The replay times the experts at a small shape (D=128, F=64 on a CPU), where an expert's weights
are 98 KB against 88 MB for a bf16 DeepSeek-V3 expert: its exchanges, modelled at the replayed
shape's bytes, are a far smaller share of the step than on real hardware. This mode charges one
layer as the target model would run it on a stated GPU:

- Measured: each policy's busiest rank's expert time relative to the force-balanced ideal's, at
  the replayed shape (`experiments.replay.timing.time_ranks`).
- Modelled: the ideal's expert time at the target shape on the GPU (its FLOPs at the stated
  TFLOP/s), which each policy's measured ratio scales (the busiest rank's measured expert time
  scaled by the FLOP ratio to the target shape and by the GPU's rate); the token all-to-alls
  from each rank's exact rows at the target's row bytes (the replayed matrix's rows scaled to the
  target's pairs per rank); the replica weights at the target's expert bytes, moved along the
  library's relay schedule (`replicas.relay`: each hop as long as its busiest link, sending or
  receiving, hops one after another), and in training their gradients back the same way.
- Overlap: the replica transfer depends only on the plan and the weights, so it runs beside the
  token all-to-all of its pass (the dispatch in the forward pass, its transpose in the backward
  pass); what outlasts that all-to-all is exposed. Not charged: the planner and the dispatch
  bookkeeping (measured on the host at the replayed shape, not scaled), attention and the other
  layers.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments.lab.stepmodel import layer, links, shapes


@dataclasses.dataclass(frozen=True)
class TargetLayer:
    """The target's expert layer and GPU the replayed layer is charged at.

    Attributes:
      name: the target shape's name.
      d_model, d_ff: D and F of each expert (SwiGLU: w_gate, w_up [D, F], w_down [F, D]).
      itemsize: bytes per weight and activation element (2: bf16).
      pairs_per_rank: {mode: (token, choice) pairs per rank} at the target.
      gpu: the stated GPU, in words.
      gpu_tflops: the grouped matmul's rate on it, TFLOP/s (forward and backward alike).
      link_gbps: GB/s per rank and direction.
    """

    name: str
    d_model: int
    d_ff: int
    itemsize: int
    pairs_per_rank: dict
    gpu: str
    gpu_tflops: float
    link_gbps: float

    def __post_init__(self):
        for field in ("d_model", "d_ff", "itemsize"):
            if getattr(self, field) < 1:
                raise ValueError(f"TargetLayer.{field}={getattr(self, field)} must be >= 1")
        for field in ("gpu_tflops", "link_gbps"):
            if not getattr(self, field) > 0:
                raise ValueError(f"TargetLayer.{field}={getattr(self, field)} must be > 0")

    @classmethod
    def of(cls, setup: shapes.Setup, gpu: str, gpu_tflops: float, link_gbps: float):
        """A published setup's model at its pairs per rank, in both modes."""
        model = setup.shape
        pairs = dict.fromkeys(("train", "prefill"), setup.pairs_per_rank)
        return cls(
            setup.model,
            model.hidden,
            model.expert_ffn,
            setup.itemsize,
            pairs,
            gpu,
            gpu_tflops,
            link_gbps,
        )

    @property
    def experts(self) -> shapes.ExpertShape:
        """One expert and its token rows at the target (their bytes)."""
        return shapes.ExpertShape(self.d_model, self.d_ff, self.itemsize)

    def ideal_expert_seconds(self, mode: str) -> float:
        """The force-balanced ideal rank's expert time on the GPU: its mean rows' FLOPs at
        ``gpu_tflops``."""
        rows = self.pairs_per_rank[mode]
        flops = layer.expert_fwd_flops(rows, self.d_model, self.d_ff)
        return layer.compute_seconds(flops, self.gpu_tflops, mode)


def layer_at_target(
    experts_s: float,
    ideal_experts_s: float,
    token_rows_RR: np.ndarray,
    transfer_copies: float,
    replayed_pairs: int,
    target: TargetLayer,
    mode: str,
) -> layer.LayerTime:
    """One layer of one policy at the target's ratios (see the module docstring), by the step
    model's rule (`experiments.lab.stepmodel.layer.layer_terms`).

    Args:
      experts_s, ideal_experts_s: the policy's and the ideal's busiest-rank expert seconds as
        measured at the replayed shape.
      token_rows_RR: float [R, R], rows each rank sends each other rank in the dispatch, at the
        replayed pairs per rank.
      transfer_copies: the replica transfer's length in expert copies (each hop as long as its
        busiest link, summed over hops; `links.relay_copies`).
      replayed_pairs: the replayed pairs per rank (the target's rows are the replay's scaled by
        ``target.pairs_per_rank[mode] / replayed_pairs``).
      target: the model and GPU; mode: "train" or "prefill".
    """
    if not ideal_experts_s > 0:
        raise ValueError(f"ideal_experts_s={ideal_experts_s} must be > 0")
    experts = experts_s / ideal_experts_s * target.ideal_expert_seconds(mode)
    scale = target.pairs_per_rank[mode] / replayed_pairs
    one_a2a, one_transfer = links.exchange_and_transfer(
        np.asarray(token_rows_RR) * scale,
        transfer_copies,
        target.experts,
        links.Links.single(target.link_gbps),
    )
    return layer.layer_terms(experts, one_a2a, one_transfer, mode)
