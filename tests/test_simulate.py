"""Tests for experiments/simulate.py: the cost model checked by hand on tiny inputs, the relay
tree, the balancer hook, and one small table end to end."""

import dataclasses
import importlib.machinery
import os
import pathlib
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest
from conftest import skip_without_traces

from experiments.sim import simulate as sim
from experiments.loads import traces, workloads

# A tiny model whose FLOPs are easy to count by hand:
#   experts: 3 GEMMs x 2 x D x F = 6 * 64 * 32 = 12288 FLOPs per row forward.
#   other, per token forward: attention projections 2 * (64*32 [q] + 2*64*16 [k, v] + 32*64 [o])
#   = 2 * 6144 = 12288, causal core 2 * seq * heads * head_dim = 2 * 16 * 2 * 16 = 1024, router
#   2 * D * E = 2 * 64 * 8 = 1024; total 14336.
TINY = sim.ModelShape(
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
PARAMS = sim.CostParams(
    tokens_per_rank=TOKENS, seq_len=16, gemm_efficiency=1.0, link_efficiency=1.0
)
# 1 MFLOP/s, so seconds = FLOPs / 1e6; links so fast that all-to-all time is negligible.
FAST_LINKS = sim.Cluster("test", "test", 1e-6, 1e12, 8, 1e12, "test")


def _uniform_loads(ranks=4, experts=8, per_entry=4):
    """[R, E] with every entry ``per_entry``: each rank gets 2 experts x 4 x 4 sources = 32."""
    return np.full((ranks, experts), per_entry, dtype=np.int32)


def test_hand_counted_flops():
    assert sim.expert_fwd_flops(1, 64, 32) == 12288
    assert sim.attention_fwd_flops_per_token(TINY, 16) == 12288 + 1024
    assert sim.other_fwd_flops_per_moe_layer(TINY, TOKENS, 16) == TOKENS * 14336
    # 3x forward for forward + backward, at 1e6 FLOP/s:
    assert sim.train_seconds(1e6, FAST_LINKS, PARAMS) == pytest.approx(3.0)


def test_balanced_load_is_100_percent_of_ideal():
    loads = _uniform_loads()
    results = sim.none_balancer(loads[None, None], None)  # 1 stream, 1 microbatch
    assert results[0][0].rank_load.tolist() == [32, 32, 32, 32]
    cluster = sim.CLUSTERS["hgx-h100"]
    step, _ = sim.step_seconds(results, 1, TINY, 4, cluster, PARAMS, fanout=2)
    # One sampled stream stands for both MoE layers (scaled by moe_layers / sampled = 2).
    ideal = sim.ideal_step_seconds(TINY, 4, cluster, PARAMS, microbatches=1)
    assert step == pytest.approx(ideal, rel=1e-12)


def test_doubling_one_rank_in_a_compute_bound_setting():
    loads = _uniform_loads()
    loads[:, 0:2] *= 2  # rank 0's two masters get twice the tokens: rank loads [64, 32, 32, 32]
    results = sim.none_balancer(loads[None, None], None)
    assert results[0][0].rank_load.tolist() == [64, 32, 32, 32]
    step, terms = sim.step_seconds(results, 1, TINY, 4, FAST_LINKS, PARAMS, fanout=2)
    other = 3 * TOKENS * 14336 / 1e6  # 0.688128 s per layer
    experts = 3 * 64 * 12288 / 1e6  # 2.359296 s per layer (busiest rank: 64 rows)
    assert terms.other == pytest.approx(2 * other)
    assert terms.experts == pytest.approx(2 * experts)
    assert terms.plan == 0 and terms.transfer_exposed == 0
    assert step == pytest.approx(2 * (other + experts), rel=1e-9)  # 6.096848 s
    ideal = sim.ideal_step_seconds(TINY, 4, FAST_LINKS, PARAMS, 1)
    assert ideal == pytest.approx(2 * (other + 3 * 32 * 12288 / 1e6), rel=1e-9)  # 3.735552 s


def test_relay_schedule_by_hand():
    # 6 copies, fan-out 2: the master sends 2 (3 holders), then 4 more over 3 holders: 2 each.
    assert sim.relay_schedule(6, 2) == [2, 2]
    # fan-out 1 doubles the holders each stage: 1, 2, 3 copies sent, 1 per sender.
    assert sim.relay_schedule(6, 1) == [1, 1, 1]
    assert sim.relay_schedule(2, 2) == [2]
    assert sim.relay_schedule(0, 2) == []
    with pytest.raises(ValueError):
        sim.relay_schedule(3, 0)


def test_relay_caps_fanout_time():
    copies = np.zeros(8, np.int64)  # R=4, E_m=2: experts 0, 1 on rank 0
    copies[0] = 6
    copies_in = np.array([0, 2, 2, 2])
    assert sim.transfer_copy_times(copies, copies_in, None) == 6  # master sends all 6
    assert sim.transfer_copy_times(copies, copies_in, 2) == 4  # stages of 2 + 2
    assert sim.transfer_copy_times(copies, copies_in, 1) == 3
    # Two hot experts on one master, 3 copies each, fan-out 2: first stages 2 + 2 back to back,
    # then each expert's last copy (1) from a replica: 5, against 6 direct.
    copies[1] = 3
    copies[0] = 3
    assert sim.transfer_copy_times(copies, copies_in, 2) == 5
    assert sim.transfer_copy_times(copies, copies_in, None) == 6
    # The receive side bounds it from below.
    assert sim.transfer_copy_times(copies, np.array([0, 7, 0, 0]), 2) == 7


def test_exposed_transfer_by_hand():
    # One copy = 3 * 64 * 32 * 2 = 12288 bytes; NVLink at 12288 bytes/s makes it 1 s. One
    # all-to-all of 32 rows at R=4 (all NVLink): 3/4 of 32 * 64 * 2 = 3072 bytes -> 0.25 s.
    slow = sim.Cluster("slow", "test", 1e-6, 12288e-9, 8, 1.0, "test")
    assert sim.replica_bytes(TINY, PARAMS) == 12288
    assert sim.copy_seconds(12288, 4, slow, PARAMS) == pytest.approx(1.0)
    assert sim.a2a_seconds(32, 4, 64, slow, PARAMS) == pytest.approx(0.25)
    relay = sim.layer_time(32, 4.0, 0.0, TINY, 4, slow, PARAMS)
    direct = sim.layer_time(32, 6.0, 0.0, TINY, 4, slow, PARAMS)
    # Weights beside the forward dispatch, gradients beside the backward one: 2 * (x - 0.25).
    assert relay.transfer_exposed == pytest.approx(2 * (4 - 0.25))
    assert direct.transfer_exposed == pytest.approx(2 * (6 - 0.25))
    assert relay.a2a == pytest.approx(1.0)
    # A copy that fits inside the dispatch costs nothing.
    assert sim.layer_time(32, 0.2, 0.0, TINY, 4, slow, PARAMS).transfer_exposed == 0


def test_planner_time_is_on_the_critical_path():
    cluster = sim.CLUSTERS["hgx-h100"]
    base = sim.layer_time(32, 0.0, 0.0, TINY, 4, cluster, PARAMS)
    planned = sim.layer_time(32, 0.0, 1e-3, TINY, 4, cluster, PARAMS)
    gather = sim.gather_seconds(4, 8, cluster, PARAMS)  # 4 * 8 * 4 bytes, 3/4 on NVLink
    assert gather == pytest.approx(128 * 0.75 / (450e9 * 1.0))
    assert planned.total - base.total == pytest.approx(1e-3 + gather)


def test_link_fractions_and_a2a_across_nodes():
    assert sim.link_fractions(8, 8) == (7 / 8, 0.0)
    assert sim.link_fractions(64, 8) == (7 / 64, 56 / 64)
    h100 = sim.CLUSTERS["hgx-h100"]
    rows, hidden = 65536, 4096
    # EP64 over 8 nodes: the IB part (56/64 of the rows at 50 GB/s) dominates.
    want = rows * hidden * 2 * 56 / 64 / 50e9
    assert sim.a2a_seconds(rows, 64, hidden, h100, PARAMS) == pytest.approx(want)


def test_balanced_from_slots_and_duck_typing():
    slot_expert = np.array([[-1, -1], [0, -1], [0, 3], [5, -1]])
    b = sim.balanced_from_slots([10, 9, 9, 9], slot_expert, 8, 2e-5)
    assert b.copies.tolist() == [2, 0, 0, 1, 0, 1, 0, 0]
    assert b.copies_in.tolist() == [0, 1, 2, 1]
    d = sim.as_balanced({"rank_load": [10, 9, 9, 9], "slot_expert": slot_expert}, 8)
    np.testing.assert_array_equal(d.copies, b.copies)
    moved = sim.as_balanced(types.SimpleNamespace(rank_load=[1, 1], copies=[3, 0]), 2)
    assert moved.copies_in.tolist() == [2, 2] and moved.plan_seconds == 0
    plain = sim.as_balanced({"rank_load": [4, 4]}, 2)
    assert plain.copies.sum() == 0


def _fake_module(**attrs):
    module = types.ModuleType("experiments.baselines")
    module.__spec__ = importlib.machinery.ModuleSpec("experiments.baselines", None)
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def test_external_hook(monkeypatch):
    def fake(streams, cfg, history):
        return [
            [{"rank_load": np.full(cfg.ep_size, 1), "copies": np.zeros(cfg.num_experts)}] * len(s)
            for s in streams
        ]

    def broken(streams, cfg, history):
        raise RuntimeError("work in progress")

    module = _fake_module(simulator_balancers=lambda: {"eplb_exact": fake, "eplb_plus": broken})
    monkeypatch.setitem(sys.modules, "experiments.baselines", module)
    found, note = sim.external_balancers()
    assert list(found) == ["eplb_exact"]
    assert "eplb_exact" in note and "dropped eplb_plus (RuntimeError" in note
    balancers, _ = sim.available_balancers(["none", "eplb_exact", "ultraep"], 8)
    assert list(balancers) == ["none", "eplb_exact", "ultraep"]

    monkeypatch.setattr(sim, "external_balancers", lambda: ({}, "experiments.baselines not found"))
    balancers, notes = sim.available_balancers(list(sim.BASELINE_ORDER), 8)
    assert list(balancers) == ["none", "ultraep"]
    assert any("eplb_periodic: not available" in n for n in notes)


def test_off_home_copies_by_hand():
    # R=2, E=4 (home: experts 0, 1 on rank 0; 2, 3 on rank 1), 3 slots per rank.
    layout = np.array([[0, 2, 2], [1, 3, -1]])
    copies, copies_in = sim.off_home_copies(layout, 4)
    assert copies.tolist() == [0, 1, 2, 0]  # expert 1 on rank 1, expert 2 twice on rank 0
    assert copies_in.tolist() == [2, 1]


def test_per_matrix_api_is_adapted(monkeypatch):
    # A stand-in with the per-matrix API of experiments.baselines: rank 0 keeps its masters
    # and gets a copy of expert 2 (which lives on rank 1).
    layout = np.array([[0, 1, 2], [2, 3, -1]])

    def eplb_exact(loads, slots_per_rank):
        assert slots_per_rank == 1
        return types.SimpleNamespace(layout=layout, rank_load=np.array([7, 5]))

    def eplb_periodic(stream, slots_per_rank, window, interval, lag):
        assert (window, interval, lag) == (1, 1, 1)
        step = types.SimpleNamespace(layout=layout, rank_load=np.array([6, 6]))
        return types.SimpleNamespace(steps=[step] * len(stream))

    module = _fake_module(eplb_exact=eplb_exact, eplb_periodic=eplb_periodic)
    monkeypatch.setitem(sys.modules, "experiments.baselines", module)
    found, note = sim.external_balancers()
    assert sorted(found) == ["eplb_exact", "eplb_periodic"] and "per-matrix API" in note
    cfg = sim.uep.BalancerConfig(num_experts=4, ep_size=2, slots_per_rank=1)
    loads = np.ones((2, 4), np.int32)
    streams, past = np.stack([loads, loads])[None], loads[None, None]
    exact = found["eplb_exact"](streams, cfg, past)
    assert len(exact[0]) == 2
    assert exact[0][0].copies.tolist() == [0, 0, 1, 0] and exact[0][0].copies_in.tolist() == [1, 0]
    assert exact[0][0].rank_load.tolist() == [7, 5] and exact[0][0].plan_seconds > 0
    periodic = found["eplb_periodic"](streams, cfg, past)
    assert len(periodic[0]) == 2  # the history step is dropped
    assert periodic[0][1].copies.sum() == 0 and periodic[0][1].plan_seconds == 0


def test_workload_history_is_separate():
    streams, past = sim.workload_streams(
        "zipf2.0", TINY, 4, 1, [0, 1], 2, PARAMS, seed=0, zipf_pool=6, history=3
    )
    assert streams.shape == (2, 2, 4, 8) and past.shape == (2, 3, 4, 8)
    np.testing.assert_array_equal(streams.sum(axis=-1), TOKENS * TINY.top_k)


def test_layer_samples():
    assert sim.layer_samples(58, 3) == [0, 28, 57]
    assert sim.layer_samples(4, 10) == [0, 1, 2, 3]


def test_topk_counts_caps_each_expert():
    counts = np.array([1000, 1, 1, 1, 1, 1, 1, 1])
    out = sim.topk_counts(counts, 4, 2000, seed=0)
    assert out.sum() == 2000 * 4
    assert out.max() <= 2000  # at most one choice per token
    assert out[0] == 2000


def test_table_builds_for_one_small_model():
    model = dataclasses.replace(sim.MODELS["glm-4.5-106b"], moe_layers=4)
    params = dataclasses.replace(PARAMS, tokens_per_rank=1024, seq_len=1024, gemm_efficiency=0.65)
    # Whatever is available here: none + ultraep, plus experiments.baselines where it exists.
    balancers, notes = sim.available_balancers(list(sim.BASELINE_ORDER), 8)
    assert next(iter(balancers)) == "none" and "ultraep" in balancers and notes
    cfg = {"slots_per_rank": 2, "min_tokens_per_replica": 128, "balance_eps": 0.01}
    cell = sim.simulate_cell(
        model, sim.SCENARIOS["ep8-hgx"], "zipf2.0", balancers, cfg, params, 2, 1, 1, zipf_pool=2
    )
    rows = cell["rows"]
    assert set(rows) >= set(balancers)
    assert all(0 < r["pct_ideal"] <= 100.0 + 1e-9 for r in rows.values())
    assert cell["initial_imbalance"] == pytest.approx(2.0, rel=0.01)
    assert rows["none"]["final_imbalance"] == pytest.approx(2.0, rel=0.01)
    assert rows["none"]["speedup"] == 1.0
    assert rows["ultraep"]["final_imbalance"] < 1.05
    assert rows["none"]["pct_ideal"] < rows["ultraep"]["pct_ideal"] <= 100.0 + 1e-9
    assert rows["ultraep"]["speedup"] > 1.2
    assert rows["ultraep"]["peak_rows"] < rows["none"]["peak_rows"]
    names = list(rows)
    text = "\n".join(
        sim.headline_table([cell], names)
        + sim.detail_table([cell], names)
        + sim.regime_table([cell])
        + sim.verdict([cell])
    )
    assert "glm-4.5-106b" in text and "ultraep" in text and "94.3 %" in text
    assert (
        len(
            sim.assumptions(
                params,
                cfg,
                {"microbatches": 1, "layers_sampled": 2, "dp_groups": 1, "zipf_pool": 2},
            )
        )
        > 10
    )


def test_traces_dir(tmp_path):
    source = sorted((traces.default_traces_dir() / "deepseek-r1").glob("*.json"))
    if not source:
        skip_without_traces("no deepseek-r1 trace")
    (tmp_path / "deepseek-r1").mkdir()
    shutil.copy(source[0], tmp_path / "deepseek-r1" / source[0].name)
    runs = sim.trace_runs("deepseek-r1", str(tmp_path))
    assert len(runs) == 1 and runs[0].shape == (58, 256)
    assert len(sim.trace_runs("deepseek-r1")) == 12  # the default folder holds all of them
    with pytest.raises(FileNotFoundError, match="trace folder not found"):
        sim.trace_runs("deepseek-r1", str(tmp_path / "nope"))


def test_missing_traces_dir_ends_with_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.sim", f"--traces_dir={tmp_path}"],
        check=False,
        cwd=pathlib.Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"--traces_dir={tmp_path}" in errors[0], proc.stderr
