"""The step model's whole training step (`experiments.lab.stepmodel.cpu_step`) checked against the
steps `python -m experiments.bench.step --pinned_ranks=2` measured (experiments/results/
bench_step_*.json): fed only with the rates of `python -m experiments.bench.rates`
(experiments/results/rates_cpu.json: the layer's rates and the rest of the step), it predicts
each case's balanced / ideal and balanced / plain dropless within `TOLERANCE`; a model that
leaves the imbalance out misses. And its parts checked by hand: the buffers, the sum, the rates
file's merge, the rest's model."""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from experiments.bench import rates_file, step_rest
from experiments.lab.stepmodel import cpu_step
from experiments.lab.stepmodel.cpu_rates import layer_seconds
from experiments.lab.training import build
from experiments.lab.training.config import BALANCED_CAPACITY_FACTOR
from models.moe_lm import ModelConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"
CASES = sorted(RESULTS.glob("bench_step_*.json"))
#: The issue's bar: each predicted ratio within this of the measured one.
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def rates() -> cpu_step.StepRates:
    return cpu_step.StepRates.read(RESULTS / "rates_cpu.json")


def _measured_and_model(rates, case: dict) -> dict[str, tuple[float, float]]:
    """balanced / ideal and balanced / plain (step-time ratios) as measured (the inverse of the
    bench's median ratios) and as predicted."""
    r = cpu_step.predict_case(rates, case)["ratios"]
    pct, x = r["balanced_pct_of_ideal"], r["balanced_x_over_plain"]
    return {
        "balanced/ideal": (100.0 / pct[0], 100.0 / pct[1]),
        "balanced/plain": (1.0 / x[0], 1.0 / x[1]),
    }


def test_the_committed_cases_are_there():
    assert {p.name for p in CASES} >= {"bench_step_softmax.json", "bench_step_sigmoid.json"}


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_model_predicts_each_cases_ratios(rates, path):
    for name, case in json.loads(path.read_text())["cases"].items():
        for ratio, (measured, model) in _measured_and_model(rates, case).items():
            assert abs(model - measured) <= TOLERANCE, (
                f"{path.name} {name} {ratio}: model {model:.3f}, measured {measured:.3f}"
            )


def test_a_model_without_the_imbalance_misses(rates):
    # Every layer at max/mean 1: balancing changes nothing; the check must be able to tell.
    case = json.loads((RESULTS / "bench_step_sigmoid.json").read_text())["cases"]["sigmoid"]
    flat = {m: [1.0] * len(v) for m, v in cpu_step.case_imbalances(case).items()}
    plain = cpu_step.mode_step_seconds(rates, "plain", flat["plain"])
    balanced = cpu_step.mode_step_seconds(rates, "balanced", flat["balanced"])
    measured = 1.0 / case["ratios"]["balanced_x_over_plain"]["median"]
    assert abs(balanced / plain - measured) > TOLERANCE


def test_buffers_are_the_trainers(rates):
    layer = rates.layer  # T = 2048, k = 2, R = 2: 4096 pairs per rank
    assert layer.pinned.capacity_factor == BALANCED_CAPACITY_FACTOR  # timed at the trainer's buffer
    assert cpu_step.buffer_rows(layer, "plain", 2048) == 8192  # R x T x k
    assert cpu_step.buffer_rows(layer, "balanced", 2048) == 4301  # ceil(1.05 x 4096)
    assert cpu_step.buffer_rows(layer, "ideal", 2048) == 4301
    assert cpu_step.buffer_rows(layer, "plain@1.25", 2048) == 5120


def test_step_is_the_rest_plus_each_layer(rates):
    layer = rates.layer
    got = cpu_step.mode_step_seconds(rates, "plain", [1.2, 1.4])
    want = rates.rest_s + sum(
        layer_seconds(layer, "train", 2048, 8192, i * 4096, 0, False) for i in (1.2, 1.4)
    )
    assert got == pytest.approx(want)
    ideal = cpu_step.mode_step_seconds(rates, "ideal", [1.7, 1.9])  # the ideal ignores the loads
    one = layer_seconds(layer, "train", 2048, 4301, 4096, 0, False)
    assert ideal == pytest.approx(rates.rest_s + 2 * one)
    balanced = cpu_step.mode_step_seconds(rates, "balanced", [1.0, 1.0])
    assert balanced - rates.rest_s == pytest.approx(
        2 * layer_seconds(layer, "train", 2048, 4301, 4096, 1, True)
    )


def test_step_refuses_the_wrong_layer_count_and_mode(rates):
    with pytest.raises(ValueError, match="3 layer imbalances for a 2-layer rest"):
        cpu_step.mode_step_seconds(rates, "plain", [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="unknown mode 'eplb'"):
        cpu_step.mode_step_seconds(rates, "eplb", [1.0, 1.0])


def test_step_rates_need_the_rest(tmp_path):
    data = json.loads((RESULTS / "rates_cpu.json").read_text())
    del data["rest"]
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="no rest of the step: run bench.rates --parts=rest"):
        cpu_step.StepRates.read(path)


def _rates_file(date: str, **parts) -> dict:
    shape = {"d_model": 128, "ep_size": 2, "repeats": 5}
    return {"provenance": {"date": date, "command": "c", "commit": "x"}, "shape": shape, **parts}


def test_rates_merge_keeps_the_other_part():
    old = _rates_file("old", modes={"train": 1}, a2a=[1], rest={"train": 1})
    new = _rates_file("new", rest={"train": 2})
    new["shape"]["repeats"] = 20
    out = rates_file.merged(old, new, ["rest"])
    assert out["modes"] == {"train": 1} and out["a2a"] == [1] and out["rest"] == {"train": 2}
    assert out["shape"] == old["shape"]  # the layer rates' repeats
    assert out["provenance"]["date"] == "old"
    assert out["provenance"]["remeasured_rest"].startswith("re-measured alone on new")
    assert rates_file.merged(old, new, ["layer", "rest"]) is new


def test_rates_merge_refuses_what_it_cannot_keep():
    new = _rates_file("new", rest={"train": 2})
    with pytest.raises(ValueError, match="needs an existing rates file"):
        rates_file.merged(None, new, ["rest"])
    with pytest.raises(ValueError, match="has no layer part to keep"):
        rates_file.merged(_rates_file("old"), new, ["rest"])
    other = _rates_file("old", modes={})
    other["shape"]["d_model"] = 64
    with pytest.raises(ValueError, match="shape"):
        rates_file.merged(other, new, ["rest"])


def test_rest_model_keeps_the_experts_for_the_optimizer():
    cfg = ModelConfig(d_model=16, d_ff=16, num_experts=8, top_k=2, num_layers=1, max_seq_len=8)
    model, optimizer, batch = step_rest.rest_model(cfg, batch_size=8, seq_len=8)
    layer = model.blocks[0].moe
    assert isinstance(layer, step_rest.WithoutRoutedExperts)
    before = np.asarray(jax.device_get(layer.layer.w_gate[...]))
    loss, stats = nnx.jit(build.train_step)(model, optimizer, batch)
    assert np.isfinite(float(loss))
    assert int(stats.replicas.sum()) == 0 and stats.imbalance_before.shape == (1,)
    after = np.asarray(jax.device_get(layer.layer.w_gate[...]))
    # No gradient reaches them, but AdamW's weight decay moves them: they are in the update.
    assert not np.array_equal(before, after)
