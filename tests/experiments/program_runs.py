"""Several command lines of one program in one process: `run_each` runs ``python -m MODULE`` once
with the program's `run_main` replaced by a loop that, for each command line, parses the flags
afresh with the program's own parser (`program.parse_flags`, as `run_main` does) and calls its
``main``, recording what it printed and how it exited.

What a test of a flag error, a bad input or ``--help`` checks (the exit code, the one ``error:``
line, no traceback, the help text) is what the program prints and exits with on that path; one
process for all the command lines of a test file pays the program's start (a JAX import, about a
second of CPU) once instead of once per line. A program run end to end as its own process
(`subprocess`) stays in each test file for the paths the loop does not take: absl's ``app.run``
around the parse and a clean process exit.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile

from tests.xla_settings import program_env

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The program module run as ``python -m`` runs it (`runpy`, as "__main__", with sys.argv[0] its
# file: --help reads the module's doc and its key flags from there), its `run_main` replaced.
_RUNNER = """
import contextlib, io, json, runpy, sys, traceback
from absl import app, flags
from experiments.lab import program
module, argvs, out_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]

def run_each(main, **kwargs):
    results = []
    for argv in argvs:
        flags.FLAGS.unparse_flags()
        sys.argv[1:] = argv
        out, err, code = io.StringIO(), io.StringIO(), 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(program.parse_flags([sys.argv[0], *argv]))
            except SystemExit as stop:  # as the interpreter ends with sys.exit(code)
                code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
                if stop.code is not None and not isinstance(stop.code, int):
                    print(stop.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = "exception"
        results.append({"argv": argv, "code": code, "stdout": out.getvalue(),
                        "stderr": err.getvalue()})
    with open(out_path, "w") as f:
        json.dump(results, f)
    sys.exit(0)

program.run_main = app.run = run_each
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def run_each(module: str, argvs: list[list[str]], timeout: int = 600) -> list[dict]:
    """For each of ``argvs``, what ``python -m <module> <argv>`` did, all in one process: a dict
    with ``code`` (the exit code; ``"exception"`` for an exception other than SystemExit, whose
    traceback ends ``stderr``), ``stdout`` and ``stderr``."""
    with tempfile.TemporaryDirectory() as folder:
        out = pathlib.Path(folder) / "runs.json"
        proc = subprocess.run(
            [sys.executable, "-c", _RUNNER, module, json.dumps(argvs), str(out)],
            cwd=ROOT,
            env=program_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
        return json.loads(out.read_text())
