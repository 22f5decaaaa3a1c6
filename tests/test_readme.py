"""Every ```python block of README.md and docs/integration.md runs as written (in a fresh
interpreter, as a user would paste it, with the tests' quick-compile XLA flags beside the 8 devices
the blocks ask for); the README's test command is the one CI runs, and the
documentation's relative links lead to files that exist."""

import pathlib
import re
import subprocess
import sys

import pytest

from tests.xla_settings import fast_compile_flags, program_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = (README, ROOT / "docs" / "integration.md")
#: The devices every block asks for (`os.environ.setdefault("XLA_FLAGS", ...)`): set here with
#: the quick-compile flags, the blocks' own line keeps them.
BLOCK_DEVICES = "--xla_force_host_platform_device_count=8"
BLOCKS = [b for page in PAGES for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)]


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path):
    script = tmp_path / f"block{index}.py"
    script.write_text(BLOCKS[index])
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=README.parent,
        capture_output=True,
        text=True,
        timeout=600,
        env=program_env(XLA_FLAGS=f"{BLOCK_DEVICES} {fast_compile_flags()}".strip()),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_readme_test_command_is_cis():
    """.ci/run runs the README's test command: one line of each, the same text."""
    ci = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()]
    ci_cmds = [l for l in ci if l.startswith("pip install") and "pytest" in l]
    readme = [l.strip() for l in README.read_text().splitlines() if l.startswith("    pip install")]
    readme_cmds = [l for l in readme if "pytest" in l]
    assert len(ci_cmds) == 1, ci_cmds
    assert readme_cmds == ci_cmds


def test_doc_links_exist():
    """Every relative link of README.md, CHANGELOG.md and docs/*.md names an existing file."""
    pages = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, missing


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
