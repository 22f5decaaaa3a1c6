"""Tests for experiments/sim/: the cost model checked by hand on tiny inputs, the relay charge,
the balancers' weight copies, and one small table end to end."""

import dataclasses
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import skip_without_traces

import ultraep_jax as uep
from experiments.lab.loads import baselines, policies, ranks, traces
from experiments.lab.stepmodel import calibration, layer, links, shapes
from experiments.sim import assumptions, balancers, cell, report, streams
from tests.xla_settings import program_env

# A tiny model whose FLOPs are easy to count by hand:
#   experts: 3 GEMMs x 2 x D x F = 6 * 64 * 32 = 12288 FLOPs per row forward.
#   other, per token forward: attention projections 2 * (64*32 [q] + 2*64*16 [k, v] + 32*64 [o])
#   = 2 * 6144 = 12288, causal core 2 * seq * heads * head_dim = 2 * 16 * 2 * 16 = 1024, router
#   2 * D * E = 2 * 64 * 8 = 1024; total 14336.
TINY = shapes.ModelShape(
    name="tiny",
    source="test",
    hidden=64,
    expert_ffn=32,
    num_experts=8,
    top_k=2,
    moe_layers=2,
    dense_layers=0,
    dense_ffn=0,
    shared_experts=0,
    shared_ffn=0,
    vocab=0,
    attention=("gqa", 2, 1, 16),
    trace="deepseek-r1",
)
TOKENS = 16  # per rank; T * k = 32 rows per rank at the mean
PARAMS = layer.CostParams(
    tokens_per_rank=TOKENS,
    seq_len=16,
    calibration=calibration.Calibration(gemm_efficiency=1.0, link_efficiency=1.0),
)
# 1 MFLOP/s, so seconds = FLOPs / 1e6; links so fast that all-to-all time is negligible.
FAST_LINKS = shapes.Cluster("test", "test", 1e-6, 1e12, 8, 1e12, "test")


def _uniform_loads(ranks=4, experts=8, per_entry=4):
    """[R, E] with every entry ``per_entry``: each rank gets 2 experts x 4 x 4 sources = 32."""
    return np.full((ranks, experts), per_entry, dtype=np.int32)


def test_hand_counted_flops():
    assert layer.expert_fwd_flops(1, 64, 32) == 12288
    assert layer.attention_fwd_flops_per_token(TINY, 16) == 12288 + 1024
    assert layer.other_fwd_flops_per_moe_layer(TINY, TOKENS, 16) == TOKENS * 14336
    # 3x forward for forward + backward, at 1e6 FLOP/s:
    assert layer.train_seconds(1e6, FAST_LINKS, PARAMS) == pytest.approx(3.0)


def test_balanced_load_is_100_percent_of_ideal():
    loads = _uniform_loads()
    results = balancers.none_balancer(loads[None, None], None)  # 1 stream, 1 microbatch
    assert results[0][0].rank_load.tolist() == [32, 32, 32, 32]
    cluster = shapes.CLUSTERS["hgx-h100"]
    step, _ = cell.slowest_group_step(results, 1, TINY, 4, cluster, PARAMS, fanout=2)
    # One sampled stream stands for both MoE layers (scaled by moe_layers / sampled = 2).
    ideal = layer.ideal_step_seconds(TINY, 4, cluster, PARAMS, microbatches=1)
    assert step == pytest.approx(ideal, rel=1e-12)


def test_doubling_one_rank_in_a_compute_bound_setting():
    loads = _uniform_loads()
    loads[:, 0:2] *= 2  # rank 0's two masters get twice the tokens: rank loads [64, 32, 32, 32]
    results = balancers.none_balancer(loads[None, None], None)
    assert results[0][0].rank_load.tolist() == [64, 32, 32, 32]
    step, terms = cell.slowest_group_step(results, 1, TINY, 4, FAST_LINKS, PARAMS, fanout=2)
    other = 3 * TOKENS * 14336 / 1e6  # 0.688128 s per layer
    experts = 3 * 64 * 12288 / 1e6  # 2.359296 s per layer (busiest rank: 64 rows)
    assert terms.other == pytest.approx(2 * other)
    assert terms.experts == pytest.approx(2 * experts)
    assert terms.plan == 0 and terms.transfer_exposed == 0
    assert step == pytest.approx(2 * (other + experts), rel=1e-9)  # 6.096848 s
    ideal = layer.ideal_step_seconds(TINY, 4, FAST_LINKS, PARAMS, 1)
    assert ideal == pytest.approx(2 * (other + 3 * 32 * 12288 / 1e6), rel=1e-9)  # 3.735552 s


def _layout(replicas: dict, ranks=8, experts=16, slots=2) -> np.ndarray:
    """[R, E/R + S]: the masters, then ``replicas`` {expert: [ranks]} in the spare slots."""
    em = experts // ranks
    layout = np.full((ranks, em + slots), -1, np.int32)
    layout[:, :em] = np.arange(experts).reshape(ranks, em)
    for e, where in replicas.items():
        for t in where:
            free = np.flatnonzero(layout[t, em:] < 0)[0]
            layout[t, em + free] = e
    return layout


def test_transfer_copy_times_by_hand():
    """Copies-long transfer from the largest per-link copies of each relay hop (R=8, E_m=2)."""
    one_hot = _layout({0: [1, 2, 3, 4, 5, 6]})
    # Direct: rank 0 sends 6 copies in one hop.
    assert links.transfer_copy_times([one_hot], 16, None).tolist() == [6]
    # f=2: hop 1 rank 0 -> ranks 1, 2; hop 2 ranks 1, 2 -> 2 each: 2 + 2.
    assert links.transfer_copy_times([one_hot], 16, 2).tolist() == [4]
    # f=1: a chain, one copy per hop, 6 hops.
    assert links.transfer_copy_times([one_hot], 16, 1).tolist() == [6]
    # Rank 0 masters experts 0 and 1, each on 3 other ranks (disjoint): direct 6 copies; f=2
    # gives each a root fan-out of 1 (rank 0 sends 2 in hop 1), then each first replica sends
    # 2: 2 + 2.
    two_hot = _layout({0: [1, 2, 3], 1: [4, 5, 6]})
    assert links.transfer_copy_times([two_hot], 16, None).tolist() == [6]
    assert links.transfer_copy_times([two_hot], 16, 2).tolist() == [4]
    # The receive side counts too: rank 7 gets 2 copies from 2 masters in one hop.
    two_in = _layout({2: [7], 4: [7]})
    assert links.transfer_copy_times([two_in], 16, None).tolist() == [2]
    # A layout with every instance at home moves nothing.
    assert links.transfer_copy_times([_layout({})], 16, 2).tolist() == [0]


def test_exposed_transfer_by_hand():
    # One copy = 3 * 64 * 32 * 2 = 12288 bytes; NVLink at 12288 bytes/s makes it 1 s. One
    # all-to-all of 32 rows at R=4 (all NVLink): 3/4 of 32 * 64 * 2 = 3072 bytes -> 0.25 s.
    slow = shapes.Cluster("slow", "test", 1e-6, 12288e-9, 8, 1.0, "test")
    assert layer.replica_bytes(TINY, PARAMS) == 12288
    assert layer.copy_seconds(12288, 4, slow, PARAMS) == pytest.approx(1.0)
    assert layer.a2a_seconds(32, 4, 64, slow, PARAMS) == pytest.approx(0.25)
    relay = layer.layer_time(32, 4.0, 0.0, TINY, 4, slow, PARAMS)
    direct = layer.layer_time(32, 6.0, 0.0, TINY, 4, slow, PARAMS)
    # Weights beside the forward dispatch, gradients beside the backward one: 2 * (x - 0.25).
    assert relay.transfer_exposed == pytest.approx(2 * (4 - 0.25))
    assert direct.transfer_exposed == pytest.approx(2 * (6 - 0.25))
    assert relay.a2a == pytest.approx(1.0)
    # A copy that fits inside the dispatch costs nothing.
    assert layer.layer_time(32, 0.2, 0.0, TINY, 4, slow, PARAMS).transfer_exposed == 0


def test_planner_time_is_on_the_critical_path():
    cluster = shapes.CLUSTERS["hgx-h100"]
    base = layer.layer_time(32, 0.0, 0.0, TINY, 4, cluster, PARAMS)
    planned = layer.layer_time(32, 0.0, 1e-3, TINY, 4, cluster, PARAMS)
    gather = layer.gather_seconds(4, 8, cluster, PARAMS)  # 4 * 8 * 4 bytes, 3/4 on NVLink
    assert gather == pytest.approx(128 * 0.75 / (450e9 * 1.0))
    assert planned.total - base.total == pytest.approx(1e-3 + gather)


def test_link_fractions_and_a2a_across_nodes():
    assert links.link_fractions(8, 8) == (7 / 8, 0.0)
    assert links.link_fractions(64, 8) == (7 / 64, 56 / 64)
    h100 = shapes.CLUSTERS["hgx-h100"]
    rows, hidden = 65536, 4096
    # EP64 over 8 nodes: the IB part (56/64 of the rows at 50 GB/s) dominates.
    want = rows * hidden * 2 * 56 / 64 / 50e9
    assert layer.a2a_seconds(rows, 64, hidden, h100, PARAMS) == pytest.approx(want)


def test_off_home_copies_by_hand():
    # R=2, E=4 (home: experts 0, 1 on rank 0; 2, 3 on rank 1), 3 slots per rank.
    layout = np.array([[0, 2, 2], [1, 3, -1]])
    copies, copies_in = balancers.off_home_copies(layout, 4)
    # Expert 1 on rank 1, expert 2 twice on rank 0: one copy, a rank holding an expert twice
    # needs no second one (the old count, [0, 1, 2, 0] and [2, 1], charged it twice).
    assert copies.tolist() == [0, 1, 1, 0]
    assert copies_in.tolist() == [1, 1]
    # The one adapter both the simulator and the replay use (`policies.weight_copies`).
    held, copies_RR = policies.weight_copies(layout, 4)
    assert held.tolist() == [[-1, 2, -1], [1, -1, -1]]
    assert copies_RR.tolist() == [[0, 1], [1, 0]]  # [home, receiver]


def test_replicas_in_spare_slots_are_the_copies():
    # R=4, E=8 (two masters a rank, which never count); every filled spare slot is one copy.
    slot_expert = np.array([[-1, -1], [0, -1], [0, 3], [5, -1]])
    layout = np.concatenate([baselines.master_layout(4, 8), slot_expert], axis=1)
    b = balancers.costed(baselines.Balanced(layout, np.zeros(layout.shape, np.int64)), 8, 2e-5)
    assert b.copies.tolist() == [2, 0, 0, 1, 0, 1, 0, 0]
    assert b.copies_in.tolist() == [0, 1, 2, 1]
    assert b.plan_seconds == 2e-5


def test_ultraep_balancer_charges_its_plans():
    cfg = uep.BalancerConfig(num_experts=8, ep_size=4, slots_per_rank=2, min_tokens_per_replica=1)
    rng = np.random.default_rng(0)
    stream = rng.multinomial(64, [0.5] + [0.5 / 7] * 7, size=(2, 4)).astype(np.int32)  # M=2
    out = balancers.make_ultraep_balancer(timing_batch=4)(stream[None], cfg)
    assert len(out) == 1 and len(out[0]) == 2
    for loads, got in zip(stream, out[0], strict=True):
        plan = uep.plan(loads, cfg)
        slots = np.asarray(plan.slot_expert)
        np.testing.assert_array_equal(got.rank_load, plan.rank_load)
        np.testing.assert_array_equal(got.copies, np.bincount(slots[slots >= 0], minlength=8))
        np.testing.assert_array_equal(got.copies_in, (slots >= 0).sum(axis=1))
        assert got.copies.sum() > 0 and got.plan_seconds > 0


def test_eplb_balancers_charge_what_they_move():
    cfg = uep.BalancerConfig(num_experts=4, ep_size=2, slots_per_rank=1)
    rng = np.random.default_rng(1)
    stream = rng.integers(0, 50, size=(3, 2, 4)).astype(np.int32)  # M=3 microbatches
    past = rng.integers(0, 50, size=(2, 2, 4)).astype(np.int32)  # H=2 earlier matrices
    # eplb_exact / eplb_plus: planned on every matrix, timed; off-home instances are copies.
    for fn, baseline in (
        (balancers.eplb_exact_balancer, baselines.eplb_exact),
        (balancers.eplb_plus_balancer, baselines.eplb_plus),
    ):
        got = fn(stream[None], cfg, past[None])
        assert len(got) == 1 and len(got[0]) == 3
        for loads, b in zip(stream, got[0], strict=True):
            want = baseline(loads, 1)
            copies, copies_in = balancers.off_home_copies(want.layout, 4)
            np.testing.assert_array_equal(b.rank_load, want.rank_load)
            np.testing.assert_array_equal(b.copies, copies)
            np.testing.assert_array_equal(b.copies_in, copies_in)
            assert b.plan_seconds > 0
    # eplb_periodic: planned on the history (window = interval = H, lag 1), nothing moves.
    got = balancers.eplb_periodic_balancer(stream[None], cfg, past[None])
    want = baselines.eplb_periodic(np.concatenate([past, stream]), 1, window=2, interval=2, lag=1)
    assert len(got[0]) == 3  # the history steps are dropped
    for b, w in zip(got[0], want.steps[2:], strict=True):
        np.testing.assert_array_equal(b.rank_load, w.rank_load)
        assert b.copies.sum() == 0 and b.copies_in.sum() == 0 and b.plan_seconds == 0


def test_workload_history_is_separate():
    sampling = streams.Sampling(microbatches=2, zipf_pool=6, history=3, seed=0)
    loads, past = streams.workload_streams("zipf2.0", TINY, 4, 1, [0, 1], PARAMS, sampling)
    assert loads.shape == (2, 2, 4, 8) and past.shape == (2, 3, 4, 8)
    np.testing.assert_array_equal(loads.sum(axis=-1), TOKENS * TINY.top_k)


def test_layer_samples():
    assert streams.layer_samples(58, 3) == [0, 28, 57]
    assert streams.layer_samples(4, 10) == [0, 1, 2, 3]


def test_topk_counts_caps_each_expert():
    counts = np.array([1000, 1, 1, 1, 1, 1, 1, 1])
    out = traces.topk_counts(counts, 4, 2000, seed=0)
    assert out.sum() == 2000 * 4
    assert out.max() <= 2000  # at most one choice per token
    assert out[0] == 2000


def test_table_builds_for_one_small_model():
    model = dataclasses.replace(shapes.MODELS["glm-4.5-106b"], moe_layers=4)
    rates = dataclasses.replace(PARAMS.calibration, gemm_efficiency=0.65)
    params = dataclasses.replace(PARAMS, tokens_per_rank=1024, seq_len=1024, calibration=rates)
    chosen = balancers.make_balancers(["ultraep", "eplb_exact", "eplb_periodic", "eplb_plus"], 8)
    assert list(chosen) == list(balancers.BASELINE_ORDER)  # table order, none always first
    cfg = {"slots_per_rank": 2, "min_tokens_per_replica": 128, "balance_eps": 0.01}
    sampling = streams.Sampling(layers_sampled=2, microbatches=1, dp_groups=1, zipf_pool=2)
    result = cell.simulate_cell(
        model, shapes.SCENARIOS["ep8-hgx"], "zipf2.0", chosen, cfg, params, sampling
    )
    rows = result["rows"]
    assert set(rows) >= set(chosen)
    assert all(0 < r["pct_ideal"] <= 100.0 + 1e-9 for r in rows.values())
    assert result["initial_imbalance"] == pytest.approx(2.0, rel=0.01)
    assert rows["none"]["final_imbalance"] == pytest.approx(2.0, rel=0.01)
    assert rows["none"]["speedup"] == 1.0
    assert rows["ultraep"]["final_imbalance"] < 1.05
    assert rows["none"]["pct_ideal"] < rows["ultraep"]["pct_ideal"] <= 100.0 + 1e-9
    assert rows["ultraep"]["speedup"] > 1.2
    assert rows["ultraep"]["peak_rows"] < rows["none"]["peak_rows"]
    names = list(rows)
    text = "\n".join(
        report.headline_table([result], names)
        + report.detail_table([result], names)
        + report.regime_table([result])
        + report.verdict([result])
    )
    assert "glm-4.5-106b" in text and "ultraep" in text and "94.3 %" in text
    assert len(assumptions.assumption_lines(params, cfg, sampling)) > 10
    with pytest.raises(ValueError, match="unknown baselines"):
        balancers.make_balancers(["none", "eplb"], 8)


def test_traces_dir(tmp_path):
    source = sorted((traces.default_traces_dir() / "deepseek-r1").glob("*.json"))
    if not source:
        skip_without_traces("no deepseek-r1 trace")
    (tmp_path / "deepseek-r1").mkdir()
    shutil.copy(source[0], tmp_path / "deepseek-r1" / source[0].name)
    runs = traces.trace_runs("deepseek-r1", str(tmp_path))
    assert len(runs) == 1 and runs[0].shape == (58, 256)
    assert len(traces.trace_runs("deepseek-r1")) == 12  # the default folder holds all of them
    with pytest.raises(FileNotFoundError, match="trace folder not found"):
        traces.trace_runs("deepseek-r1", str(tmp_path / "nope"))


def test_missing_traces_dir_ends_with_one_line(tmp_path):
    env = program_env()
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.sim", f"--traces_dir={tmp_path}"],
        check=False,
        cwd=pathlib.Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"--traces_dir={tmp_path}" in errors[0], proc.stderr


def _write_calibration(path, **train):
    data = {
        "provenance": {
            "device": "test",
            "machine": "m",
            "commit": "c",
            "command": "x",
            "date": "d",
        },
        "shape": {"d_model": 64, "d_ff": 16, "dtype": "float32", "kernel": "auto"},
        "train": train,
        "measured": [],
    }
    path.write_text(json.dumps(data))
    return path


def test_calibrated_expert_cost_by_hand(tmp_path):
    """fixed + per row + per group, scaled by FLOPs per row (TINY's 64 x 32 is twice the
    calibration's 64 x 16) and the fixed term by the buffer (32 mean rows against 1000)."""
    path = _write_calibration(
        tmp_path / "cal.json",
        seconds_fixed=1e-3,
        seconds_per_row=1e-6,
        seconds_per_group=1e-4,
        pairs_per_rank=1000,
    )
    cal = dataclasses.replace(PARAMS.calibration, expert_cost=calibration.ExpertCost.read(path))
    params = dataclasses.replace(PARAMS, calibration=cal)
    # Ranks [32 rows in 2 groups, 64 rows in 3 groups]: the second is the busiest.
    want = 2 * (1e-3 * 32 / 1000 + 64e-6 + 3e-4)
    got = layer.rank_expert_seconds([32, 64], [2, 3], TINY, params)
    assert got == pytest.approx(want, rel=1e-12)
    # The ideal: the mean rows in E / R = 2 master groups (EP 4).
    ideal = layer.ideal_layer_time(TINY, 4, FAST_LINKS, params)
    assert ideal.experts == pytest.approx(2 * (1e-3 * 32 / 1000 + 32e-6 + 2e-4), rel=1e-12)
    # Without a calibration the experts follow their FLOPs.
    assert layer.rank_expert_seconds([32, 64], [2, 3], TINY, PARAMS) is None
    flops = layer.ideal_layer_time(TINY, 4, FAST_LINKS, PARAMS).experts
    assert flops == pytest.approx(3 * 32 * 12288 / 1e6)


def test_calibration_without_training_costs_raises(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"provenance": {}, "shape": {}, "prefill": {}}))
    with pytest.raises(ValueError, match="no training-mode costs"):
        calibration.ExpertCost.read(path)


def test_calibration_with_a_negative_cost_raises(tmp_path):
    path = _write_calibration(
        tmp_path / "cal.json",
        seconds_fixed=1e-3,
        seconds_per_row=1e-6,
        seconds_per_group=-1e-4,
        pairs_per_rank=1000,
    )
    with pytest.raises(ValueError, match="seconds_per_group=-0.0001 is negative"):
        calibration.ExpertCost.read(path)


def test_held_off_home_counts_an_expert_once_per_rank():
    """R=2, E=4: rank 0 masters 0, 1 and holds expert 3 twice (one copy); rank 1 masters 2, 3
    and holds expert 0 (one copy)."""
    layout = np.array([[[0, 1, 3, 3], [2, 3, 0, -1]]])
    got = ranks.held_off_home(layout, 4)
    np.testing.assert_array_equal(got, [[[-1, -1, 3, -1], [-1, -1, 0, -1]]])
