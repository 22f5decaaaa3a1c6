"""MaxText's CPU ("decoupled") requirements as the integration was tested with them.

The maxtext wheel declares no dependencies; it ships its CPU requirements file inside
site-packages. In 0.2.5 that file pins ``tokamax==0.0.12`` (its GPU and TPU locks want >= 0.0.14)
and lacks four packages its modules import. ``python -m
ultraep_jax.integrations.maxtext.requirements`` prints the file with the pin moved to the
tokamax the tests ran (`TOKAMAX`) and the four added (`MISSING`), for ``pip install -r``.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys

#: Where the wheel keeps its CPU requirements, relative to site-packages.
SHIPPED = "dependencies/requirements/generated_requirements/decoupled-requirements.txt"
#: The tokamax that replaces the shipped pin (0.0.12).
TOKAMAX = "tokamax==0.0.17"
#: What MaxText 0.2.5's modules import that the shipped file leaves out.
MISSING = ("httpx2", "tzdata", "lazy-importer", "xprof")


def fixed(text: str) -> str:
    """The shipped requirements ``text`` with tokamax's pin replaced and `MISSING` added."""
    lines = [TOKAMAX if re.match(r"tokamax\s*==", line) else line for line in text.splitlines()]
    return "\n".join([*lines, *MISSING]) + "\n"


def shipped_text() -> str:
    """The requirements file of the installed maxtext wheel; one line when there is none."""
    try:
        path = importlib.metadata.distribution("maxtext").locate_file(SHIPPED)
        return path.read_text()
    except (importlib.metadata.PackageNotFoundError, FileNotFoundError) as e:
        raise SystemExit(
            f"error: no {SHIPPED} of an installed maxtext wheel ({e}); install the wheel first: "
            'pip install ".[maxtext]"'
        ) from None


if __name__ == "__main__":
    sys.stdout.write(fixed(shipped_text()))
