"""Tests for experiments/lab/loads/workloads.py and traces.py (pure NumPy; run with
`python -m pytest` from the repo root), and for where the real expert-load traces are read from."""

import itertools
import json
import pathlib

import conftest
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.lab.loads import drift, ranks, traces, workloads
from tests.helpers import assert_integer_rule

R, E, T, K = 64, 256, 8192, 8  # UltraEP reference setup
TRACES = traces.default_traces_dir()
CHECKOUT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def needs_traces():
    """Skips without the trace folder (fails instead when ULTRAEP_REQUIRE_TRACES is set)."""
    if not TRACES.is_dir():
        conftest.skip_without_traces(f"no trace folder at {TRACES}")


def _check_matrix(loads, ep_size, num_experts, pairs_per_rank):
    assert isinstance(loads, np.ndarray)
    assert loads.dtype == np.int32
    assert loads.shape == (ep_size, num_experts)
    assert loads.min() >= 0
    np.testing.assert_array_equal(loads.sum(axis=1), np.full(ep_size, pairs_per_rank))


# ----------------------------------------------------------------------------- metrics


def test_master_rank_loads_and_imbalance():
    loads = np.array([[1, 2, 3, 4], [0, 0, 5, 5]], dtype=np.int32)  # R=2, E=4: masters {0,1},{2,3}
    np.testing.assert_array_equal(workloads.master_rank_loads(loads), [3, 17])
    assert workloads.initial_imbalance(loads) == pytest.approx(17 / 10)
    assert workloads.initial_imbalance(np.ones((4, 8), np.int32)) == 1.0
    with pytest.raises(ValueError):
        workloads.initial_imbalance(np.zeros((2, 4), np.int32))
    with pytest.raises(ValueError):
        workloads.master_rank_loads(np.ones((3, 4), np.int32))


def test_home_ranks_and_imbalance_rules():
    """The home-rank rule and max / mean against hand-written values (E=6, R=3: masters {0, 1},
    {2, 3}, {4, 5})."""
    np.testing.assert_array_equal(ranks.home_ranks(6, 3), [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(ranks.masters_of_ranks(6, 3), [[0, 1], [2, 3], [4, 5]])
    loads = ranks.home_rank_loads(np.array([1, 2, 3, 4, 5, 6]), 3)
    np.testing.assert_array_equal(loads, [3, 7, 11])
    assert loads.dtype == np.int64
    assert ranks.home_rank_loads(np.array([0.5, 1.0, 0.0, 0.0, 2.0, 0.25]), 3).tolist() == [
        1.5,
        0.0,
        2.25,
    ]
    assert ranks.imbalance([3, 7, 11]) == pytest.approx(11 / 7)
    assert ranks.imbalance([0, 0]) == 1.0
    with pytest.raises(ValueError, match="not divisible"):
        ranks.home_ranks(5, 3)


# ----------------------------------------------------------------------------- rank Zipf


@pytest.mark.parametrize("target", [1.5, 2.0, 3.0])
def test_rank_zipf_hits_target(target):
    loads = workloads.rank_zipf_loads(R, E, T, K, target, seed=0)
    exponent = workloads.rank_zipf_exponent(R, T, K, target, seed=0)
    _check_matrix(loads, R, E, T * K)
    assert exponent > 0
    assert workloads.initial_imbalance(loads) == pytest.approx(target, rel=0.005)


@pytest.mark.parametrize("seed", [1, 2])
def test_rank_zipf_other_seeds_and_shapes(seed):
    loads = workloads.rank_zipf_loads(16, 64, 1024, 4, 2.5, seed)
    _check_matrix(loads, 16, 64, 1024 * 4)
    assert workloads.initial_imbalance(loads) == pytest.approx(2.5, rel=0.01)


def test_rank_zipf_deterministic():
    a = workloads.rank_zipf_loads(R, E, T, K, 2.0, seed=7)
    b = workloads.rank_zipf_loads(R, E, T, K, 2.0, seed=7)
    c = workloads.rank_zipf_loads(R, E, T, K, 2.0, seed=8)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_rank_zipf_rejects_bad_arguments():
    with pytest.raises(ValueError):
        workloads.rank_zipf_loads(64, 250, T, K, 2.0, 0)  # E % R != 0
    with pytest.raises(ValueError):
        workloads.rank_zipf_loads(8, 32, T, K, 0.5, 0)  # below 1
    with pytest.raises(ValueError):
        workloads.rank_zipf_loads(8, 32, T, K, 8.0, 0)  # not below R


def test_integer_arguments_follow_one_rule():
    """``ep_size`` follows the library's rule for integer arguments (`assert_integer_rule`; the
    library's and the model's: tests/library/test_robustness.py)."""
    assert_integer_rule("ep_size", lambda v: workloads.rank_zipf_exponent(v, 64, 2, 1.5, 0))


# ----------------------------------------------------------------------------- expert Zipf


def test_expert_zipf_shapes_and_determinism():
    a = drift.expert_zipf_loads(R, E, T, K, 1.0, seed=3)
    _check_matrix(a, R, E, T * K)
    np.testing.assert_array_equal(a, drift.expert_zipf_loads(R, E, T, K, 1.0, seed=3))
    assert not np.array_equal(a, drift.expert_zipf_loads(R, E, T, K, 1.0, seed=4))
    # Higher exponent, more skew; exponent 0 is nearly uniform.
    flat = drift.expert_zipf_loads(R, E, T, K, 0.0, seed=3)
    assert workloads.initial_imbalance(flat) < 1.05
    assert workloads.initial_imbalance(a) > workloads.initial_imbalance(flat)
    with pytest.raises(ValueError):
        drift.expert_zipf_loads(6, 256, T, K, 1.0, 0)


# ----------------------------------------------------------------------------- counts -> loads


def test_loads_from_expert_counts_preserves_totals():
    counts = np.arange(60, dtype=np.int64) ** 2  # includes a zero expert
    loads = workloads.loads_from_expert_counts(counts, 12, 1000, 4, seed=5)
    _check_matrix(loads, 12, 60, 4000)
    col = loads.sum(axis=0)
    assert col.sum() == 12 * 4000
    assert col[0] == 0
    exact = counts / counts.sum() * (12 * 4000)
    assert np.all(np.abs(col - exact) < 1.0)  # largest-remainder rounding
    np.testing.assert_array_equal(
        loads, workloads.loads_from_expert_counts(counts, 12, 1000, 4, seed=5)
    )
    assert not np.array_equal(
        loads, workloads.loads_from_expert_counts(counts, 12, 1000, 4, seed=6)
    )


def test_loads_from_expert_counts_rejects_indivisible():
    with pytest.raises(ValueError, match="not divisible"):
        workloads.loads_from_expert_counts(np.ones(60), 8, 100, 4, seed=0)
    with pytest.raises(ValueError):
        workloads.loads_from_expert_counts(np.zeros(64), 8, 100, 4, seed=0)
    with pytest.raises(ValueError):
        workloads.loads_from_expert_counts(-np.ones(64), 8, 100, 4, seed=0)


@settings(max_examples=30, deadline=None)
@given(
    counts=st.lists(st.integers(0, 10**6), min_size=8, max_size=8).filter(lambda c: sum(c) > 0),
    ep_size=st.sampled_from([1, 2, 4, 8]),
    tokens=st.integers(1, 300),
    top_k=st.integers(1, 8),
    seed=st.integers(0, 2**31),
)
def test_loads_from_expert_counts_property(counts, ep_size, tokens, top_k, seed):
    counts = np.asarray(counts * 4)  # E = 32
    loads = workloads.loads_from_expert_counts(counts, ep_size, tokens, top_k, seed)
    _check_matrix(loads, ep_size, 32, tokens * top_k)
    exact = counts / counts.sum() * (ep_size * tokens * top_k)
    assert np.all(np.abs(loads.sum(axis=0) - exact) < 1.0)


# ----------------------------------------------------------------------------- traces


def _write_deepseek(path, first_rows):
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 1000, size=(61, 256)).astype(float)
    counts[:3] = first_rows
    path.write_text(json.dumps({"logical_count": counts.tolist()}))
    return counts


def test_deepseek_loader_synthetic(tmp_path):
    good = _write_deepseek(tmp_path / "ok.json", 0.0)
    out = traces.deepseek_trace_expert_counts(tmp_path / "ok.json")
    assert out.shape == (58, 256)
    np.testing.assert_array_equal(out, good[3:])
    bad_rows = np.zeros((3, 256))
    bad_rows[1, 7] = 1.0
    _write_deepseek(tmp_path / "bad.json", bad_rows)
    with pytest.raises(ValueError, match="not constant"):
        traces.deepseek_trace_expert_counts(tmp_path / "bad.json")


@pytest.mark.usefixtures("needs_traces")
def test_deepseek_loader_drops_exactly_the_dense_layers():
    files = sorted((TRACES / "deepseek-r1").glob("*.json"))
    assert len(files) == 12
    for path in files:
        raw = np.asarray(json.loads(path.read_text())["logical_count"])
        assert raw.shape == (61, 256)
        constant = np.all(raw == raw[:, :1], axis=1)
        np.testing.assert_array_equal(np.flatnonzero(constant), [0, 1, 2])
        out = traces.deepseek_trace_expert_counts(path)
        assert out.shape == (58, 256)
        np.testing.assert_array_equal(out, raw[3:])


@pytest.mark.usefixtures("needs_traces")
def test_harmoeny_rows():
    qwen = traces.harmoeny_trace_rows(TRACES / "qwen1.5-moe/expert_freq_qwen_policy_datasets.csv")
    assert len(qwen) == 960
    meta, counts = qwen[0]
    assert meta == {"row": 0, "dataset": "bookcorpus", "iteration": 0, "layer": 0}
    assert counts.shape == (60,) and counts.dtype == np.int64
    skew = traces.harmoeny_trace_rows(TRACES / "switch-base-128/expert_freq_switch128_skew.csv")
    assert {m["router_skew"] for m, _ in skew} == {0.0, 0.5, 0.9}
    assert all(c.shape == (128,) for _, c in skew)


@pytest.mark.usefixtures("needs_traces")
@pytest.mark.parametrize(
    "name,ep_size,top_k",
    [("deepseek-r1", 64, 8), ("qwen1.5-moe", 12, 4), ("switch-base-128", 8, 1)],
)
def test_trace_workloads(name, ep_size, top_k):
    num_experts = traces.TRACE_NUM_EXPERTS[name]
    items = list(itertools.islice(traces.trace_workloads(name, ep_size, 512, top_k, 0), 3))
    assert len(items) == 3
    assert len({label for label, _ in items}) == 3
    for label, loads in items:
        assert label.startswith(name + "/") and "layer" in label
        _check_matrix(loads, ep_size, num_experts, 512 * top_k)
    again = list(itertools.islice(traces.trace_workloads(name, ep_size, 512, top_k, 0), 3))
    for (la, a), (lb, b) in zip(items, again, strict=True):
        assert la == lb
        np.testing.assert_array_equal(a, b)


@pytest.mark.usefixtures("needs_traces")
def test_trace_workloads_deepseek_count_and_labels():
    labels = [lab for lab, _ in traces.trace_workloads("deepseek-r1", 8, 16, 8, 0)]
    assert len(labels) == 12 * 58
    assert labels[0] == "deepseek-r1/decode_in1000out1000/layer03"
    assert labels[-1] == "deepseek-r1/prefill_in512/layer60"


@pytest.mark.usefixtures("needs_traces")
def test_trace_batch_is_every_stride_th_layer_at_the_traced_top_k():
    """The one reader of a trace as a batch [N, R, E] (bench.fanout, planner, planner.domains):
    the layers of `trace_workloads` at the traced model's own top-k, seed 0."""
    assert [traces.trace_top_k(n) for n in traces.TRACE_NAMES] == [
        traces.TRACE_TOP_K[n] for n in traces.TRACE_NAMES
    ]
    rows = list(traces.trace_workloads("qwen1.5-moe", 12, 16, traces.trace_top_k("qwen1.5-moe"), 0))
    batch = traces.trace_batch("qwen1.5-moe", 12, 16, 5)
    assert batch.shape == (-(-len(rows) // 5), 12, 60) and batch.dtype == np.int32
    np.testing.assert_array_equal(batch, np.stack([loads for _, loads in rows[::5]]))
    assert [label for label, _ in traces.trace_rows("qwen1.5-moe", 12, 16)] == [
        label for label, _ in rows
    ]


def test_trace_workloads_errors(tmp_path):
    with pytest.raises(ValueError, match="not divisible"):
        traces.trace_workloads("qwen1.5-moe", 8, 100, 4, 0)
    with pytest.raises(ValueError, match="unknown trace"):
        traces.trace_workloads("mixtral", 8, 100, 2, 0)
    with pytest.raises(FileNotFoundError):
        traces.trace_workloads("deepseek-r1", 8, 100, 8, 0, traces_dir=tmp_path / "nope")


# ----------------------------------------------------------------------------- trace folder


def test_the_repository_keeps_the_traces():
    vendored = CHECKOUT / "traces"
    readme = (vendored / "README.md").read_text()  # the attribution travels with the data
    assert "sacs-epfl/HarMoEny" in readme and "GeneratedRandomly/SGLang-reproduce" in readme
    assert len(sorted((vendored / "deepseek-r1").glob("*.json"))) == 12
    for name in traces.TRACE_NAMES:
        assert any((vendored / name).iterdir()), name
    shared = CHECKOUT.parent / "shared" / "traces"
    if shared.is_dir():  # the workspace's copy and the repository's hold the same data
        files = sorted(p.relative_to(shared) for p in shared.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(vendored) for p in vendored.rglob("*") if p.is_file())
        for rel in files:
            assert (shared / rel).read_bytes() == (vendored / rel).read_bytes(), rel


def test_traces_dir_prefers_the_shared_folder(tmp_path):
    checkout = tmp_path / "repo"
    (checkout / "traces").mkdir(parents=True)
    assert traces.traces_dir_for(checkout) == checkout / "traces"
    (tmp_path / "shared" / "traces").mkdir(parents=True)
    assert traces.traces_dir_for(checkout) == tmp_path / "shared" / "traces"
    assert traces.default_traces_dir().is_dir()


@pytest.mark.parametrize("value, fails", [("", False), ("0", False), ("1", True)])
def test_missing_traces_fail_when_required(monkeypatch, value, fails):
    monkeypatch.setenv(conftest.REQUIRE_TRACES_ENV, value)
    expected = pytest.fail.Exception if fails else pytest.skip.Exception
    with pytest.raises(expected, match="no traces here"):
        conftest.skip_without_traces("no traces here")
