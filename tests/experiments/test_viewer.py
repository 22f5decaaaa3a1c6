"""The load viewer (experiments/train/viewer.py): the page, the CLI, and the page in real Chromium.

The browser tests run Debian's ``chromium`` headless with ``--dump-dom`` (the DOM after the page's
scripts ran) and ``--enable-logging=stderr`` (console messages and uncaught errors appear on stderr
as ``CONSOLE`` lines). They are skipped, saying why, when no chromium binary is installed;
``.ci/run`` installs it.
"""

from __future__ import annotations

import html.parser
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from experiments.lab.records import read_loads
from experiments.train import viewer

# End-to-end runs of the programs (seconds to minutes each): `-m "not slow"` skips them.
# One test process builds the module fixture (pytest-xdist).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_viewer")]

REPO = pathlib.Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------------------------------
# A hand-made run: 4 ranks, 8 experts (expert e on rank e // 2), 2 layers, steps 10, 20, 30.
# --------------------------------------------------------------------------------------------

STEPS = (10, 20, 30)
# EXPERT[step][layer]: tokens per expert; AFTER[step][layer]: rank loads after balancing.
EXPERT = {
    10: ([5, 3, 1, 1, 2, 2, 1, 1], [1, 1, 1, 1, 1, 1, 10, 4]),
    20: ([9, 3, 1, 1, 1, 1, 1, 1], [3, 1, 2, 2, 2, 2, 2, 2]),
    30: ([2, 2, 2, 2, 6, 2, 1, 1], [1, 1, 1, 1, 12, 0, 1, 3]),
}
AFTER = {
    10: ([4, 4, 4, 4], [5, 5, 5, 5]),
    20: ([5, 4, 4, 5], [4, 4, 4, 4]),
    30: ([5, 5, 4, 4], [6, 5, 5, 4]),
}
REPLICAS = {10: (2, 4), 20: (3, 0), 30: (1, 3)}
DROPPED = {10: (0, 0), 20: (0, 0), 30: (0, 2)}
# The replica transfer's largest per-rank send, bytes (MoEStats.transfer_send_max).
SEND = {10: (88_080_384, 176_160_768), 20: (264_241_152, 0), 30: (88_080_384, 1_500_000)}

# The summaries, computed by hand from the numbers above (max/mean of the rank loads):
#   step 30, layer 0: before [4, 4, 8, 2] -> 8 / 4.5 = 1.78; after [5, 5, 4, 4] -> 5 / 4.5 = 1.11
#   step 10, layer 1: before [2, 2, 2, 14] -> 14 / 5 = 2.80; after [5, 5, 5, 5] -> 1.00
#   step 30, layer 1: before [2, 2, 12, 4] -> 12 / 5 = 2.40; after [6, 5, 5, 4] -> 6 / 5 = 1.20
#   step 20, layer 0: before [12, 2, 2, 2] -> 12 / 4.5 = 2.67; after [5, 4, 4, 5] -> 1.11
DEFAULT_SUMMARY = "step 30, layer 0: max/mean 1.78 -> 1.11, replicas 1, dropped 0"
STEP10_LAYER1 = "step 10, layer 1: max/mean 2.80 -> 1.00, replicas 4, dropped 0"
STEP30_LAYER1 = "step 30, layer 1: max/mean 2.40 -> 1.20, replicas 3, dropped 2"
STEP20_LAYER0 = "step 20, layer 0: max/mean 2.67 -> 1.11, replicas 3, dropped 0"


def _rank_loads(expert_load: list[int], num_ranks: int = 4) -> list[int]:
    per = len(expert_load) // num_ranks
    return [sum(expert_load[r * per : (r + 1) * per]) for r in range(num_ranks)]


def _max_over_mean(loads: list[int]) -> float:
    return round(max(loads) / (sum(loads) / len(loads)), 5)


def make_records() -> tuple[list[dict], list[dict]]:
    """(metrics records, load records) of the hand-made run, as the trainer writes them."""
    metrics, loads = [], []
    for step in STEPS:
        before = [_rank_loads(e) for e in EXPERT[step]]
        metrics.append(
            {
                "step": step,
                "balance": "ultraep",
                "loss": 5.0 - step / 100,
                "imbalance_before": [_max_over_mean(b) for b in before],
                "imbalance_after": [_max_over_mean(a) for a in AFTER[step]],
                "dropped": list(DROPPED[step]),
                "replicas": list(REPLICAS[step]),
                "transfer_send_max": list(SEND[step]),
                "step_time": 0.5,
                "tokens_per_s": 512.0,
            }
        )
        loads.append(
            {
                "step": step,
                "layers": [
                    {
                        "expert_load": EXPERT[step][layer],
                        "rank_load_before": before[layer],
                        "rank_load_after": AFTER[step][layer],
                        "replicas": REPLICAS[step][layer],
                        "dropped": DROPPED[step][layer],
                    }
                    for layer in range(2)
                ],
            }
        )
    return metrics, loads


def write_run(workdir: pathlib.Path, with_loads: bool = True) -> pathlib.Path:
    metrics, loads = make_records()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    if with_loads:
        (workdir / "loads.jsonl").write_text("".join(json.dumps(r) + "\n" for r in loads))
    return workdir


def test_hand_computed_numbers_match_the_records():
    metrics, _ = make_records()
    by_step = {r["step"]: r for r in metrics}
    assert by_step[30]["imbalance_before"][0] == pytest.approx(8 / 4.5, abs=1e-5)
    assert by_step[10]["imbalance_before"][1] == pytest.approx(2.8)
    assert by_step[30]["imbalance_after"][1] == pytest.approx(1.2)


# --------------------------------------------------------------------------------------------
# The HTML, without a browser
# --------------------------------------------------------------------------------------------

_URL = re.compile(r"https?://[^\s\"'<>)]*", re.IGNORECASE)
# The SVG namespace is an identifier that createElementNS needs; the browser never fetches it.
_NAMESPACES = {"http://www.w3.org/2000/svg"}


def test_page_is_self_contained():
    metrics, loads = make_records()
    page = viewer.build_html(metrics, loads)
    assert page.startswith("<!DOCTYPE html>")
    # No resource is loaded from anywhere: no src/href/url()/@import to a URL, no external script.
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.IGNORECASE)
    assert not re.search(r"""url\(\s*["']?\s*(https?:)?//""", page, re.IGNORECASE)
    assert "@import" not in page
    assert "<link" not in page.lower()
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, re.IGNORECASE)
    assert set(_URL.findall(page)) <= _NAMESPACES
    # The data is embedded, and the page's stylesheet and script are inlined whole.
    assert '<script id="viewer-data" type="application/json">' in page
    static = REPO / "experiments" / "train" / "static"
    assert f"<style>\n{(static / 'viewer.css').read_text()}</style>" in page
    assert f"<script>\n{(static / 'viewer.js').read_text()}</script>" in page


def test_embedded_data_is_strict_json_and_script_safe():
    metrics, loads = make_records()
    metrics[0]["imbalance_before"] = [float("nan"), float("inf")]
    metrics[-1]["balance"] = "</script><b>x</b>"  # the page takes the last record's mode
    page = viewer.build_html(metrics, loads)
    blob = re.search(
        r'<script id="viewer-data" type="application/json">(.*?)</script>', page, re.DOTALL
    )
    data = json.loads(blob.group(1), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    assert data["layers"][0][0]["ib"] is None and data["layers"][0][1]["ib"] is None
    assert data["balance"] == "</script><b>x</b>"
    assert "</script><b>" not in page
    assert "<title>Expert loads (&lt;/script&gt;&lt;b&gt;x&lt;/b&gt;)</title>" in page
    assert data["steps"] == list(STEPS) and data["numLayers"] == 2 and data["hasLoads"]


def test_build_html_needs_records():
    with pytest.raises(ValueError):
        viewer.build_html([], [])


def test_read_loads_ignores_a_truncated_last_line_and_keeps_the_last_of_a_step(tmp_path):
    path = tmp_path / "loads.jsonl"
    path.write_text(
        '{"step": 2, "layers": [{"replicas": 1}]}\n'
        '{"step": 1, "layers": []}\n'
        '{"step": 2, "layers": [{"replicas": 7}]}\n'
        '{"step": 3, "lay'
    )
    records = read_loads(path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[1]["layers"][0]["replicas"] == 7


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "experiments.train.viewer", *args],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_writes_the_page(tmp_path):
    workdir = write_run(tmp_path / "run")
    done = _run_cli(f"--workdir={workdir}")
    assert done.returncode == 0, done.stderr
    page = (workdir / "viewer.html").read_text()
    assert '"hasLoads":true' in page
    out = tmp_path / "elsewhere" / "v.html"
    assert _run_cli(f"--workdir={workdir}", f"--out={out}").returncode == 0
    assert out.read_text() == page


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_cli_without_metrics_is_one_line_exit_2(tmp_path, make):
    workdir = tmp_path / "run"
    if make == "empty":
        workdir.mkdir()
    done = _run_cli(f"--workdir={workdir}")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("viewer: no metrics.jsonl in ")
    assert not (workdir / "viewer.html").exists()


def test_cli_with_a_malformed_metrics_file_is_one_line_exit_2(tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "loss": 1}\n')
    done = _run_cli(f"--workdir={workdir}")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# The page in headless Chromium
# --------------------------------------------------------------------------------------------


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


CHROMIUM = _chromium()
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium binary (install Debian's: apt-get install -y chromium; .ci/run does)",
)

_CONSOLE = re.compile(r"\bCONSOLE\b.*$", re.MULTILINE)


def dump_dom(page: pathlib.Path, tmp_path: pathlib.Path, query: str = "") -> tuple[str, list[str]]:
    """(the DOM after the page's scripts ran, the console lines Chromium logged)."""
    profile = tmp_path / f"chromium-profile-{len(list(tmp_path.glob('chromium-profile-*')))}"
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--no-first-run",
            "--no-default-browser-check",
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            "--dump-dom",
            page.resolve().as_uri() + query,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "<html" in done.stdout, done.stderr[-3000:]
    return done.stdout, _CONSOLE.findall(done.stderr)


class _Elements(html.parser.HTMLParser):
    """Text and attributes of every element with an id."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.text: dict[str, str] = {}
        self.attrs: dict[str, dict] = {}
        self._open: list[tuple[str, str | None]] = []

    _VOID = frozenset({"input", "br", "img", "meta", "link", "hr", "col", "source", "wbr"})

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.attrs[attrs["id"]] = attrs
            self.text.setdefault(attrs["id"], "")
        if tag not in self._VOID:
            self._open.append((tag, attrs.get("id")))

    def handle_endtag(self, tag):
        while self._open:
            open_tag, _ = self._open.pop()
            if open_tag == tag:
                break

    def handle_data(self, data):
        for _, element_id in self._open:
            if element_id is not None:
                self.text[element_id] += data


def elements(dom: str) -> _Elements:
    parsed = _Elements()
    parsed.feed(dom)
    return parsed


def _assert_clean(dom: str, console: list[str]):
    assert console == [], "console output:\n" + "\n".join(console)
    assert 'data-ready="1"' in dom, "the page script did not run to the end"
    html_tag = re.search(r"<html[^>]*>", dom).group(0)
    assert "data-error" not in html_tag, html_tag  # set by the page's window error handler


@needs_chromium
def test_console_errors_are_detected(tmp_path):
    """The check below is not vacuous: a throwing page shows up as a CONSOLE line."""
    page = tmp_path / "bad.html"
    page.write_text(
        "<!DOCTYPE html><html><body><script>notDefinedAnywhere();</script></body></html>"
    )
    _, console = dump_dom(page, tmp_path)
    assert any("Uncaught" in line and "notDefinedAnywhere" in line for line in console), console


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> pathlib.Path:
    metrics, loads = make_records()
    path = tmp_path_factory.mktemp("viewer") / "viewer.html"
    path.write_text(viewer.build_html(metrics, loads), encoding="utf-8")
    return path


@needs_chromium
def test_default_selection_shows_the_last_step_layer_0(page, tmp_path):
    dom, console = dump_dom(page, tmp_path)
    _assert_clean(dom, console)
    el = elements(dom)
    assert el.text["summary"] == DEFAULT_SUMMARY
    assert el.text["imbalance-before"] == "1.78"
    assert el.text["imbalance-after"] == "1.11"
    assert el.text["replicas"] == "1"
    assert el.text["dropped"] == "0"
    assert el.text["step-label"] == "step 30 (3 of 3)"
    # Per-rank loads as text (step 30, layer 0).
    assert [el.text[f"rank-before-{r}"] for r in range(4)] == ["4", "4", "8", "2"]
    assert [el.text[f"rank-after-{r}"] for r in range(4)] == ["5", "5", "4", "4"]
    # Charts were drawn: 4 ranks x 2 masters = 8 stacked segments, and both imbalance lines.
    assert dom.count('class="before-seg"') == 8
    assert 'class="series-before"' in dom and 'class="series-after"' in dom
    assert "hidden" in el.attrs["no-loads"]
    # Every layer at step 30.
    layers = el.text["layer-table"]
    assert "1.78" in layers and "2.40" in layers and "1.20" in layers


@needs_chromium
def test_url_parameters_pick_step_and_layer(page, tmp_path):
    dom, console = dump_dom(page, tmp_path, "?step=10&layer=1")
    _assert_clean(dom, console)
    el = elements(dom)
    assert el.text["summary"] == STEP10_LAYER1
    assert [el.text[f"rank-before-{r}"] for r in range(4)] == ["2", "2", "2", "14"]
    assert el.text["step-label"] == "step 10 (1 of 3)"
    # Unknown selections fall back to the default.
    dom, console = dump_dom(page, tmp_path, "?step=999&layer=7")
    _assert_clean(dom, console)
    assert elements(dom).text["summary"] == DEFAULT_SUMMARY


@needs_chromium
def test_controls_update_the_text(page, tmp_path):
    """Drives the real layer <select> and step slider with DOM events, then the prev button."""
    driver = """
<script>
(function () {
  var out = [];
  var layer = document.getElementById("layer"), step = document.getElementById("step");
  layer.value = "1"; layer.dispatchEvent(new Event("change"));
  out.push(document.getElementById("summary").textContent);
  step.value = "1"; step.dispatchEvent(new Event("input"));
  layer.value = "0"; layer.dispatchEvent(new Event("change"));
  out.push(document.getElementById("summary").textContent);
  document.getElementById("next").click();
  out.push(document.getElementById("summary").textContent);
  out.push(document.getElementById("rank-after-0").textContent);
  var pre = document.createElement("pre");
  pre.id = "driven";
  pre.textContent = out.join("\\n");
  document.body.appendChild(pre);
})();
</script>
"""
    driven = tmp_path / "driven.html"
    driven.write_text(page.read_text().replace("</body>", driver + "</body>"), encoding="utf-8")
    dom, console = dump_dom(driven, tmp_path)
    _assert_clean(dom, console)
    lines = elements(dom).text["driven"].splitlines()
    assert lines == [STEP30_LAYER1, STEP20_LAYER0, DEFAULT_SUMMARY, "5"]


@needs_chromium
def test_metrics_only_page_shows_imbalance_and_says_loads_need_profiling(tmp_path):
    workdir = write_run(tmp_path / "run", with_loads=False)
    out = viewer.write_viewer(workdir)
    dom, console = dump_dom(out, tmp_path, "?step=30&layer=1")
    _assert_clean(dom, console)
    el = elements(dom)
    assert el.text["summary"] == STEP30_LAYER1
    assert "hidden" not in el.attrs["no-loads"]
    assert "--profile_loads" in el.text["no-loads"]
    assert 'class="before-seg"' not in dom and 'id="rank-before-0"' not in dom
    assert 'class="series-before"' in dom  # imbalance over steps still drawn


@needs_chromium
def test_largest_transfer_send_per_layer(page, tmp_path):
    """The selected layer's send in #transfer-send-max and every layer's in the layer table."""
    dom, console = dump_dom(page, tmp_path, "?step=10&layer=1")
    _assert_clean(dom, console)
    el = elements(dom)
    assert el.text["transfer-send-max"] == "176.16 MB"
    assert "88.08 MB" in el.text["layer-table"] and "176.16 MB" in el.text["layer-table"]
    dom, console = dump_dom(page, tmp_path, "?step=30&layer=1")
    _assert_clean(dom, console)
    assert elements(dom).text["transfer-send-max"] == "1.50 MB"
