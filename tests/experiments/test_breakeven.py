"""The break-even report (`experiments.bench.breakeven_report`) on made-up points: the break-even
found by hand, the table's lines and ratios, and a PNG written with one panel per mode and
skew."""

from __future__ import annotations

import struct

import pytest

from experiments.bench import breakeven_report as report


def _point(mode, skew, tokens, balanced, dropless, capped, dropped=0):
    return {
        "mode": mode,
        "skew": skew,
        "tokens": tokens,
        "balanced_ms": balanced,
        "dropless_ms": dropless,
        "capped_ms": capped,
        "capped_dropped": dropped,
    }


# train, skew 3: balanced loses below 256 tokens per rank to plain dropless, below 1024 to
# plain@1.05; prefill, skew 0: it never catches plain@1.05 at the largest count.
POINTS = [
    _point("train", 3.0, 1024, 9.0, 14.0, 9.0, 40),
    _point("train", 3.0, 64, 2.0, 1.5, 1.4, 3),
    _point("train", 3.0, 256, 3.0, 3.0, 2.5, 9),
    _point("train", 3.0, 512, 5.0, 6.0, 5.5, 20),
    _point("prefill", 0.0, 64, 1.0, 0.9, 0.8),
    _point("prefill", 0.0, 512, 2.0, 2.5, 1.9),
]


def test_break_even_by_hand():
    train = [p for p in POINTS if p["mode"] == "train"]
    prefill = [p for p in POINTS if p["mode"] == "prefill"]
    assert report.break_even(train, "dropless_ms") == 256  # equal time counts as no slower
    assert report.break_even(train, "capped_ms") == 512  # 5.0 < 5.5 at 512, 9.0 == 9.0 at 1024
    assert report.break_even(prefill, "dropless_ms") == 512
    assert report.break_even(prefill, "capped_ms") is None


def test_break_even_needs_every_larger_count():
    # Slower again at 256 after winning at 128: the break-even is above 256.
    ps = [_point("t", 0, 64, 1, 2, 2), _point("t", 0, 128, 1, 2, 2), _point("t", 0, 256, 3, 2, 2)]
    ps.append(_point("t", 0, 512, 1, 2, 2))
    assert report.break_even(ps, "dropless_ms") == 512


def test_table_lines_and_ratios():
    text = report.table(POINTS)
    lines = text.splitlines()
    assert "balanced@1.05" in lines[0] and "bal/plain@1.05" in lines[0]
    train = [line for line in lines if line.split()[:1] == ["train"]]
    assert [int(line.split()[2]) for line in train] == [64, 256, 512, 1024]  # sorted by tokens
    fields = train[0].split()
    assert fields[1] == "3"
    assert float(fields[9]) == pytest.approx(2.0 / 1.5, abs=1e-3)  # bal/dropless
    assert float(fields[10]) == pytest.approx(2.0 / 1.4, abs=1e-3)  # bal/plain@1.05
    assert int(fields[11]) == 3
    assert fields[12] == "-"  # no no-replica measurement at this point
    assert any(line.split()[:2] == ["prefill", "none"] for line in lines)
    assert "train, skew    3: than plain dropless from 256; than plain@1.05 from 512" in text
    assert "prefill, skew none: than plain dropless from 512; than plain@1.05 from never" in text


def test_table_no_replica_ratio():
    p = _point("train", 0.0, 64, 2.0, 1.6, 1.5) | {"no_replica_ms": 2.0}
    row = report.table([p]).splitlines()[1].split()
    assert float(row[12]) == pytest.approx(2.0 / 1.6, abs=1e-3)


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "breakeven.png"
    report.plot(POINTS, path, title="made-up numbers")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    # Two modes (rows) and two skews (columns): about 8.4 x 6.4 inches at 110 dpi.
    assert abs(width - 8.4 * 110) < 30 and abs(height - 6.4 * 110) < 30
