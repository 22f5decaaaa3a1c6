"""Checks of the documentation's text, as functions of strings, so that each can be shown to
catch what it is for (tests/test_readme.py runs them on the pages and on bad strings).

- `github_slug`, `heading_anchors`, `broken_links`: a relative link's file exists and its
  ``#fragment`` names a heading of that file by GitHub's rules (lowercase; punctuation dropped
  but hyphens, underscores and spaces; each space a hyphen; a repeated heading's anchor gets -1,
  -2, ...);
- `section`, `setup_violations`: README's set-up section holds no ``m:ss`` timing and no commit
  id;
- `long_cells`: no table cell of a section longer than a bound.
"""

from __future__ import annotations

import collections
import pathlib
import re

_FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
_HEADING = re.compile(r"^#{1,6}[ \t]+(.*?)[ \t]*(?:#+[ \t]*)?$", re.M)
_LINK = re.compile(r"\]\(([^)\s#]*)(?:#([^)\s]*))?\)")
#: A timing such as 1:50, 6:49 or 0:05:14.
_TIMING = re.compile(r"(?<![\d:])\d{1,2}(?::\d{2}){1,2}(?![\d:])")
#: A commit id: 7-40 hex digits with a digit and a letter among them (so neither a plain number
#: such as a byte count nor a word such as "defaced").
_COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def without_code_blocks(text: str) -> str:
    """``text`` with its fenced code blocks blanked (their ``#`` lines are no headings)."""
    return _FENCE.sub("", text)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading's text (before duplicates are numbered)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()  # HTML tags
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def heading_anchors(text: str) -> set[str]:
    """Every anchor of a markdown page's headings; a repeated one numbered -1, -2, ..."""
    seen: collections.Counter[str] = collections.Counter()
    anchors = set()
    for match in _HEADING.finditer(without_code_blocks(text)):
        slug = github_slug(match.group(1))
        anchors.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return anchors


def broken_links(page: pathlib.Path, text: str | None = None) -> list[str]:
    """``page``'s relative links that name no file, or a ``#fragment`` no heading there has."""
    text = page.read_text() if text is None else text
    broken = []
    for target, fragment in _LINK.findall(without_code_blocks(text)):
        if "://" in target or target.startswith("mailto:"):
            continue
        dest = page.parent / target if target else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md":
            dest_text = text if dest == page else dest.read_text()
            if fragment not in heading_anchors(dest_text):
                broken.append(f"{target}#{fragment}: no such heading")
    return broken


def section(text: str, title_start: str) -> str:
    """The body of the level-2 section whose title starts with ``title_start`` ('' if none)."""
    parts = re.split(r"^## ", text, flags=re.M)
    found = [p for p in parts[1:] if p.startswith(title_start)]
    return found[0].split("\n", 1)[1] if found else ""


def setup_violations(text: str) -> list[str]:
    """The ``m:ss`` timings and commit ids in README text ``text``'s set-up section."""
    body = section(text, "Set-up")
    return [f"timing {t}" for t in _TIMING.findall(body)] + [
        f"commit id {c}" for c in _COMMIT.findall(body)
    ]


def table_cells(text: str) -> list[str]:
    """Every cell of the markdown tables in ``text`` (``\\|`` inside a cell does not split it)."""
    cells = []
    for line in text.splitlines():
        if line.startswith("|"):
            cells += [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
    return cells


def long_cells(text: str, limit: int) -> list[str]:
    """The table cells of ``text`` longer than ``limit`` characters, as written (links too)."""
    return [c for c in table_cells(text) if len(c) > limit]
