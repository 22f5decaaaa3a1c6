"""The programs' output files: `write_json` (the ``--json_out`` file, written atomically) and
`check_output_path` (checked before a long run).
"""

from __future__ import annotations

import json
import os
import pathlib


def write_json(path: str | os.PathLike | None, obj) -> None:
    """Writes ``obj`` to ``path`` as indented JSON, creating its folder, atomically (a reader
    never sees half a file); nothing when ``path`` is None (the ``--json_out`` flags' default)."""
    if path:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(obj, indent=2) + "\n")
        os.replace(tmp, path)


def check_output_path(path: str | os.PathLike, flag: str) -> None:
    """Checks, before a long run, that `write_json` can write ``path`` (given by ``flag``): it is
    no folder, and its nearest existing folder is a writable folder, not a file.

    Raises:
      ValueError: one line naming ``flag`` and the problem.
    """
    path = pathlib.Path(path)
    if path.is_dir():
        raise ValueError(f"{flag}={path} is a folder; name a file")
    parent = next(p for p in path.absolute().parents if p.exists())
    if not parent.is_dir():
        raise ValueError(f"{flag}={path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag}={path}: the folder {parent} is not writable")
