"""The whole-step benchmarks' modes and training cases (`experiments.bench.step`, which trains
each mode as a run of its own, and `bench.step_pair`, which trains two modes side by side): each
a set of `experiments.train` flags, with the text each case reads. Their flags are
`experiments.lab.cli.define_step_case_flags`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

#: The four modes: the trainer's flags of each.
MODES = {
    "ideal": ("--balance=ideal",),
    "balanced": ("--balance=ultraep",),
    "plain": ("--balance=none", "--capacity_factor=none"),
    "plain@1.25": ("--balance=none", "--capacity_factor=1.25"),
}
#: The training cases (a router on a text): the trainer's flags of each.
CASES = {
    "softmax": ("--router=softmax",),
    "sigmoid": ("--router=sigmoid",),
    "skewed": ("--router=softmax",),
}
#: Cases that train on a text mix of their own: a glob under the Python standard library's
#: folder (`experiments.lab.training.data.default_corpus_root`, resolved at run time: the same
#: files wherever this Python is).
#: The other cases read --data (default: the trainer's corpus, the standard library's .py files).
CASE_DATA = {"skewed": "s[t-z]*.py"}
#: The text each run reads at most: more than 40 steps of 32 x 128 bytes (a smaller text is read
#: again from its start).
CORPUS_BYTES = 2 << 20


def case_data(case: str, data: str | None, corpus_root: Path) -> str | None:
    """The ``--data`` the runs of ``case`` read: its own mix (`CASE_DATA`, a glob made absolute
    under ``corpus_root``, the standard library's folder), else ``data`` (None: the trainer's
    default corpus)."""
    if case in CASE_DATA:
        return str(Path(corpus_root) / CASE_DATA[case])
    return data


def unknown_names(kind: str, names: Iterable[str], known: Mapping) -> str | None:
    """The one line refusing ``names`` (``--modes`` or ``--train_cases``) when one is not in
    ``known`` or none is given; None when they are fine."""
    names = list(names)
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        return (
            f"unknown {kind} {', '.join(unknown) or '(none given)'}; expected some of "
            f"{', '.join(known)}"
        )
    return None


def data_conflict(data: str | None, cases: Iterable[str] | None) -> str | None:
    """The one line refusing ``--data`` with a case that trains on its own mix (`CASE_DATA`);
    None when there is no conflict."""
    own = [c for c in cases or () if c in CASE_DATA]
    if data is not None and own:
        return (
            f"--data conflicts with case {', '.join(own)}, which trains on its own mix "
            f"({'; '.join(CASE_DATA[c] for c in own)} under the standard library's folder): "
            "run that case without --data"
        )
    return None
