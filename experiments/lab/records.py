"""Reading the ``*.jsonl`` files a training run writes once per step (host only, no JAX):
``metrics.jsonl`` (`read_metrics`) and ``--profile_loads``' ``loads.jsonl`` (`read_loads`), for the
run's plot, summary and viewer and for the benchmarks that replay a run's loads.
"""

from __future__ import annotations

import json
import pathlib

__all__ = ["read_loads", "read_metrics", "read_step_records"]


def read_step_records(path, required=("step",)) -> list[dict]:
    """The JSON records of a ``*.jsonl`` file written once per step, sorted by ``step``.

    Blank lines are skipped. A malformed *last* line (a run killed mid-write) is ignored; a
    malformed line elsewhere raises ValueError. When a step appears more than once (a resumed run
    re-logging steps after its last checkpoint) the last record wins.

    Raises:
      ValueError: a record lacks one of ``required``, or a line other than the last is bad.
    """
    path = pathlib.Path(path)
    lines = [(i + 1, line) for i, line in enumerate(path.read_text().splitlines()) if line.strip()]
    by_step: dict[int, dict] = {}
    for k, (lineno, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if k == len(lines) - 1:
                break
            raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or any(key not in record for key in required):
            raise ValueError(f"{path}:{lineno}: a record needs {' and '.join(map(repr, required))}")
        by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def read_metrics(metrics_path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file (see `read_step_records`); each needs ``step``
    and ``loss``. ValueError when the file holds no record."""
    records = read_step_records(metrics_path, ("step", "loss"))
    if not records:
        raise ValueError(f"{metrics_path}: no metrics records")
    return records


def read_loads(loads_path) -> list[dict]:
    """The records of a ``loads.jsonl`` file (see `read_step_records`); each needs ``step`` and
    ``layers``."""
    return read_step_records(loads_path, ("step", "layers"))
