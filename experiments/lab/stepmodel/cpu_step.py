"""The step model's whole training step on this machine's pinned CPU ranks: the rest of the step
plus one `cpu_rates.layer_seconds` per MoE layer, each from the rates file of
`experiments.bench.rates` alone (no term fitted to a step), for the four modes of
`experiments.bench.step`:

  ideal       every rank at the mean load (max/mean 1.0), the 1.05x buffer, plain EP's program
  balanced    the balanced program at each layer's max/mean after balancing, the 1.05x buffer,
              one replica's stage (`REPLICAS`)
  plain       plain EP dropless at each layer's max/mean before balancing, the trainer's
              worst-case buffer (`ExpertParallel.capacity`: R x T x k rows)
  plain@1.25  plain EP at each layer's max/mean before, the 1.25x buffer (the rows beyond it
              dropped: the busiest rank runs at most a full buffer)

The rest (`experiments.bench.step_rest`: attention, norms, embedding, LM head and loss,
forward + backward, the gradient all-reduce, AdamW, the host's step) is the same in every mode.

Shapes: T tokens per rank, k top-k, R ranks, L MoE layers.
"""

from __future__ import annotations

import dataclasses
import json
import math

from experiments.lab.stepmodel.calibration import Calibration
from experiments.lab.stepmodel.cpu_rates import layer_seconds, read_calibration
from experiments.lab.stepmodel.step_ratios import RATIOS

#: Replicas the balanced layers are charged: the rates time 0 or 1; both committed bench.step
#: runs made exactly one per layer at every step (their summaries' ``mean_replicas_per_layer``
#: are 1.0 and 1.0 in every round: at EP2 one replica of the hot rank's heaviest expert
#: brings its excess to the other rank).
REPLICAS = 1
#: The capped plain mode's buffer (``--capacity_factor=1.25`` in `experiments.bench.step`).
CAPPED_FACTOR = 1.25
#: The modes of `experiments.bench.step` the model charges.
MODES = ("ideal", "balanced", "plain", "plain@1.25")


@dataclasses.dataclass(frozen=True)
class StepRates:
    """The layer's rates (a `Calibration` with its pinned fit, `cpu_rates.read_calibration`) and
    the rest of the step measured beside them.

    Attributes:
      layer: the fitted layer rates.
      rest_s: seconds of the rest of one training step (train mode).
      tokens: T, the tokens per rank the rest was timed at.
      num_layers: L, the MoE layers of the timed model.
    """

    layer: Calibration
    rest_s: float
    tokens: int
    num_layers: int

    def __post_init__(self):
        if self.rest_s < 0 or self.tokens < 1 or self.num_layers < 1:
            raise ValueError(
                f"StepRates: rest {self.rest_s} s, {self.tokens} tokens, {self.num_layers} layers"
            )

    @classmethod
    def read(cls, path) -> StepRates:
        """The rates file's layer fits and its rest; ValueError naming the file when it has no
        rest (``python -m experiments.bench.rates --parts=rest`` adds it)."""
        with open(path) as f:
            rest = json.load(f).get("rest")
        if rest is None:
            raise ValueError(f"{path} has no rest of the step: run bench.rates --parts=rest")
        train = rest["train"]
        return cls(read_calibration(path), train["seconds"], train["tokens"], train["num_layers"])


def buffer_rows(rates: Calibration, mode: str, tokens: int, ep: int | None = None) -> int:
    """C of ``mode``'s layers at ``tokens`` per rank over ``ep`` ranks (default the rates'), as
    `uep.ExpertParallel.capacity` sizes it: ``ceil(factor x T x k)`` (the rates' factor, the
    trainer's 1.05, for ideal and balanced; `CAPPED_FACTOR` for plain@1.25), or R x T x k for
    plain dropless."""
    pairs, ep = rates.pinned.top_k * tokens, ep or rates.pinned.ep
    if mode == "plain":
        return ep * pairs
    factor = CAPPED_FACTOR if mode == "plain@1.25" else rates.pinned.capacity_factor
    return min(ep * pairs, math.ceil(factor * pairs))


def mode_layer_seconds(
    rates: Calibration, mode: str, tokens: int, imbalance: float, ep: int | None = None
) -> float:
    """One MoE layer of ``mode`` (`MODES`) at max/mean ``imbalance`` of its busiest rank (before
    balancing for the plain modes, after for balanced; the ideal's is 1.0 whatever is given).
    ``ep``: the ranks its buffer is sized for (default the rates'; every other term stays the
    rates', the all-to-all's bytes included)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    rows = (1.0 if mode == "ideal" else imbalance) * rates.pinned.top_k * tokens
    balanced = mode == "balanced"
    replicas = REPLICAS if balanced else 0
    capacity = buffer_rows(rates, mode, tokens, ep)
    return layer_seconds(rates, "train", tokens, capacity, rows, replicas, balanced)


def mode_step_seconds(rates: StepRates, mode: str, imbalances, ep: int | None = None) -> float:
    """The whole step of ``mode`` at the rest's tokens per rank: rest + one layer per entry of
    ``imbalances`` [L] (each layer's max/mean, `mode_layer_seconds` with ``ep``)."""
    if len(imbalances) != rates.num_layers:
        raise ValueError(
            f"mode_step_seconds: {len(imbalances)} layer imbalances for a "
            f"{rates.num_layers}-layer rest"
        )
    return rates.rest_s + sum(
        mode_layer_seconds(rates.layer, mode, rates.tokens, i, ep) for i in imbalances
    )


def case_imbalances(case: dict) -> dict[str, list[float]]:
    """Per mode of a bench.step case (its JSON's ``cases[name]``), the per-layer max/mean the
    model charges: after balancing for balanced, before for the plain modes, 1.0 for ideal."""
    modes = case["modes"]
    out = {}
    for mode in MODES:
        key = "imbalance_after" if mode == "balanced" else "imbalance_before"
        out[mode] = [1.0] * len(modes[mode][key]) if mode == "ideal" else modes[mode][key]
    return out


def predict_case(rates: StepRates, case: dict) -> dict:
    """A bench.step case's modes and `RATIOS` as measured (medians) and as the model predicts
    them: ``{"steps": {mode: (measured s, model s)}, "ratios": {name: (measured, model)}}``."""
    model = {m: mode_step_seconds(rates, m, imb) for m, imb in case_imbalances(case).items()}
    steps = {m: (case["modes"][m]["step_time_s"]["median"], model[m]) for m in MODES}
    ratios = {
        name: (case["ratios"][name]["median"], model[a] / model[b] * scale)
        for name, (a, b, scale) in RATIOS.items()
    }
    return {"steps": steps, "ratios": ratios}
