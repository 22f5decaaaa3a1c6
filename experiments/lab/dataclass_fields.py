"""A configuration dataclass's fields as `experiments.lab.cli.define_flags` makes flags of them:
each field's name, annotation, default and help (its entry in the ``Attributes:`` section of the
class docstring), nested dataclasses flattened (`flag_fields`, `all_fields`).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from collections.abc import Iterable, Iterator

__all__ = ["FLAG_TYPES", "all_fields", "attribute_help", "flag_fields", "scalar_type"]

#: The annotations a field's flag can have (or one of them ``| None``).
FLAG_TYPES = (bool, int, float, str)
_ENTRY = re.compile(r"(\w+):\s*(.*)")


def attribute_help(cls) -> dict[str, str]:
    """``{name: text}`` of the ``Attributes:`` section of ``cls``'s docstring (Google style:
    ``name: text`` lines, continued on more deeply indented lines; double backquotes dropped)."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    if "Attributes:" not in lines:
        return {}
    out: dict[str, list[str]] = {}
    indent, name = None, None
    for line in lines[lines.index("Attributes:") + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        if depth < indent or depth == 0:
            break  # the section ended
        entry = _ENTRY.fullmatch(line.strip()) if depth == indent else None
        if entry:
            name = entry.group(1)
            out[name] = [entry.group(2)]
        elif name is not None:
            out[name].append(line.strip())
    return {key: " ".join(words).replace("``", "") for key, words in out.items()}


def flag_fields(cls, only: Iterable[str] | None) -> Iterator[tuple[str, type, object, str]]:
    """``(name, type, default, help)`` of every flag of ``cls``, nested dataclasses flattened;
    only the fields named in ``only`` when it is given.

    Raises:
      TypeError: a field has no docstring entry, or an annotation that is not one type or one
        type ``| None``.
      ValueError: ``only`` names a field ``cls`` does not have.
    """
    fields = list(all_fields(cls))
    if only is not None:
        only = list(only)
        unknown = sorted(set(only) - {field[0] for field in fields})
        if unknown:
            raise ValueError(f"no flag for {cls.__name__} field(s) {unknown}")
        fields = [field for field in fields if field[0] in only]
    for name, hint, default, help_text, owner in fields:
        if help_text is None:
            raise TypeError(f"{owner}.{name} has no entry under Attributes:")
        yield name, hint, default, help_text[:1].upper() + help_text[1:]


def all_fields(cls) -> Iterator[tuple[str, type, object, str | None, str]]:
    """``(name, type, default, help or None, class name)`` of every field of ``cls``, nested
    dataclasses flattened."""
    hints = typing.get_type_hints(cls)
    docs = attribute_help(cls)
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            yield from all_fields(hint)
            continue
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = None
        yield field.name, hint, default, docs.get(field.name), cls.__name__


def scalar_type(name: str, hint) -> type:
    """The flag type (`FLAG_TYPES`) of the field ``name`` annotated ``hint``: ``int`` for ``int``
    or ``int | None``, and so on; TypeError for anything else."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else hint
    if hint not in FLAG_TYPES:
        raise TypeError(f"field {name}: no flag type for {hint!r}; give it a parser")
    return hint
