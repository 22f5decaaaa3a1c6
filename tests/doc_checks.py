"""Checks of the documentation's text, as functions of strings, so that each can be shown to
catch what it is for (tests/test_readme.py runs them on the pages and on bad strings).

- `github_slug`, `heading_anchors`, `broken_links`: a relative link's file exists and its
  ``#fragment`` names a heading of that file by GitHub's rules (lowercase; punctuation dropped
  but hyphens, underscores and spaces; each space a hyphen; a repeated heading's anchor gets -1,
  -2, ...);
- `section`, `setup_violations`: README's set-up section holds no ``m:ss`` timing and no commit
  id;
- `long_cells`: no table cell of a section longer than a bound;
- `python_blocks`: a page's ```python blocks, each with the output the page says it prints (the
  ```text block after "It prints"), if it says;
- `table_rows`, `unscoped_rows`: README's results table names each row's scope (hardware, EP,
  measured / compiled / modelled);
- `used_before_defined`: README's words are defined before their first use.
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


_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.S | re.M)
_FENCED = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.S | re.M)


def python_blocks(text: str) -> list[tuple[str, str | None]]:
    """``(code, output)`` for each ```python block of a page: ``output`` is the ```text block
    that follows it when the prose between them says it prints ("It prints:"), else None."""
    blocks = []
    for match in _PYTHON_BLOCK.finditer(text):
        after = text[match.end() :]
        fence = _FENCED.search(after)
        output = None
        if fence and fence.group(1) == "text" and "prints" in after[: fence.start()]:
            output = fence.group(2)
        blocks.append((match.group(1), output))
    return blocks


def table_rows(text: str) -> list[list[str]]:
    """The data rows of the markdown tables in ``text``, as lists of cells (no header rows, no
    ``|---|`` separators)."""
    rows, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        is_row = line.startswith("|") and not re.fullmatch(r"\|[-:| ]+\|?", line.strip())
        is_header = i + 1 < len(lines) and re.fullmatch(r"\|[-:| ]+\|?", lines[i + 1].strip())
        if is_row and not is_header:
            rows.append(table_cells(line))
    return rows


#: What a results row's scope must name: the hardware, the EP size, how the figure was obtained.
SCOPE_PARTS = {
    "hardware": re.compile(r"\b(CPUs?|GPUs?|H100s?|H200s?|TPUs?|XLA:CPU|XLA:GPU)\b"),
    "EP": re.compile(r"\bEP ?(= ?)?\d+"),
    "measured/compiled/modelled": re.compile(r"\b(measured|compiled|modelled)\b", re.I),
}


def unscoped_rows(rows: list[list[str]]) -> list[str]:
    """``row: missing part`` for each table row whose last cell (its scope) lacks a part of
    `SCOPE_PARTS`."""
    return [
        f"{row[0]}: no {name}"
        for row in rows
        for name, pattern in SCOPE_PARTS.items()
        if not pattern.search(row[-1])
    ]


def used_before_defined(text: str, section_title: str = "Words") -> list[str]:
    """The terms README's ``section_title`` section defines (``- **term**`` items, and **bold**
    words inside them) that the text uses before that section (code blocks left out), each as
    ``term``; a plural counts as a use."""
    prose = without_code_blocks(text)
    start = prose.find(f"\n## {section_title}\n")
    if start < 0:
        return [f"no section {section_title!r}"]
    body = section(prose, section_title)
    terms = re.findall(r"\*\*([^*]+)\*\*", "\n".join(re.findall(r"^- .*(?:\n  .*)*", body, re.M)))
    return [
        term
        for term in terms
        if re.search(rf"(?<![\w/]){re.escape(term)}(?:e?s)?(?![\w/])", prose[:start], re.I)
    ]
