"""The byte-level corpus (experiments/lab/training/data.py) and the metrics plot and summary
(experiments/train/plot.py).

Expected values are computed here independently: file lists with os.listdir/sysconfig, batches as
plain Python slices of the corpus bytes, summary statistics with NumPy over the synthetic records.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sysconfig

import numpy as np
import pytest

from experiments.lab.records import read_metrics
from experiments.lab.training import data as D
from experiments.train import plot as P
from tests.helpers import assert_integer_rule

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def default_files() -> list[pathlib.Path]:
    return D.corpus_files(None)


# --------------------------------------------------------------------------------------------
# corpus_files
# --------------------------------------------------------------------------------------------


def test_default_corpus_is_the_stdlib_py_files_sorted(default_files):
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert len(default_files) > 100
    rel = [p.resolve().relative_to(stdlib).as_posix() for p in default_files]
    assert rel == sorted(rel)
    assert len(set(rel)) == len(rel)
    for r in rel:
        parts = r.split("/")
        assert parts[-1].endswith(".py")
        assert not {"site-packages", "dist-packages", "__pycache__"} & set(parts), r
    # Well-known stdlib modules are in; top-level .py files match a plain listdir.
    assert "os.py" in rel and "json/__init__.py" in rel
    top = sorted(n for n in os.listdir(stdlib) if n.endswith(".py") and os.path.isfile(stdlib / n))
    assert [r for r in rel if "/" not in r] == top
    # Deterministic.
    assert D.corpus_files(None) == default_files


def test_corpus_files_file_directory_glob(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("z")
    (tmp_path / "b" / "a.md").write_text("a")
    (tmp_path / "c.txt").write_text("c")
    (tmp_path / "a.txt").write_text("a")

    assert D.corpus_files(str(tmp_path / "c.txt")) == [tmp_path / "c.txt"]
    want_dir = ["a.txt", "b/a.md", "b/z.txt", "c.txt"]
    assert D.corpus_files(str(tmp_path)) == [tmp_path / r for r in want_dir]
    assert D.corpus_files(str(tmp_path / "*.txt")) == [tmp_path / "a.txt", tmp_path / "c.txt"]
    assert D.corpus_files(str(tmp_path / "**" / "*.txt")) == [
        tmp_path / "a.txt",
        tmp_path / "b" / "z.txt",
        tmp_path / "c.txt",
    ]


@pytest.mark.parametrize("kind", ["missing", "glob", "empty_dir"])
def test_bad_data_raises_value_error_naming_it(tmp_path, kind):
    if kind == "missing":
        arg = str(tmp_path / "no_such_file.txt")
    elif kind == "glob":
        arg = str(tmp_path / "*.nothing")
    else:
        (tmp_path / "empty").mkdir()
        arg = str(tmp_path / "empty")
    with pytest.raises(ValueError) as info:
        D.corpus_files(arg)
    message = str(info.value)
    assert arg in message and "\n" not in message


# --------------------------------------------------------------------------------------------
# load_corpus / split_corpus
# --------------------------------------------------------------------------------------------


def test_load_corpus_concatenates_in_order_and_caps(tmp_path):
    paths = []
    for name, text in [("1", b"hello"), ("2", b""), ("3", b"world!"), ("4", b"xyz")]:
        (tmp_path / name).write_bytes(text)
        paths.append(tmp_path / name)
    full = b"hello\nworld!\nxyz"
    corpus = D.load_corpus(paths, None)
    assert corpus.dtype == np.uint8 and corpus.tobytes() == full
    for cap in [1, 5, 6, 7, 12, 13, len(full), 100]:
        assert D.load_corpus(paths, cap).tobytes() == full[:cap]
    with pytest.raises(ValueError):
        D.load_corpus([tmp_path / "2"], 10)


def test_load_corpus_default_prefix_matches_first_files(default_files):
    cap = 200_000
    corpus = D.load_corpus(default_files, cap)
    want = b"\n".join(p.read_bytes() for p in default_files[:200] if p.stat().st_size)[:cap]
    assert corpus.size == cap and corpus.tobytes() == want


def test_split_corpus_eval_is_the_tail():
    corpus = np.arange(1000, dtype=np.int64).astype(np.uint8)
    train, held = D.split_corpus(corpus, 0.1)
    assert held.size == 100 and train.size == 900
    np.testing.assert_array_equal(held, corpus[900:])
    np.testing.assert_array_equal(train, corpus[:900])
    # At least one sequence of seq_len + 1 bytes.
    train, held = D.split_corpus(corpus, 0.001, seq_len=63)
    assert held.size == 64 and train.size == 936
    with pytest.raises(ValueError):
        D.split_corpus(corpus[:100], 0.5, seq_len=63)
    with pytest.raises(ValueError):
        D.split_corpus(corpus, 0.0)


def test_train_and_eval_are_disjoint_positions():
    corpus = np.arange(5000) % 251
    train, held = D.split_corpus(corpus.astype(np.uint8), 0.2, seq_len=16)
    assert train.size + held.size == corpus.size
    # Every byte a train batch reads lies in the train slice: positions < train.size.
    for step in range(0, 40, 7):
        batch = D.train_batch(train, step, 4, 16)
        start = step * 4 * 16
        idx = [(start + i * 16 + j) % train.size for i in range(4) for j in range(17)]
        assert max(idx) < train.size
        np.testing.assert_array_equal(batch.ravel(), corpus[idx])


# --------------------------------------------------------------------------------------------
# train_batch / eval_batches
# --------------------------------------------------------------------------------------------


def test_train_batch_windows_are_contiguous_slices():
    rng = np.random.default_rng(0)
    train = rng.integers(0, 256, size=10_000, dtype=np.uint8)
    data = train.tobytes()
    batch_size, seq_len = 4, 32
    stream = []
    for step in range(5):
        batch = D.train_batch(train, step, batch_size, seq_len)
        assert batch.shape == (batch_size, seq_len + 1) and batch.dtype == np.int32
        np.testing.assert_array_equal(batch, D.train_batch(train, step, batch_size, seq_len))
        for i in range(batch_size):
            offset = (step * batch_size + i) * seq_len
            assert bytes(batch[i].astype(np.uint8)) == data[offset : offset + seq_len + 1]
            # Consecutive windows overlap by one byte: the targets tile the corpus.
            stream.append(bytes(batch[i, 1:].astype(np.uint8)))
    assert b"".join(stream) == data[1 : 1 + 5 * batch_size * seq_len]


def test_train_batch_wraps_around():
    train = np.frombuffer(b"abcdefghij", dtype=np.uint8)  # 10 bytes
    batch = D.train_batch(train, 3, 2, 4)  # starts at 3 * 2 * 4 = 24 -> 4
    rows = [bytes(r.astype(np.uint8)) for r in batch]
    assert rows == [b"efghi", b"ijabc"]
    huge = D.train_batch(train, 10**15 + 1, 2, 4)  # no overflow: offset 8 * (10**15 + 1) % 10 = 8
    assert [bytes(r.astype(np.uint8)) for r in huge] == [b"ijabc", b"cdefg"]
    with pytest.raises(ValueError):
        D.train_batch(train[:4], 0, 1, 4)


def test_integer_arguments_follow_one_rule():
    """``batch_size`` follows the library's rule for integer arguments (`assert_integer_rule`;
    the library's and the model's: tests/library/test_robustness.py)."""
    assert_integer_rule("batch_size", lambda v: D.train_batch(np.zeros(64, np.uint8), 0, v, 4))


def test_eval_batches_cover_the_slice_from_its_start():
    held = (np.arange(1000) % 256).astype(np.uint8)
    batches = D.eval_batches(held, 3, 9, max_batches=100)  # 100 windows of 10 -> 33 batches
    assert len(batches) == 33
    for b, batch in enumerate(batches):
        assert batch.shape == (3, 10) and batch.dtype == np.int32
        for i in range(3):
            w = b * 3 + i
            np.testing.assert_array_equal(batch[i], held[w * 10 : (w + 1) * 10])
    assert len(D.eval_batches(held, 3, 9, max_batches=5)) == 5
    # Fewer windows than one batch: one batch, windows reused from the start.
    (small,) = D.eval_batches(held[:25], 4, 9, max_batches=3)
    np.testing.assert_array_equal(small, np.stack([held[0:10], held[10:20]] * 2))


# --------------------------------------------------------------------------------------------
# plot_metrics / summarize
# --------------------------------------------------------------------------------------------


def _synthetic_metrics(path: pathlib.Path) -> list[dict]:
    records = []
    for t, step in enumerate([1, 10, 20, 30]):
        record = {
            "step": step,
            "loss": 5.5 - 0.75 * t,
            "imbalance_before": [1.5 + 0.25 * t, 2.0 - 0.125 * t],
            "imbalance_after": [1.0 + 0.01 * t, 1.02],
            "balance": "ultraep",
            "dropped": [t, 2 * t],
            "tokens_per_s": 1000.0 * (t + 1),
            "step_time": 0.25 * (t + 1),
        }
        if step in (10, 30):
            record["eval_loss"] = 6.0 - 0.5 * t
        records.append(record)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def test_plot_metrics_writes_png(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    _synthetic_metrics(metrics)
    png = tmp_path / "out" / "plot.png"
    assert P.plot_metrics(metrics, png) == png
    blob = png.read_bytes()
    assert len(blob) > 1000 and blob[:8] == PNG_SIGNATURE


def test_marker_indices_never_mark_one_point_for_two_layers():
    assert list(P.marker_indices(6, 2, 0)) == [0, 2, 4]
    assert list(P.marker_indices(6, 2, 1)) == [1, 3, 5]
    for steps, layers in ((200, 2), (200, 3), (50, 24), (7, 1)):
        marked = [set(P.marker_indices(steps, layers, layer).tolist()) for layer in range(layers)]
        assert sum(map(len, marked)) == len(set().union(*marked))  # disjoint
        assert all(i < steps for m in marked for i in m)
        assert all(len(m) >= min(10, steps // layers) for m in marked), (steps, layers)


def test_plot_shows_both_layers_after_balancing_where_they_coincide():
    """Both layers balanced to 1.01 used to draw one line over the other (and over 1.0)."""
    records = [
        {"step": s, "loss": 3.0, "imbalance_before": [2.0, 4.0], "imbalance_after": [1.01, 1.01]}
        for s in range(1, 201)
    ]
    fig = P.metrics_figure(records)
    assert len(fig.axes) == 3
    zoomed = fig.axes[2]
    lines = [line for line in zoomed.get_lines() if len(line.get_xdata()) == len(records)]
    assert len(lines) == 2 and lines[0].get_marker() != lines[1].get_marker()
    marked = [set(np.asarray(line.get_xdata())[line.get_markevery()]) for line in lines]
    assert len(marked[0]) >= 10 and len(marked[1]) >= 10 and not marked[0] & marked[1]
    lo, hi = zoomed.get_ylim()  # 1.0 and 1.01 far apart on the zoomed axis
    assert lo < 1.0 < 1.01 < hi and hi - lo < 0.02


def test_plot_metrics_without_optional_keys(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 0, "loss": 3.0}\n{"step": 5, "loss": 2.0}\n{"step": 9, "lo')
    png = P.plot_metrics(metrics, tmp_path / "p.png")
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    assert "2 logged" in P.summarize(metrics)


def test_summarize_reports_the_numbers(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = _synthetic_metrics(metrics)
    text = P.summarize(metrics)
    assert "ultraep" in text and "4 logged" in text
    assert f"{records[0]['loss']:.4f}" in text and f"{records[-1]['loss']:.4f}" in text
    assert f"{records[-1]['eval_loss']:.4f}" in text  # last eval loss: 4.5
    for key in ("imbalance_before", "imbalance_after"):
        table = np.array([r[key] for r in records])
        for layer in range(table.shape[1]):
            assert f"{table[:, layer].mean():.3f}" in text
            assert f"{table[:, layer].max():.3f}" in text
    total_dropped = sum(sum(r["dropped"]) for r in records)  # 0 + 3 + 6 + 9
    assert f"dropped pairs: {total_dropped}" in text  # (token, choice) pairs, not tokens
    # Medians over the steps after the first, whose time includes compiling the step.
    median_tps = np.median([r["tokens_per_s"] for r in records[1:]])  # 3000.0
    assert f"tokens/s: median {median_tps:.1f} over 3 steps" in text
    median_ms = 1e3 * np.median([r["step_time"] for r in records[1:]])  # 750.00
    assert f"step time: median {median_ms:.2f} ms" in text
    assert len(text.splitlines()) >= 6 and not math.isnan(median_tps)


def test_summarize_leaves_out_each_starts_compiling_step(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = []
    for step in range(1, 7):  # a run of steps 1-3 resumed for steps 4-6
        record = {"step": step, "loss": 1.0, "tokens_per_s": 100.0 * step, "step_time": step / 8}
        if step in (1, 4):
            record["compiling"] = True
        records.append(record)
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    text = P.summarize(metrics)
    # steps 2, 3, 5, 6: tokens/s 200, 300, 500, 600 -> 400; step time 0.25 .. 0.75 s -> 500 ms
    assert "tokens/s: median 400.0 over 4 steps (left out: steps 1, 4, compiling)" in text
    assert "step time: median 500.00 ms" in text
    assert [r["step"] for r in P.timed_records(read_metrics(metrics))] == [2, 3, 5, 6]

    metrics.write_text("".join(json.dumps(r) + "\n" for r in records[:2]))  # a two-step run
    text = P.summarize(metrics)
    assert "tokens/s: median 200.0 over 1 step (left out: step 1, compiling)" in text

    metrics.write_text(json.dumps(records[0]) + "\n")  # a one-step run
    text = P.summarize(metrics)
    assert "tokens/s, step time: no timed step (left out: step 1, compiling)" in text
    assert "median" not in text


def test_resumed_run_relogging_a_step_keeps_the_last_record(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "loss": 3.0}, {"step": 5, "loss": 9.0}, {"step": 5, "loss": 2.5}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    records = read_metrics(metrics)
    assert [r["loss"] for r in records] == [3.0, 2.5]
