"""A run's workdir: its file names, checks before anything is written, the saved configuration,
and the JSON lines appended to it (host only, no JAX)."""

from __future__ import annotations

import json
import os
import pathlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from experiments.lab.training.config import TrainConfig

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
SUMMARY_FILE = "summary.json"
PROFILE_FILE = "loads.jsonl"
CHECKPOINT_DIR = "checkpoints"
#: ``--profile_steps``: ``terms_rank<process index>.json``, each process's step split into terms.
TERMS_FILE = "terms_rank{}.json"


class RunError(ValueError):
    """A problem with the run's inputs (data, workdir, checkpoints) that the user can fix; the
    message is one line. `experiments.train` prints it as ``error: ...``."""


def check_workdir(cfg: TrainConfig) -> pathlib.Path:
    """The absolute workdir; RunError when it is a file (checked before anything is written)."""
    workdir = pathlib.Path(cfg.workdir).expanduser().absolute()
    if workdir.exists() and not workdir.is_dir():
        raise RunError(f"--workdir={cfg.workdir} is a file, not a folder; choose another --workdir")
    return workdir


def open_workdir(cfg: TrainConfig) -> pathlib.Path:
    """The absolute workdir, created if needed; RunError when it cannot be used."""
    workdir = check_workdir(cfg)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunError(f"cannot create --workdir={cfg.workdir}: {err.strerror or err}") from None
    if not os.access(workdir, os.W_OK | os.X_OK):
        raise RunError(f"--workdir={cfg.workdir} is not writable")
    return workdir


def check_saved_config(workdir: pathlib.Path, cfg: TrainConfig) -> list[str]:
    """Compares ``cfg`` with the workdir's ``config.json`` (when there is one).

    Returns the changed flags that do not block resuming; raises RunError naming the flags whose
    change makes the workdir's checkpoints unusable.
    """
    path = workdir / CONFIG_FILE
    if not path.exists():
        return []
    try:
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict):
            raise TypeError("not a JSON object")
    except (OSError, ValueError, TypeError) as err:
        raise RunError(f"cannot read {path}: {err}") from None
    blocking, changed = cfg.compare_saved(saved)
    if blocking:
        raise RunError(
            f"--workdir={cfg.workdir} holds checkpoints of a different model: "
            f"{', '.join(blocking)}; resume with the same values or choose another --workdir"
        )
    return changed


def append_json_line(path: pathlib.Path, obj):
    """Appends ``obj`` to ``path`` as one line of JSON (a ``*.jsonl`` record)."""
    with path.open("a") as f:
        f.write(json.dumps(obj) + "\n")


def keep_records_up_to(path: pathlib.Path, step: int):
    """Drops records past ``step`` (written after the checkpoint a resumed run starts from), and
    any line a killed run left half-written."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record["step"] <= step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))


def workdir_contents(cfg: TrainConfig) -> str:
    """What the run writes in its workdir (for the line printed at the start)."""
    during = [CONFIG_FILE, METRICS_FILE] + ([PROFILE_FILE] if cfg.profile_loads else [])
    at_end = [PLOT_FILE, SUMMARY_FILE] + ([TERMS_FILE.format("<p>")] if cfg.profile_steps else [])
    return (
        f"{', '.join(during)} and {CHECKPOINT_DIR}/ as it goes, "
        f"{', '.join(at_end[:-1])} and {at_end[-1]} at the end"
    )


def files_written(cfg: TrainConfig, workdir: pathlib.Path, step: int) -> str:
    """The closing lines: every file of the run, with what it holds."""
    rows = [
        (CONFIG_FILE, "the run's flags (checked when resuming)"),
        (METRICS_FILE, "one JSON record per step"),
        (PLOT_FILE, "loss and max/mean rank load per layer"),
        (SUMMARY_FILE, "final losses, imbalance, dropped pairs, replicas, step time, flags"),
    ]
    if cfg.profile_loads:
        rows.append((PROFILE_FILE, "per-step, per-layer loads (experiments.train.viewer)"))
    rows = [(name, what) for name, what in rows if (workdir / name).exists()]
    if any(workdir.glob(TERMS_FILE.format("*"))):
        # Each process writes its own, maybe after this line: the pattern, not the files so far.
        what = "each process's profiled steps split into terms (--profile_steps)"
        rows.append((TERMS_FILE.format("<p>"), what))
    if (workdir / CHECKPOINT_DIR).exists():
        rows.append((f"{CHECKPOINT_DIR}/", f"step {step}; rerun with this --workdir to continue"))
    width = max(len(name) for name, _ in rows)
    return "\n".join([f"files in {workdir}:"] + [f"  {n:<{width}}  {w}" for n, w in rows])
