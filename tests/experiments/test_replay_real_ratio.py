"""The replay's accounting at a real model's ratios (`experiments.replay.real_ratio`, the step
model's layer rule) against hand-computed numbers, the relay transfer's length
(`experiments.lab.stepmodel.links`), and the calibration fit (non-negative least squares,
`experiments.lab.stepmodel.calibration`) against SciPy's."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import nnls

from experiments.lab.stepmodel import calibration, links, shapes
from experiments.replay import real_ratio

# A tiny target whose numbers are easy by hand: 1000 FLOP/s and 1 byte/s.
TARGET = real_ratio.TargetLayer(
    name="tiny",
    d_model=4,
    d_ff=2,
    itemsize=2,
    pairs_per_rank={"train": 20, "prefill": 20},
    gpu="hand",
    gpu_tflops=1e-9,
    link_gbps=1e-9,
)
TOKEN_ROWS = np.array([[7.0, 3.0], [5.0, 9.0]])  # rows src -> dst at 10 pairs per rank


def test_target_sizes_by_hand():
    assert TARGET.experts.expert_bytes() == 3 * 4 * 2 * 2  # 48
    assert TARGET.experts.row_bytes() == 8
    # 6 D F FLOPs per row and pass: 48 x 20 rows = 960 FLOPs a pass, 3 passes in training.
    assert TARGET.ideal_expert_seconds("prefill") == pytest.approx(0.96)
    assert TARGET.ideal_expert_seconds("train") == pytest.approx(2.88)


@pytest.mark.parametrize(
    "mode, copies, want",
    [
        # experts: 2.0 / 1.6 of the ideal's 2.88 s = 3.6 s. Rows x 2 (20 pairs against 10):
        # rank 0 sends 6 and receives 10 off its own rank, rank 1 sends 10 and receives 6, so
        # one all-to-all is 10 rows x 8 B = 80 s; training has 4 of them (320 s). Three copies
        # of 48 B take 144 s a direction (288 s both), of which 144 - 80 = 64 s a direction
        # outlast the all-to-all beside it.
        ("train", 3.0, (3.6, 320.0, 288.0, 128.0)),
        # prefill: 1.25 x 0.96 s, 2 all-to-alls, one direction.
        ("prefill", 3.0, (1.2, 160.0, 144.0, 64.0)),
        # one copy (48 s) hides behind the 80 s all-to-all.
        ("train", 1.0, (3.6, 320.0, 96.0, 0.0)),
        ("prefill", 0.0, (1.2, 160.0, 0.0, 0.0)),
    ],
)
def test_layer_at_target_by_hand(mode, copies, want):
    got = real_ratio.layer_at_target(2.0, 1.6, TOKEN_ROWS, copies, 10, TARGET, mode)
    experts, tokens, transfer, exposed = want
    assert got.experts == pytest.approx(experts)
    assert got.a2a == pytest.approx(tokens)
    assert got.transfer == pytest.approx(transfer)
    assert got.transfer_exposed == pytest.approx(exposed)
    assert got.total == pytest.approx(experts + tokens + exposed)


def test_layer_at_target_rejects_a_zero_ideal():
    with pytest.raises(ValueError, match="ideal_experts_s=0"):
        real_ratio.layer_at_target(1.0, 0.0, TOKEN_ROWS, 1.0, 10, TARGET, "train")


def test_target_model_rejects_bad_rates():
    with pytest.raises(ValueError, match="gpu_tflops=0"):
        real_ratio.TargetLayer("x", 4, 2, 2, {"train": 1}, "g", 0.0, 1.0)


def _length(held_RC, num_experts: int, fanout: int) -> float:
    """The relay transfer's length in copies of one held matrix [R, C] (`links.relay_copies`)."""
    return float(links.relay_copies(np.asarray(held_RC)[None], num_experts, fanout)["length"][0])


def test_transfer_length_by_hand():
    # E = R = 4 (one master per rank). Direct: expert 0's master (rank 0) sends 3 copies, one
    # hop -> 3. Relay f=1: a chain 0 -> a -> b -> c, one copy a hop -> 3. Two replicas of
    # different masters on different ranks: one copy on every busy link -> 1. Nothing held -> 0.
    three = np.array([[-1], [0], [0], [0]])
    assert _length(three, 4, 0) == 3.0
    assert _length(three, 4, 1) == 3.0
    assert _length(np.array([[-1], [0], [-1], [2]]), 4, 0) == 1.0
    assert _length(np.full((4, 1), -1), 4, 2) == 0.0
    # Eight ranks, expert 0 on all 7 others: direct sends 7 from one rank; relay f=2 is shorter.
    seven = np.array([[-1]] + [[0]] * 7)
    assert _length(seven, 8, 0) == 7.0
    assert _length(seven, 8, 2) < 7.0


def test_nonnegative_least_squares_equals_scipy():
    rng = np.random.default_rng(0)
    for _ in range(20):
        a = rng.normal(size=(30, 4))
        t = rng.normal(size=30)
        got = calibration.nonnegative_least_squares(a, t)
        want, _ = nnls(a, t)
        assert np.all(got >= 0)
        np.testing.assert_allclose(got, want, atol=1e-9)


def test_fit_costs_keeps_every_cost_non_negative():
    # Ranks whose time falls with their group count (a noisy kernel): the unconstrained fit has
    # a negative per-group term; the cost fit sets it to 0 and refits the rest.
    rows = np.array([100, 200, 300, 400, 100, 200, 300, 400])
    groups = np.array([8, 8, 8, 8, 9, 9, 9, 9])
    seconds = 1.0 + 0.01 * rows - 0.1 * (groups - 8)
    points = [
        ("p", int(r), int(g), 500, float(s)) for r, g, s in zip(rows, groups, seconds, strict=True)
    ]
    a = np.stack([np.ones(8), rows, groups], axis=1)
    assert np.linalg.lstsq(a, seconds, rcond=None)[0][2] < 0  # the unconstrained fit
    fit = calibration.fit_costs(points, 500)
    assert fit["seconds_per_group"] == 0.0
    assert fit["seconds_fixed"] >= 0 and fit["seconds_per_row"] >= 0
    want, _ = nnls(a, seconds)
    np.testing.assert_allclose(
        [fit["seconds_fixed"], fit["seconds_per_row"], fit["seconds_per_group"]], want, atol=1e-9
    )


def test_exchange_and_transfer_by_hand():
    # 1 byte/s, one link class: rank 1 sends 5 rows (rank 0 receives 5) of 4 x 2 = 8 bytes ->
    # 40 s; two copies of a 3 x 4 x 2 x 2 = 48-byte expert to the one other rank -> 96 s.
    got = links.exchange_and_transfer(
        TOKEN_ROWS, 2.0, shapes.ExpertShape(4, 2, 2), links.Links.single(1e-9)
    )
    assert got == pytest.approx((40.0, 96.0))
