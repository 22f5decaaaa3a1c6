"""Every ```python block of docs/usage.md and docs/integration.md runs as written (in a fresh
interpreter, as a user would paste it, with the tests' quick-compile XLA flags beside the 8 devices
the blocks ask for) and prints what the page says it prints; the README's test command is the one
CI runs; the documentation's relative links lead to files and headings that exist (docs/results/
included); README is at most 8 KiB, defines its words before it uses them, holds no timing or
commit id in its set-up, and its results table has at most 6 rows, each naming its scope in one
clause (`tests/doc_checks.py`, each check shown to catch a bad string)."""

import pathlib
import re
import subprocess
import sys

import pytest

from tests import doc_checks
from tests.xla_settings import fast_compile_flags, program_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The programs README's set-up points to (moved from README's Use section).
USAGE = ROOT / "docs" / "usage.md"
PAGES = (USAGE, ROOT / "docs" / "integration.md")
#: The devices every block asks for (`os.environ.setdefault("XLA_FLAGS", ...)`): set here with
#: the quick-compile flags, the blocks' own line keeps them.
BLOCK_DEVICES = "--xla_force_host_platform_device_count=8"
#: ``(code, output or None)`` of every block (`doc_checks.python_blocks`).
BLOCKS = [b for page in PAGES for b in doc_checks.python_blocks(page.read_text())]
#: README's most bytes, and its results table's most rows.
README_MAX_BYTES = 8192
RESULTS_MAX_ROWS = 6


def test_readme_has_python_blocks():
    """The four programs that were README's (the planner, the layer, your own router, a Hugging
    Face block) are docs/usage.md's, each with the output it prints."""
    usage = doc_checks.python_blocks(USAGE.read_text())
    assert len(usage) == 4 and all(output for _, output in usage), usage
    assert len(BLOCKS) >= 4


@pytest.mark.every_case  # --suite=quick (conftest.py): each is a program users copy, on any JAX
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path):
    code, output = BLOCKS[index]
    script = tmp_path / f"block{index}.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=README.parent,
        capture_output=True,
        text=True,
        timeout=600,
        env=program_env(XLA_FLAGS=f"{BLOCK_DEVICES} {fast_compile_flags()}".strip()),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if output is not None:
        assert proc.stdout == output, (proc.stdout, output)


def test_readme_test_command_is_cis():
    """.ci/run runs the README's test command: one line of each, the same text."""
    ci = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()]
    ci_cmds = [l for l in ci if l.startswith("pip install") and "pytest" in l]
    readme = [l.strip() for l in README.read_text().splitlines() if l.startswith("    pip install")]
    readme_cmds = [l for l in readme if "pytest" in l]
    assert len(ci_cmds) == 1, ci_cmds
    assert readme_cmds == ci_cmds


#: The markdown pages whose links are checked: every tracked page but the vendored traces' data.
DOC_PAGES = [
    README,
    ROOT / "CHANGELOG.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "ffi").glob("*.md")),
    *sorted((ROOT / "experiments").rglob("*.md")),
    ROOT / "traces" / "README.md",
]
#: The longest a cell of README's results table may be, as written (a link's target included).
HEADLINE_CELL_CHARS = 200


def test_doc_links_exist():
    """Every relative link of the pages names an existing file and, with a ``#fragment``, a
    heading of that file by GitHub's anchor rules (a link to a renamed heading lands at the top
    of the page on GitHub, silently)."""
    assert ROOT / "docs" / "results" / "README.md" in DOC_PAGES and USAGE in DOC_PAGES
    broken = [f"{p.relative_to(ROOT)}: {b}" for p in DOC_PAGES for b in doc_checks.broken_links(p)]
    assert not broken, broken


def test_readme_setup_has_no_timings_or_commits():
    """README's set-up says what to run; timings and the commits they were taken at live in
    docs/results/ci.md."""
    assert doc_checks.section(README.read_text(), "Set-up"), "README has no set-up section"
    assert not doc_checks.setup_violations(README.read_text())


def test_readme_headline_cells_are_short():
    """Each cell of README's results table is one clause; the detail is in docs/results/."""
    headline = doc_checks.section(README.read_text(), "Results")
    assert doc_checks.table_cells(headline), "README has no results table"
    assert not doc_checks.long_cells(headline, HEADLINE_CELL_CHARS)


def test_readme_is_at_most_8_kib():
    """README had 19,759 bytes: four programs, a feature list and 16 results rows (issue 77)."""
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md has {size} bytes (at most {README_MAX_BYTES})"


def test_readme_results_rows_are_few_and_scoped():
    """At most 6 results rows, each linking to its page and naming its scope: the hardware, the
    EP size, and whether the figure was measured, compiled or modelled (a figure from two pinned
    CPU ranks at EP = 2 sat beside the EP64 GPU setting the opening sells)."""
    rows = doc_checks.table_rows(doc_checks.section(README.read_text(), "Results"))
    assert 1 <= len(rows) <= RESULTS_MAX_ROWS, [r[0] for r in rows]
    assert all(re.match(r"\[[^\]]+\]\([^)]+\)", row[0]) for row in rows), [r[0] for r in rows]
    assert not doc_checks.unscoped_rows(rows)


def test_readme_says_first_that_no_gpu_speedup_is_measured():
    """Before any table, README says that no GPU speed-up has been measured."""
    text = README.read_text()
    first_table = text.index("\n|")
    assert 0 <= text.find("No GPU speed-up has been measured") < first_table


def test_readme_words_come_before_their_use():
    """The glossary ("pairs", "slots", "masters", "the ideal", "relay") came after the tables that
    used its words."""
    assert not doc_checks.used_before_defined(README.read_text())


def test_scope_and_word_checks_catch_bad_strings():
    text = (
        "# x\n\nThe ideal and its pairs.\n\n## Words\n\n"
        "- **pair**: one choice; a **slot**: a place.\n"
        "- **the ideal**: even.\n\n## Results\n\n| what | figure | scope |\n|---|---|---|\n"
        "| [a](a.md) | 1.1x | measured: 2 pinned CPU ranks, EP = 2 |\n"
        "| [b](b.md) | 2x | modelled: H100s |\n| [c](c.md) | 3x | EP64 on CPUs |\n"
    )
    assert doc_checks.used_before_defined(text) == ["pair", "the ideal"]
    rows = doc_checks.table_rows(doc_checks.section(text, "Results"))
    assert [r[0] for r in rows] == ["[a](a.md)", "[b](b.md)", "[c](c.md)"]
    assert doc_checks.unscoped_rows(rows) == [
        "[b](b.md): no EP",
        "[c](c.md): no measured/compiled/modelled",
    ]


def test_python_blocks_pairs_each_block_with_its_output():
    text = (
        "```python\nprint(1)\n```\n\nIt prints:\n\n```text\n1\n```\n\n"
        "```python\nprint(2)\n```\n\nThe log:\n\n```text\nnot an output\n```\n"
        "```python\nx = 3\n```\n"
    )
    assert doc_checks.python_blocks(text) == [
        ("print(1)\n", "1\n"),
        ("print(2)\n", None),
        ("x = 3\n", None),
    ]


def test_github_slug():
    slug = doc_checks.github_slug
    assert slug("Exact mode against an exact solver (`python -m experiments.planner.exact`)") == (
        "exact-mode-against-an-exact-solver-python--m-experimentsplannerexact"
    )
    assert slug("Fast domains (`BalancerConfig(ranks_per_domain=d)`)") == (
        "fast-domains-balancerconfigranks_per_domaind"
    )
    assert (
        slug("The busiest rank's clock: [pinned](x.md) ranks")
        == "the-busiest-ranks-clock-pinned-ranks"
    )
    text = "# Top\n## Run\n```bash\n# not a heading\n```\n### Run\n## Run #\n"
    assert doc_checks.heading_anchors(text) == {"top", "run", "run-1", "run-2"}


def test_broken_links_catches_files_and_anchors(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n## Relay (`max_fanout=f`, default 2)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n## Set-up\n"
        "[ok](other.md#relay-max_fanoutf-default-2) [ok](#set-up) [ok](other.md) [ok](https://x.y/#z)\n"
        "[bad](other.md#relay) [bad](missing.md) [bad](#setup)\n"
        "```\n[in a code block](missing_too.md)\n```\n"
    )
    assert doc_checks.broken_links(page) == [
        "other.md#relay: no such heading",
        "missing.md: no such file",
        "#setup: no such heading",
    ]


def test_setup_violations_catches_timings_and_commits():
    bad = (
        "# x\n## Set-up\n\nThe first install 1:50-2:40, the tests 0:05:14 (commit a7d0d06,\n"
        "and 03caaec9f1).\n\n## Use\n\nThe run took 6:49 at commit 1a9691e.\n"
    )
    assert doc_checks.setup_violations(bad) == [
        "timing 1:50",
        "timing 2:40",
        "timing 0:05:14",
        "commit id a7d0d06",
        "commit id 03caaec9f1",
    ]
    good = "## Set-up\n\n16441671 train bytes, the word defaced, 127.0.0.1:1234, ratio 1.05x\n"
    assert doc_checks.setup_violations(good) == []


def test_long_cells_catches_a_long_cell():
    row = "| what | " + "x" * 201 + " | `a\\|b` |"
    text = "| a | b | c |\n|---|---|---|\n" + row + "\n"
    assert doc_checks.long_cells(text, 200) == ["x" * 201]
    assert "`a\\|b`" in doc_checks.table_cells(text)
    assert doc_checks.long_cells(text.replace("x" * 201, "x" * 200), 200) == []


def test_readme_lists_the_test_extra():
    """README listed the test extra as pytest, pytest-xdist and hypothesis; pyproject also has
    filelock and scipy."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=\[ ]", req)[0] for req in extra["optional-dependencies"]["test"]]
    names = [name for name in names if name != extra["name"]]
    listed = re.search(r"`test` adds ([^.]+)\.", " ".join(README.read_text().split())).group(1)
    assert sorted(re.split(r", | and ", listed)) == sorted(names), listed


def test_readme_says_where_to_run_the_experiments():
    """`python -m experiments.*` works only from the checkout's root, and nothing said so."""
    text = " ".join(README.read_text().split())
    assert "Run both from the checkout's root: `python -m experiments.*`" in text
