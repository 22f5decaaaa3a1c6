"""Flags made from a configuration dataclass's fields (`define_flags`), read back whole or as
the command line set them (`given_values`).

A field's flag has the field's name, its default, the type of its annotation (``int``, ``float``,
``str``, ``bool``, or one of them ``| None``) and, as help, the field's entry in the ``Attributes:``
section of the class docstring. A field whose type is itself a dataclass contributes one flag per
field of that class, under the nested field's own (flat) name. A field listed in ``parsers`` is a
string flag whose text the parser turns into the value.

Why our own helper rather than ``ml_collections.config_flags.DEFINE_config_dataclass`` (the Flax
examples' convention): that one defines a single ``--config`` flag overridden as
``--config.model.d_model=32``, while our README commands, tests and saved ``config.json`` files
use flat names (``--d_model=32``) that name the same field in every program; ``--helpshort``
lists each of our flags with its docstring help, where config_flags lists only ``--config``; and
`given_values` tells which flags the command line set, so that a ``--preset`` supplies the other
values. Keeping those for a user would mean wrapping config_flags in about as much code as this
module, plus a dependency.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping

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


def _flat_fields(cls, only: Iterable[str] | None) -> Iterator[tuple[str, type, object, str]]:
    """``(name, type, default, help)`` of every flag of ``cls``, nested dataclasses flattened;
    only the fields named in ``only`` when it is given.

    Raises:
      TypeError: a field has no docstring entry, or an annotation that is not one type or one
        type ``| None``.
      ValueError: ``only`` names a field ``cls`` does not have.
    """
    fields = list(_all_fields(cls))
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


def _all_fields(cls) -> Iterator[tuple[str, type, object, str | None, str]]:
    """``(name, type, default, help or None, class name)`` of every field of ``cls``, nested
    dataclasses flattened."""
    hints = typing.get_type_hints(cls)
    docs = attribute_help(cls)
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            yield from _all_fields(hint)
            continue
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = None
        yield field.name, hint, default, docs.get(field.name), cls.__name__


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
    *,
    only: Iterable[str] | None = None,
    defaults: Mapping[str, object] | None = None,
    helps: Mapping[str, str] | None = None,
) -> Callable[[], dict[str, object]]:
    """Defines one flag per field of the dataclass ``cls`` (see the module doc), or per field
    named in ``only``, for the module calling this; ``defaults`` and ``helps`` replace fields'
    defaults and docstring help (for a program whose default means something of its own).

    Returns a function that reads every one of these flags' values (``parsers`` applied) as
    keyword arguments of ``cls``; `given_values` reads only those the command line set.

    Raises:
      TypeError: a field has no help or no flag type.
      ValueError: ``only``, ``defaults`` or ``helps`` names a field that gets no flag.
      flags.DuplicateFlagError: two fields, or a field and an existing flag, share a name.
    """
    parsers, defaults, helps = parsers or {}, defaults or {}, helps or {}
    fields = list(_flat_fields(cls, only))
    unknown = sorted((set(defaults) | set(helps)) - {name for name, *_ in fields})
    if unknown:
        raise ValueError(f"no flag for {cls.__name__} field(s) {unknown}")
    for name, hint, default, help_text in fields:
        default, help_text = defaults.get(name, default), helps.get(name, help_text)
        if name in parsers:
            flags.DEFINE_string(name, flag_text(default), help_text, flag_values=flag_values)
        else:
            define = _DEFINE[_scalar_type(name, hint)]
            define(name, default, help_text, flag_values=flag_values)
    names = [name for name, *_ in fields]
    return lambda: _read(names, parsers, flag_values, given_only=False)


def given_values(
    cls,
    parsers: Mapping[str, Callable[[str], object]] | None = None,
    flag_values: flags.FlagValues = flags.FLAGS,
) -> dict[str, object]:
    """``{name: value}`` of the flags of ``cls`` that the command line set, by flat name, with
    ``parsers`` applied (a parser's ValueError propagates)."""
    names = [name for name, *_ in _all_fields(cls)]
    return _read(names, parsers or {}, flag_values, given_only=True)


def _read(names, parsers, flag_values, given_only: bool) -> dict[str, object]:
    """``{name: value}`` of the flags ``names`` (those the command line set, if ``given_only``),
    ``parsers`` applied."""
    out = {}
    for name in names:
        if flag_values[name].present or not given_only:
            value = flag_values[name].value
            out[name] = parsers[name](value) if name in parsers else value
    return out
