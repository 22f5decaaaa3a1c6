"""absl flags generated from a frozen configuration dataclass: one flag per field.

A field's flag has the field's name, its default, the type of its annotation (``int``, ``float``,
``str``, ``bool``, or one of them ``| None``) and, as help, the field's entry in the ``Attributes:``
section of the class docstring. A field whose type is itself a dataclass contributes one flag per
field of that class, under the nested field's own (flat) name. A field listed in ``parsers`` is a
string flag whose text the parser turns into the value.

`given_values` reads back only the flags the command line set, so that the values a caller
starts from (a dataclass's defaults, or a preset) are overridden by what the user typed and by
nothing else.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping

from absl import flags

# The flags defined here belong to the module calling `define_flags` (--helpshort lists them
# there), as if it had called DEFINE_* itself.
flags.disclaim_key_flags()

__all__ = ["attribute_help", "define_flags", "flag_text", "given_values"]

_DEFINE = {
    bool: flags.DEFINE_bool,
    int: flags.DEFINE_integer,
    float: flags.DEFINE_float,
    str: flags.DEFINE_string,
}
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


def _flat_fields(cls) -> Iterator[tuple[str, type, object, str]]:
    """``(name, type, default, help)`` of every flag of ``cls``, nested dataclasses flattened.

    Raises:
      TypeError: a field has no docstring entry, or an annotation that is not one type or one
        type ``| None``.
    """
    hints = typing.get_type_hints(cls)
    docs = attribute_help(cls)
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            yield from _flat_fields(hint)
            continue
        if field.name not in docs:
            raise TypeError(f"{cls.__name__}.{field.name} has no entry under Attributes:")
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = None
        help_text = docs[field.name]
        yield field.name, hint, default, help_text[:1].upper() + help_text[1:]


def _scalar_type(name: str, hint) -> type:
    """``int`` for ``int`` or ``int | None``, and so on; TypeError for anything else."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else hint
    if hint not in _DEFINE:
        raise TypeError(f"field {name}: no flag type for {hint!r}; give it a parser")
    return hint


def flag_text(value) -> str:
    """A configuration value as it is written on the command line (``none`` for None)."""
    return "none" if value is None else str(value)


def define_flags(
    cls,
    parsers: Mapping[str, Callable[[str], object]] | None = None,
    flag_values: flags.FlagValues = flags.FLAGS,
) -> list[str]:
    """Defines one flag per field of the dataclass ``cls`` (see the module doc) for the module
    calling this; returns their names.

    Raises:
      TypeError: a field has no help or no flag type.
      flags.DuplicateFlagError: two fields, or a field and an existing flag, share a name.
    """
    parsers = parsers or {}
    names = []
    for name, hint, default, help_text in _flat_fields(cls):
        if name in parsers:
            flags.DEFINE_string(name, flag_text(default), help_text, flag_values=flag_values)
        else:
            define = _DEFINE[_scalar_type(name, hint)]
            define(name, default, help_text, flag_values=flag_values)
        names.append(name)
    return names


def given_values(
    cls,
    parsers: Mapping[str, Callable[[str], object]] | None = None,
    flag_values: flags.FlagValues = flags.FLAGS,
) -> dict[str, object]:
    """``{name: value}`` of the flags of ``cls`` that the command line set, by flat name, with
    ``parsers`` applied (a parser's ValueError propagates)."""
    parsers = parsers or {}
    out = {}
    for name, *_ in _flat_fields(cls):
        if flag_values[name].present:
            value = flag_values[name].value
            out[name] = parsers[name](value) if name in parsers else value
    return out
