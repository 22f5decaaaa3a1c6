"""Every ``python -m experiments...`` command of README.md, docs/*.md, docs/results/*.md and
experiments/README.md parses as written: the program's flags and their validators accept it
(`parsed_as_written`).

What runs how (a full run of most of them takes minutes to hours, so this file only parses):
  - every command: its flags parsed by the program's own parser (`program.parse_flags`, with the
    program's validators), a process forked per program from one that imported JAX once,
    without running its ``main``; marked slow;
  - every program's defaults: no figure is written under docs/ or experiments/results/ unless a
    flag names the file (`test_defaults_write_no_committed_file`), printed by the same process
    that parsed its commands (`parsed`);
  - run in full elsewhere: experiments/README.md's serve command as written
    (tests/experiments/test_serve.py::test_documented_command_runs_from_another_folder),
    docs/usage.md's ```python blocks (tests/test_readme.py), train's documented flags on small
    models (tests/experiments/test_train.py).
"""

from __future__ import annotations

import collections
import functools
import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from tests.xla_settings import program_env

# Each program's process serves two tests (`parsed`): one test process runs them (pytest-xdist).
pytestmark = pytest.mark.xdist_group("test_doc_commands")

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = (
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "results").glob("*.md")),
    ROOT / "experiments" / "README.md",
)
# Committed results: a program writes there only when a flag names the file.
COMMITTED = ("docs/", "experiments/results/")
# Runs each program module with `run_main` replaced by: parse each argv (one line `error: ...` and
# exit 2 when one does not parse), then exit 0 without running main. One process imports JAX,
# flax and the library once, then forks a child per program (the program's own flags, parsed as
# in a process of its own), and prints {module: {code, stdout, stderr}} as its last line.
_RUNNER = """
import json, os, runpy, sys, tempfile
import jax, flax, numpy, ultraep_jax  # noqa: F401  (imported once, before the forks)
commands = json.loads(sys.argv[1])

def child(module, argvs):
    from absl import app, flags
    from experiments.lab import program

    def parse_only(main, **kwargs):
        for argv in argvs:
            flags.FLAGS.unparse_flags()
            program.parse_flags([module, *argv])
        values = {name: flags.FLAGS[name].default for name in flags.FLAGS}  # string defaults
        print(json.dumps({k: v for k, v in values.items() if isinstance(v, str)}))
        sys.exit(0)

    program.run_main = app.run = parse_only
    runpy.run_module(module, run_name="__main__", alter_sys=True)

results = {}
with tempfile.TemporaryDirectory() as tmp:
    for module, argvs in commands.items():
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        pid = os.fork()
        if pid == 0:
            code = 1
            with open(out, "w") as o, open(err, "w") as e:
                os.dup2(o.fileno(), 1)
                os.dup2(e.fileno(), 2)
                try:
                    child(module, argvs)
                    code = 0
                except SystemExit as stop:
                    code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
                except BaseException:
                    import traceback
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
        _, status = os.waitpid(pid, 0)
        results[module] = {
            "code": os.waitstatus_to_exitcode(status),
            "stdout": open(out).read(),
            "stderr": open(err).read(),
        }
print(json.dumps(results))
"""


def _shell_lines(text: str) -> list[str]:
    """The command lines of a markdown page: its indented code lines (continued after a
    backslash) and its inline code spans (fenced blocks are output, not commands)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    lines = re.findall(r"`([^`]+)`", text)
    rows = text.splitlines()
    i = 0
    while i < len(rows):
        if rows[i].startswith("    "):
            line = rows[i].strip()
            while line.endswith("\\") and i + 1 < len(rows):
                i += 1
                line = line[:-1] + " " + rows[i].strip()
            lines.append(line)
        i += 1
    return [" ".join(line.split()) for line in lines]


def documented_commands() -> dict[str, list[list[str]]]:
    """``{module: [argv, ...]}``: every ``python -m experiments.X ...`` of the pages, its shell
    wrappers (``VAR=value``, ``chrt -r 10``, ``timeout ...``, ``&&``, ``&``) and comments left out,
    ``[--optional]`` flags given, and placeholder values (``--flag=...``) dropped."""
    found = collections.defaultdict(list)
    for page in PAGES:
        for line in _shell_lines(page.read_text()):
            for part in re.split(r"&&|;|\|", line):
                if "-m experiments" not in part:
                    continue  # other commands (a quoted ``python -c "...; ..."`` splits here)
                words = shlex.split(part.replace("[", "").replace("]", ""), comments=True)
                if "-m" not in words or "python" not in words:
                    continue
                at = words.index("-m")
                module = words[at + 1] if at + 1 < len(words) else ""
                if not re.fullmatch(r"experiments(\.\w+)*", module):
                    continue  # prose about the programs (`python -m experiments.*`)
                argv = [w for w in words[at + 2 :] if w != "&" and not w.endswith("=...")]
                if argv not in found[module]:
                    found[module].append(argv)
    return dict(found)


# Documented programs that take no absl flags, and where their documented use is run instead.
NOT_FLAG_PROGRAMS = {
    # A command line to check ([env K=V ...] PYTHON -m MODULE ...), not flags:
    # tests/experiments/test_gpu_runbook.py runs it through run_all.sh --check.
    "experiments.gpu.command_check",
}
COMMANDS = {m: a for m, a in documented_commands().items() if m not in NOT_FLAG_PROGRAMS}


def _run_all(commands: dict[str, list[list[str]]]) -> dict[str, dict]:
    """``{module: {"code", "stdout", "stderr"}}`` of `_RUNNER` over ``commands``."""
    env = program_env()
    env["JAX_PLATFORMS"] = "cpu"  # parsing touches no device
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, json.dumps(commands)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_commands_are_found():
    """The extraction finds the pages' commands (experiments/README.md's table names 18), the
    results pages' among them (docs/results/, one page per topic, replaced docs/results.md)."""
    assert len(COMMANDS) >= 18, sorted(COMMANDS)
    results = {p.name for p in PAGES if p.parent.name == "results"}
    assert len(results) >= 10 and {"README.md", "step.md", "planner.md"} <= results, results
    assert (
        [] in COMMANDS["experiments.train"]
        and ["--workdir=runs/default"] in COMMANDS["experiments.serve"]
    )
    assert ["--dir=DIR"] in COMMANDS["experiments.gpu.summary"]


@functools.cache
def _parsed_all() -> dict[str, dict]:
    return _run_all(COMMANDS)


def parsed(module: str) -> dict:
    """What parsing every documented command of ``module`` as written gave (``code``, ``stdout``,
    ``stderr``), its stdout's last line every string flag's default; for both tests below, from
    one run of `_RUNNER` over every program (per test process)."""
    return _parsed_all()[module]


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(COMMANDS))
def test_parsed_as_written(module):
    run = parsed(module)
    assert run["code"] == 0, (COMMANDS[module], run["stderr"][-2000:])


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(COMMANDS))
def test_defaults_write_no_committed_file(module):
    """bench.breakeven, bench.rates and stepmodel_programs.topology overwrote docs/breakeven.json
    and .png, experiments/results/rates_cpu.json and topology.json by default."""
    run = parsed(module)
    assert run["code"] == 0, run["stderr"][-2000:]
    defaults = json.loads(run["stdout"].strip().splitlines()[-1])
    inputs = {"rates", "breakeven", "calibration", "traces_dir", "workdir", "dir", "prompts"}
    writes = {k: v for k, v in defaults.items() if k not in inputs and v}
    assert not [v for v in writes.values() if v.startswith(COMMITTED)], writes


@pytest.mark.slow
def test_gpu_summary_docstring_example_runs(tmp_path):
    """experiments.gpu.summary's docstring named a folder that does not exist (a traceback): its
    example is now the dry run's folder, and a missing folder is one error line."""
    from experiments.gpu import summary

    assert "--dir=runs/gpu_all_dry" in summary.__doc__
    assert (
        "run_all.sh --dry_run" in summary.__doc__
        and "DIR=runs/gpu_all_dry" in (ROOT / "experiments" / "gpu" / "run_all.sh").read_text()
    )
    env = program_env()
    missing = tmp_path / "nothing"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.gpu.summary", f"--dir={missing}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: --dir={missing} is not a folder: give the folder run_all.sh wrote (its --out)"
    ], proc.stderr[-2000:]


@pytest.mark.slow
def test_no_backend_probe_line_on_cpu():
    """JAX's INFO line "Unable to initialize backend 'tpu'" opened the output of the programs on a
    CPU machine (absl's handler shows INFO); `program.run_main` leaves that logger at WARNING."""
    env = program_env()
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.stepmodel_programs.anchor"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Unable to initialize backend" not in proc.stderr + proc.stdout, proc.stderr[:500]
    assert proc.stdout.startswith("UltraEP's EP64 setup"), proc.stdout[:200]


def test_api_compile_time_says_one_ratio_from_results():
    """docs/api.md's compile-time paragraph gave seven different ratios; it now gives the current
    one, the one docs/results/compile.md's compile_layer table gives."""
    api = (ROOT / "docs" / "api.md").read_text()
    paragraph = api[api.index("Compile time.") :].split("\n\n", 1)[0]
    ratios = set(re.findall(r"(\d+\.\d+)x", paragraph))
    results = (ROOT / "docs" / "results" / "compile.md").read_text()
    section = results[results.index("## Compile time of one layer") :].split("\n## ", 1)[0]
    assert ratios == set(re.findall(r"\*\*balanced\*\* \| [\d.]+ s \| \*\*(\d+\.\d+)\*\*", section))
    assert len(ratios) == 1, ratios
