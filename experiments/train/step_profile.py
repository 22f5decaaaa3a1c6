"""``--profile_steps=N``: the run's last N steps traced with `jax.profiler` on every process, and
each process's step split into terms (`experiments.lab.step_terms`) written to
``<workdir>/terms_rank<process>.json``. The profiled steps are marked in the metrics and left out
of the median step time (tracing slows a step a little)."""

from __future__ import annotations

import pathlib
import shutil
import statistics

import jax

from experiments.lab import step_terms
from experiments.lab.output_files import write_json
from experiments.lab.training.workdir import TERMS_FILE


def _profiler_options() -> jax.profiler.ProfileOptions:
    """What the trace records: the XLA instructions' events (the host tracer's), without the
    Python tracer's event per Python call, which the terms do not read: with them, the files of
    one profiled step of a small model took 15 MB (2 MB without), and seconds to write and read
    back on each rank."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    return options


def terms_path(workdir: pathlib.Path, rank: int) -> pathlib.Path:
    """The terms file of process ``rank`` in ``workdir``."""
    return pathlib.Path(workdir) / TERMS_FILE.format(rank)


class StepProfile:
    """Traces steps ``first..last`` of a run (the last ``profile_steps``; none when they include
    the run's first step of this start, whose time is compiling) and writes the terms file.

    Call `starts` before a step, `ended` after it with its wall seconds, and `finish` after the
    loop with a function that returns the step's compiled HLO text.
    """

    def __init__(self, workdir: pathlib.Path, steps: int, profile_steps: int, start: int):
        self.first = steps - profile_steps + 1
        self.active = profile_steps > 0 and self.first > start + 1
        self.rank = jax.process_index()
        self.trace_dir = pathlib.Path(workdir) / "profile" / f"rank{self.rank}"
        self.walls: list[float] = []
        self.tracing = False

    def starts(self, step: int) -> bool:
        """Starts the trace at the first profiled step; True when ``step`` is profiled."""
        if self.active and step == self.first:
            shutil.rmtree(self.trace_dir, ignore_errors=True)
            options = _profiler_options()
            jax.profiler.start_trace(
                str(self.trace_dir), create_perfetto_trace=True, profiler_options=options
            )
            self.tracing = True
        return self.tracing

    def ended(self, step: int, wall_s: float) -> None:
        """Records a profiled step's wall seconds."""
        if self.tracing:
            self.walls.append(wall_s)

    def finish(self, hlo_text) -> dict | None:
        """Stops the trace; writes and returns the terms (None when nothing was traced):
        ``rank``, ``steps``, ``wall_s`` (their mean), ``median_wall_s``, ``terms_s``
        (`step_terms.TERMS`, seconds per step), ``collectives_s`` (the part of each term in
        collectives) and ``outside_ops_s`` (wall less the terms)."""
        if not self.tracing:
            return None
        jax.profiler.stop_trace()
        self.tracing = False
        split = step_terms.split_terms(
            step_terms.read_trace(self.trace_dir), hlo_text(), len(self.walls)
        )
        wall = statistics.fmean(self.walls)
        out = {
            "rank": self.rank,
            "steps": len(self.walls),
            "wall_s": wall,
            "median_wall_s": statistics.median(self.walls),
            **split,
            "outside_ops_s": wall - sum(split["terms_s"].values()),
        }
        write_json(terms_path(self.trace_dir.parent.parent, self.rank), out)
        shutil.rmtree(self.trace_dir, ignore_errors=True)  # MBs per rank
        try:
            self.trace_dir.parent.rmdir()  # the last rank to finish removes the folder
        except OSError:
            pass
        return out
