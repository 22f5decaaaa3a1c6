"""The replay's layer at a real model's ratios of transfer to compute (``--transfer_model``).

The replay times the experts at a small shape (D=128, F=64 on a CPU), where an expert's weights
are 98 KB against 88 MB for a bf16 DeepSeek-V3 expert: its exchanges, modelled at the replayed
shape's bytes, are a far smaller share of the step than on real hardware. This mode charges one
layer as the target model would run it on a stated GPU:

- Measured: each policy's busiest rank's expert time relative to the force-balanced ideal's, at
  the replayed shape (`experiments.replay.main.time_ranks`).
- Modelled: the ideal's expert time at the target shape on the GPU (its FLOPs at the stated
  TFLOP/s), which each policy's measured ratio scales (the busiest rank's measured expert time
  scaled by the FLOP ratio to the target shape and by the GPU's rate); the token all-to-alls
  from each rank's exact rows at the target's row bytes (the replayed matrix's rows scaled to the
  target's pairs per rank); the replica weights at the target's expert bytes, moved along the
  library's relay schedule (`ultraep_jax.relay`: each hop as long as its busiest link, sending or
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

from experiments import common
from experiments.replay import work as replay_work

#: Passes over the expert weights' FLOPs: forward (1) and, in training, backward (2 more).
_PASSES = {"train": 3, "prefill": 1}
#: Token all-to-alls per layer (dispatch and combine, and their transposes in training) and the
#: directions the replica weights move (forward copies; their gradients back in training).
EXCHANGES = {"train": (4, 2), "prefill": (2, 1)}


@dataclasses.dataclass(frozen=True)
class TargetModel:
    """The model and GPU the layer is charged at.

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
                raise ValueError(f"TargetModel.{field}={getattr(self, field)} must be >= 1")
        for field in ("gpu_tflops", "link_gbps"):
            if not getattr(self, field) > 0:
                raise ValueError(f"TargetModel.{field}={getattr(self, field)} must be > 0")

    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (a replica copy)."""
        return 3 * self.d_model * self.d_ff * self.itemsize

    def row_bytes(self) -> int:
        """Bytes of one token row."""
        return self.d_model * self.itemsize

    def ideal_expert_seconds(self, mode: str) -> float:
        """The force-balanced ideal rank's expert time on the GPU: its mean rows' FLOPs (2 D F
        per row for each of the 3 matmuls, per pass) at ``gpu_tflops``."""
        flops = _PASSES[mode] * 6.0 * self.d_model * self.d_ff * self.pairs_per_rank[mode]
        return flops / (self.gpu_tflops * 1e12)


@dataclasses.dataclass(frozen=True)
class LayerAtTarget:
    """One layer of one policy at the target's ratios, in seconds: the busiest rank's experts,
    the token all-to-alls, the replica transfer in all (both directions in training), the part
    of it no all-to-all hides, and the step (experts + all-to-alls + exposed transfer)."""

    experts_s: float
    tokens_s: float
    transfer_s: float
    exposed_s: float

    @property
    def step_s(self) -> float:
        return self.experts_s + self.tokens_s + self.exposed_s


def layer_at_target(
    experts_s: float,
    ideal_experts_s: float,
    token_rows_RR: np.ndarray,
    transfer_copies: float,
    replayed_pairs: int,
    target: TargetModel,
    mode: str,
) -> LayerAtTarget:
    """One layer of one policy at the target's ratios (see the module docstring).

    Args:
      experts_s, ideal_experts_s: the policy's and the ideal's busiest-rank expert seconds as
        measured at the replayed shape.
      token_rows_RR: float [R, R], rows each rank sends each other rank in the dispatch, at the
        replayed pairs per rank.
      transfer_copies: the replica transfer's length in expert copies (each hop as long as its
        busiest link, summed over hops; `transfer_length`).
      replayed_pairs: the replayed pairs per rank (the target's rows are the replay's scaled by
        ``target.pairs_per_rank[mode] / replayed_pairs``).
      target: the model and GPU; mode: "train" or "prefill".
    """
    if not ideal_experts_s > 0:
        raise ValueError(f"ideal_experts_s={ideal_experts_s} must be > 0")
    token_a2a, weight_moves = EXCHANGES[mode]
    experts = experts_s / ideal_experts_s * target.ideal_expert_seconds(mode)
    scale = target.pairs_per_rank[mode] / replayed_pairs
    one_a2a = replay_work.exchange_seconds(
        np.asarray(token_rows_RR) * scale, target.row_bytes(), target.link_gbps
    )
    one_transfer = transfer_copies * target.expert_bytes() / (target.link_gbps * 1e9)
    return LayerAtTarget(
        experts_s=experts,
        tokens_s=token_a2a * one_a2a,
        transfer_s=weight_moves * one_transfer,
        exposed_s=weight_moves * max(0.0, one_transfer - one_a2a),
    )


def transfer_length(held_RC: np.ndarray, num_experts: int, max_fanout: int) -> float:
    """The replica transfer's length in expert copies for the held matrix ``held_RC`` [R, C]
    (each rank's instances of experts it does not master, -1 elsewhere) under the relay bound
    ``max_fanout`` (0: direct): each hop as long as its busiest link, summed over hops."""
    held = np.asarray(held_RC, np.int32)
    if not (held >= 0).any():
        return 0.0
    R = held.shape[0]
    _, length, _ = common.batched_transfer(R, num_experts // R, max_fanout)(held[None])
    return float(np.asarray(length)[0])
