"""The experiments' flags: absl flags made from a configuration dataclass's fields, and the flags
several programs share (the balancer's, ``--json_out``, ``--traces_dir``).

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
import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping

from absl import flags

# The flags defined here belong to the module calling `define_flags` (--helpshort lists them
# there), as if it had called DEFINE_* itself.
flags.disclaim_key_flags()

__all__ = [
    "AUTO",
    "attribute_help",
    "check_capacity_factor",
    "define_capped_capacity_factor",
    "define_balancer_flags",
    "define_flags",
    "define_json_out",
    "define_traces_dir",
    "define_verbose_ranks",
    "flag_text",
    "given_values",
    "parse_capacity_factor",
    "run_folder",
]

_DEFINE = {
    bool: flags.DEFINE_bool,
    int: flags.DEFINE_integer,
    float: flags.DEFINE_float,
    str: flags.DEFINE_string,
}
_ENTRY = re.compile(r"(\w+):\s*(.*)")
#: The BalancerConfig fields a benchmark sets from the command line (the sizes come from its setup).
_BALANCER_FIELDS = ("slots_per_rank", "min_tokens_per_replica", "balance_eps")


#: ``--capacity_factor=auto``: the program's own default buffer (`check_capacity_factor`).
AUTO = "auto"


def run_folder(program: str) -> str:
    """Where ``program`` writes its figures by default: ``runs/<program>`` in the working folder
    (beside `experiments.train`'s ``runs/default``). The committed results (docs/,
    experiments/results/) are rewritten only when a flag names them, so that their provenance
    (the command, commit and date recorded with them) stays that of the run that made them."""
    return f"runs/{program}"


def parse_capacity_factor(text: str) -> float | str | None:
    """The ``--capacity_factor`` flag's value in every program that builds a balanced layer:
    ``"auto"`` (`AUTO`), None for ``none`` (dropless: worst-case buffers), or a float (checked by
    `check_capacity_factor`).

    Raises:
      ValueError: one line naming the flag when ``text`` is none of these.
    """
    value = text.strip().lower()
    if value in (AUTO, "none"):
        return None if value == "none" else AUTO
    try:
        return float(value)
    except ValueError:
        raise ValueError(
            f"--capacity_factor must be a number, auto or none, got {text!r}"
        ) from None


def check_capacity_factor(value, auto: float | None) -> float | None:
    """``value`` (a `parse_capacity_factor` result or a number) as a float, or None (dropless);
    ``"auto"`` stands for ``auto``.

    Raises:
      ValueError: one line naming the flag when ``value`` is not a finite number > 0, None or
        ``"auto"``.
    """
    if value == AUTO:
        value = auto
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"--capacity_factor must be a number, auto or none, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"--capacity_factor must be a finite number > 0, got {value}")
    return float(value)


#: Why the layer benchmarks refuse ``--capacity_factor=none``.
ALWAYS_DROPLESS = "this program always runs plain EP dropless beside its capped layers"


class _CappedFactorParser(flags.ArgumentParser):
    """``--capacity_factor`` of a program that needs a finite buffer: the values every program
    takes (`parse_capacity_factor`), ``auto`` standing for ``auto``; ``none`` (dropless) is a
    one-line error giving ``none_reason``."""

    def __init__(self, auto: float, none_reason: str):
        self.auto, self.none_reason = auto, none_reason

    def parse(self, argument) -> float:
        value = argument if isinstance(argument, float) else parse_capacity_factor(str(argument))
        value = check_capacity_factor(value, self.auto)
        if value is None:
            raise ValueError(
                f"none (dropless) is refused: {self.none_reason}; "
                f"give a number > 0, or auto ({self.auto:g})"
            )
        return value

    def flag_type(self) -> str:
        return "capacity factor"


def define_capped_capacity_factor(
    auto: float, help_text: str, none_reason: str = ALWAYS_DROPLESS
) -> flags.FlagHolder:
    """``--capacity_factor`` (default ``auto``, standing for ``auto``) of a program that needs a
    finite buffer: the same values as in train and serve (a number or ``auto``; ``none`` is
    refused with ``none_reason``, `_CappedFactorParser`), read back as a float."""
    return flags.DEFINE(
        _CappedFactorParser(auto, none_reason),
        "capacity_factor",
        AUTO,
        f"{help_text} A number > 0, or auto ({auto:g}). Not none (dropless): {none_reason}.",
        serializer=flags.ArgumentSerializer(),
    )


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


def define_balancer_flags(helps: Mapping[str, str] | None = None, **defaults) -> Callable[[], dict]:
    """``--slots_per_rank``, ``--min_tokens_per_replica`` and ``--balance_eps`` (see
    `define_flags`; defaults and help: BalancerConfig's unless ``defaults`` or ``helps`` name
    others)."""
    import ultraep_jax as uep

    return define_flags(uep.BalancerConfig, only=_BALANCER_FIELDS, defaults=defaults, helps=helps)


def define_rank_flags() -> tuple[flags.FlagHolder, flags.FlagHolder, flags.FlagHolder]:
    """``--coordinator_address``, ``--num_processes``, ``--process_id``: what
    `pinned_ranks.launch_pinned_ranks` gives each rank process it starts (for
    `pinned_ranks.start_distributed`); a user sets ``--pinned_ranks``, not these."""
    return (
        flags.DEFINE_string("coordinator_address", None, "Set by --pinned_ranks."),
        flags.DEFINE_integer("num_processes", 1, "Set by --pinned_ranks."),
        flags.DEFINE_integer("process_id", 0, "Set by --pinned_ranks."),
    )


def define_verbose_ranks() -> flags.FlagHolder:
    """``--verbose_ranks``: with ``--pinned_ranks``, also show the ranks' libraries' joining lines
    (`pinned_ranks.is_rank_library_line`)."""
    return flags.DEFINE_bool(
        "verbose_ranks",
        False,
        "With --pinned_ranks: also show what the ranks' libraries print as they join (gloo's "
        "connection lines, JAX's distributed-service log).",
    )


def define_json_out() -> flags.FlagHolder:
    """``--json_out``: a file to write the program's results to as JSON
    (`output_files.write_json`)."""
    return flags.DEFINE_string("json_out", None, "Also write the results to this JSON file.")


def define_traces_dir() -> flags.FlagHolder:
    """``--traces_dir``: the folder of the measured expert-load traces (default: this checkout's,
    `traces.default_traces_dir`)."""
    from experiments.lab.loads import traces

    return flags.DEFINE_string(
        "traces_dir",
        str(traces.default_traces_dir()),
        "Folder holding the real expert-load traces (one folder per trace).",
    )
