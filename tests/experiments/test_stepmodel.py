"""The step model checked against our measurements (`experiments.stepmodel_programs.pinned`): fed
with the rates `python -m experiments.bench.rates` measured (experiments/results/rates_cpu.json), it
predicts each busiest-rank ratio the break-even (docs/breakeven.json, 256-8192 tokens per rank)
and the layer benchmark at 2048 tokens per rank (experiments/results/bench_pinned_*.txt)
measured, within `TOLERANCE`, but at the points `MISSES` names with the reason; a rule that
leaves balancing out misses most of them. And the anchor's estimate
(`experiments.stepmodel_programs.anchor`) on UltraEP's published plans, its parts checked by
hand."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest

from experiments.lab.stepmodel import calibration, cpu_rates, layer, shapes
from experiments.lab.stepmodel.calibration import Calibration
from experiments.lab.stepmodel.shapes import ANCHOR
from experiments.stepmodel_programs import anchor, pinned

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"
TOLERANCE = pinned.TOLERANCE  # the target: 0.05
# Why the model misses where it does (docs/results/models.md, "The step model against the pinned
# ranks").
_REMEASURED = "noise: re-measured with 15 rounds (breakeven_prefill_remeasured.json) it fits"
_REMEASURED_TRAIN = "noise: re-measured with 15 rounds (breakeven_train_remeasured.json) it fits"
_REMEASURED_LARGE = (
    "noise: re-measured with 15 rounds (breakeven_prefill_remeasured_large.json) it fits"
)
_REPLICA_STAGE = (
    "the expert stage with one replica at 256 tokens per rank, skew 0 (max/mean 1.07, the replica "
    "carries few rows): its fit (5.3 ms fixed, no per-group term) charges the balanced layer "
    "2.1 ms over plain dropless where the quiet re-measurement has 1.6 ms; both runs miss alike "
    "(1.174, 1.155 against 1.229)"
)
_SMALL = (
    "the balanced program's fixed cost at 256 tokens per rank: its replica bookkeeping beyond "
    "the expert stage and the planner is in no measured rate"
)
_SPREAD = (
    "noise: the same command's three runs span more than 0.05 (0.687-0.740, 0.661-0.722, "
    "0.968-1.046)"
)
#: (file, mode, skew, tokens, ratio) the model misses by more than `TOLERANCE`, with the reason.
MISSES = {
    ("breakeven.json", "train", 0.0, 256, "balanced/dropless"): _REPLICA_STAGE,
    ("breakeven.json", "train", 3.0, 256, "balanced/dropless"): _REMEASURED_TRAIN,
    ("breakeven.json", "train", 0.0, 256, "no_replica/dropless"): _REMEASURED_TRAIN,
    ("breakeven.json", "train", 1.6, 1024, "no_replica/dropless"): _REMEASURED_TRAIN,
    ("breakeven.json", "train", 1.6, 4096, "no_replica/dropless"): _REMEASURED_TRAIN,
    ("breakeven.json", "train", 3.0, 4096, "no_replica/dropless"): _REMEASURED_TRAIN,
    ("breakeven.json", "prefill", 0.0, 4096, "balanced/dropless"): _REMEASURED,
    ("breakeven.json", "prefill", 0.0, 4096, "no_replica/dropless"): _REMEASURED,
    ("breakeven.json", "prefill", 1.6, 256, "balanced/dropless"): _SMALL,
    ("breakeven.json", "prefill", 1.6, 256, "no_replica/dropless"): _REMEASURED,
    ("breakeven.json", "prefill", 1.6, 4096, "balanced/dropless"): _REMEASURED,
    ("breakeven.json", "prefill", 3.0, 256, "balanced/dropless"): _SMALL,
    ("breakeven.json", "prefill", 3.0, 256, "no_replica/dropless"): _REMEASURED,
    ("breakeven.json", "prefill", 3.0, 1024, "balanced/dropless"): _REMEASURED_LARGE,
    ("breakeven.json", "prefill", 3.0, 8192, "no_replica/dropless"): _REMEASURED_LARGE,
    ("breakeven_prefill_remeasured.json", "prefill", 1.6, 256, "balanced/dropless"): _SMALL,
    ("breakeven_prefill_remeasured.json", "prefill", 3.0, 256, "balanced/dropless"): _SMALL,
    ("breakeven_train_remeasured.json", "train", 0.0, 256, "balanced/dropless"): _REPLICA_STAGE,
    ("bench_pinned", "train", 0.687, 2048, "overhead_dropless"): _SPREAD,
    ("bench_pinned", "train", 0.661, 2048, "capped_vs_plain_dropless"): _SPREAD,
    ("bench_pinned", "train", 0.968, 2048, "capped_vs_plain_capped"): _SPREAD,
}
#: The break-even files the model is checked on: the sweep, and its noisiest prefill and
#: training points re-measured with 15 rounds.
BREAKEVEN = {
    "breakeven.json": ROOT / "docs" / "breakeven.json",
    "breakeven_prefill_remeasured.json": RESULTS / "breakeven_prefill_remeasured.json",
    "breakeven_train_remeasured.json": RESULTS / "breakeven_train_remeasured.json",
    "breakeven_prefill_remeasured_large.json": RESULTS / "breakeven_prefill_remeasured_large.json",
}


def _check(key: tuple, row: dict) -> None:
    """``row``'s prediction within `TOLERANCE`, or, where `MISSES` says why not, beyond it."""
    err = abs(row["model"] - row["measured"])
    if key in MISSES:
        assert err > TOLERANCE, f"{key} now fits ({err:.3f}): take it off MISSES"
    else:
        assert err <= TOLERANCE, f"{key}: model {row['model']:.3f}, measured {row['measured']:.3f}"


@pytest.fixture(scope="module")
def rates() -> Calibration:
    return cpu_rates.read_calibration(RESULTS / "rates_cpu.json")


def _breakeven_rows(rates, name: str) -> list[dict]:
    points = json.loads(BREAKEVEN[name].read_text())["points"]
    return pinned.breakeven_rows(rates, points)


@pytest.mark.parametrize(
    "name, count",
    [
        ("breakeven.json", 48),
        ("breakeven_prefill_remeasured.json", 12),
        ("breakeven_train_remeasured.json", 18),
        ("breakeven_prefill_remeasured_large.json", 4),
    ],
)
def test_model_predicts_each_breakeven_ratio(rates, name, count):
    # breakeven.json: 2 modes x 3 skews x 4 token counts (256-8192) x 2 ratios.
    rows = _breakeven_rows(rates, name)
    assert len(rows) == count
    for row in rows:
        _check((name, row["mode"], row["skew"], row["tokens"], row["ratio"]), row)


def test_model_predicts_the_layer_benchmark_at_2048_tokens(rates):
    text = "".join(p.read_text() for p in sorted(RESULTS.glob(pinned.MOE_GLOB)))
    rows = pinned.moe_rows(rates, pinned.moe_runs(text), 2048)
    assert len(rows) == 12  # four runs at 2048 tokens per rank, three ratios each
    for row in rows:
        _check(("bench_pinned", row["mode"], row["measured"], row["tokens"], row["ratio"]), row)


def test_a_rule_without_balancing_misses(rates):
    # Balancing changes nothing (every ratio 1): the check must be able to tell.
    rows = _breakeven_rows(rates, "breakeven.json")
    balanced = [r for r in rows if r["ratio"] == "balanced/dropless"]
    missed = [r for r in balanced if abs(1.0 - r["measured"]) > TOLERANCE]
    assert len(missed) >= len(balanced) // 2


def test_linear_fit_recovers_its_coefficients():
    x = np.array([[1, 2.0, 3.0], [1, 5.0, 1.0], [1, 7.0, 4.0], [1, 1.0, 9.0]])
    fit = calibration.Linear.fit(("a", "b", "c"), x, x @ [0.5, 2.0, 0.25])
    np.testing.assert_allclose(fit.coef, [0.5, 2.0, 0.25], rtol=1e-9)
    assert fit(1, 3.0, 4.0) == pytest.approx(0.5 + 6.0 + 1.0)
    with pytest.raises(ValueError):
        calibration.Linear(("a",), (-1.0,))


def test_moe_runs_parse_a_block():
    text = """MoE layer, train, EP=2 on 2 pinned processes x 1 cpu: D=128 tokens/device=2048, x
Step-time ratios (medians of the same run):
    balanced, dropless / plain EP, dropless    0.716   same buffers
      balanced, capped / plain EP, dropless    0.722   balanced in a small buffer
      balanced, capped / plain EP, capped      1.046   same buffer
      balanced, capped / ideal, capped         0.986   same buffer; the ideal's even routing
         ideal, capped / plain EP, dropless    0.720   the floor of balanced / plain dropless
    rank     0     1  max/mean
  before  6657  1535     1.625
   after  4136  4056     1.010   (1 replicas)
"""
    (run,) = pinned.moe_runs(text)
    assert run == {
        "mode": "train",
        "tokens": 2048,
        "ratios": [0.716, 0.722, 1.046],
        "before": 1.625,
        "after": 1.01,
        "replicas": 1,
    }


def test_layer_seconds_refuses_what_the_rates_do_not_time(rates):
    with pytest.raises(ValueError):
        cpu_rates.layer_seconds(rates, "train", 256, 1024, 512, 2, True)
    with pytest.raises(ValueError):
        cpu_rates.layer_seconds(rates, "train", 256, 1024, 512, 1, False)


def test_expert_seconds_pads_each_group_to_a_tile():
    model = ANCHOR.shape
    one = layer.tiled_expert_seconds([128], model, 500.0)
    assert layer.tiled_expert_seconds([1], model, 500.0) == pytest.approx(one)
    assert layer.tiled_expert_seconds([129, 0], model, 500.0) == pytest.approx(2 * one)


def test_anchor_published_plans_within_their_bands():
    scenario = anchor.SCENARIOS["dp40xep64"]
    for i in range(len(ANCHOR.initial_imbalance)):
        f = anchor.figures([anchor.published_load(i)], scenario)
        assert f["pct_band"][0] <= f["pct"] <= f["pct_band"][1] <= 100.0
        assert f["speedup_band"][0] <= f["speedup"] <= f["speedup_band"][1]
        assert f["speedup"] > 1.0  # balancing the anchor's loads pays
        assert f["final"] == pytest.approx(ANCHOR.final_imbalance)


def test_trace_models_take_their_traces_sizes():
    """A trace model's experts and top-k are stated once, in experiments.lab.loads.traces
    (Qwen1.5-MoE config.json: 60 experts, top-4); a model whose experts differ from its trace's is
    refused."""
    qwen = shapes.TRACE_MODELS["qwen1.5-moe-a2.7b"]
    assert (qwen.num_experts, qwen.top_k) == (60, 4)
    row = dataclasses.asdict(shapes.MODELS["glm-4.5-106b"])
    del row["name"]
    with pytest.raises(ValueError, match=r"glm has 64 experts, its trace switch-base-128 128"):
        shapes._models({"glm": {**row, "num_experts": 64}})


def test_layer_seconds_needs_the_pinned_fit():
    # The step model's rates without a rates file's fit (the GPU model's defaults) time no CPU
    # layer: a one-line error, not the FLOP model's figures.
    with pytest.raises(ValueError, match="no pinned-rank fit"):
        cpu_rates.layer_seconds(Calibration(), "train", 256, 1024, 512, 0, False)


def test_corner_is_the_step_models_rates():
    # The anchor's middle corner: the grouped matmul's mid-band rate as the experts' rate, the
    # mid-band launch latency of each added kernel summed per layer.
    rates = anchor.MIDDLE.rates
    assert rates.expert_tflops == pytest.approx(528.0)
    assert rates.launch_s == pytest.approx(12 * 6e-6)
    with pytest.raises(ValueError, match="Corner"):
        anchor.Corner(Calibration(), 0.5)  # no grouped-matmul rate


def test_expert_shape_states_the_bytes_once():
    # DeepSeek-V3's expert in bf16: 3 x 7168 x 2048 x 2 bytes, a row 7168 x 2; the model's, the
    # replay target's and the replay shape's bytes are this one type's.
    experts = ANCHOR.shape.experts(2)
    assert experts.expert_bytes() == 3 * 7168 * 2048 * 2
    assert experts.row_bytes() == 7168 * 2
    with pytest.raises(ValueError, match="ExpertShape.itemsize=0"):
        shapes.ExpertShape(4, 2, 0)
