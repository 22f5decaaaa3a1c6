"""The flags several programs share: the balancer's, the ranks', ``--capacity_factor`` (its
values, `parse_capacity_factor`), ``--json_out``, ``--traces_dir``, the layer benchmarks' and
their sweep's, the whole-step benchmarks'. A program takes its shared flags from here, never from
another program; flags made from a configuration dataclass are `experiments.lab.dataclass_flags`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Mapping

from absl import flags

from experiments.lab.dataclass_flags import define_flags

# The flags defined here belong to the module calling a define_* function (--helpshort lists them
# there), as if it had called DEFINE_* itself.
flags.disclaim_key_flags()

__all__ = [
    "AUTO",
    "check_capacity_factor",
    "define_capped_capacity_factor",
    "define_balancer_flags",
    "define_json_out",
    "define_layer_flags",
    "define_rank_flags",
    "define_step_case_flags",
    "define_sweep_flags",
    "define_traces_dir",
    "define_verbose_ranks",
    "parse_capacity_factor",
    "run_folder",
]

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


def define_layer_flags(
    *, pinned_ranks: int, swept: Iterable[str] = (), repeats: int = 15, **defaults
) -> tuple[Callable[[], dict], Callable[[], dict]]:
    """The flags of the skewed-router layer benchmarks (`experiments.lab.skewed_layer`): one per
    `SkewedLayer` field but those the program sweeps itself (``swept``; ``defaults`` replace
    fields' defaults), the balancer's (`define_balancer_flags`, at least 16 tokens a replica),
    ``--capacity_factor`` (auto: 1.05; never none), ``--repeats`` and ``--pinned_ranks``.

    Returns (the flags' `SkewedLayer` keywords, the balancer's `BalancerConfig` keywords).
    """
    from experiments.lab.skewed_layer import SkewedLayer

    fields = [f.name for f in dataclasses.fields(SkewedLayer) if f.name not in set(swept)]
    layer = define_flags(SkewedLayer, only=fields, defaults=defaults)
    balancer = define_balancer_flags(min_tokens_per_replica=16)
    define_capped_capacity_factor(
        1.05, "Receive buffer of the capped layers, as a multiple of the pairs a rank routes."
    )
    flags.DEFINE_integer("repeats", repeats, "Timed rounds (medians are reported).")
    flags.DEFINE_integer(
        "pinned_ranks",
        pinned_ranks,
        "EP ranks as this many processes, each pinned to its own core with one CPU device and at "
        "real-time priority where the system allows it (the wall clock is then the busiest "
        "rank's); 0: 8 simulated devices in this process.",
    )
    flags.register_validator("num_experts", lambda e: e > 0, "must be > 0")
    flags.register_validator("hot_experts", lambda n: n >= 0, "must be >= 0")
    if "tokens_per_device" in fields:
        flags.register_multi_flags_validator(
            ["seq_len", "tokens_per_device"],
            lambda v: v["seq_len"] > 0 and v["tokens_per_device"] % v["seq_len"] == 0,
            "--seq_len must divide --tokens_per_device",
        )
    return layer, balancer


def define_sweep_flags(tokens: Iterable[int], skews: bool) -> None:
    """``--tokens`` (default ``tokens``), ``--modes``, ``--quick`` and, with ``skews``,
    ``--skews``: a layer benchmark's sweep (`skewed_layer.sweep` reads them)."""
    from experiments.lab import skewed_layer as sl

    flags.DEFINE_list(
        "tokens", [str(t) for t in tokens], "Tokens per rank to measure (multiples of --seq_len)."
    )
    flags.DEFINE_list("modes", list(sl.MODES), "train and/or prefill.")
    quick = " and ".join(map(str, sl.QUICK_TOKENS))
    if skews:
        flags.DEFINE_list("skews", ["0", "1.6", "3"], "Router skews to measure (0: none).")
        quick += ", skews " + " and ".join(f"{s:g}" for s in sl.QUICK_SKEWS)
    flags.DEFINE_bool("quick", False, f"A smoke test: tokens {quick}, {sl.QUICK_REPEATS} rounds.")


def _validation(message: str | None) -> bool:
    """A validator's answer: True, or `flags.ValidationError` with ``message``."""
    if message is not None:
        raise flags.ValidationError(message)
    return True


def define_step_case_flags(*, modes: Iterable[str], cases: Iterable[str], rounds: int) -> None:
    """The whole-step benchmarks' flags (`experiments.lab.step_cases`): ``--pinned_ranks`` (2, at
    most the cores this process may use), ``--rounds`` (default ``rounds``), ``--steps``,
    ``--preset``, ``--batch_size``, ``--seed``, ``--data``, ``--modes`` and ``--train_cases``
    (defaults ``modes`` and ``cases``), with their checks."""
    from experiments.lab import step_cases as sc
    from models.presets import PRESETS

    cores = len(os.sched_getaffinity(0))
    flags.DEFINE_integer(
        "pinned_ranks",
        2,
        "EP ranks as this many pinned processes per run (experiments.train --pinned_ranks; the "
        "clock is the busiest rank's); 0: 8 simulated devices in one process (the clock is the "
        "total work).",
    )
    flags.DEFINE_integer("rounds", rounds, "Alternated rounds (medians over them).")
    flags.DEFINE_integer("steps", 40, "Steps per run (the first compiles: untimed).")
    flags.DEFINE_enum("preset", "moe_heavy", sorted(PRESETS), "Model preset.")
    flags.DEFINE_integer("batch_size", 32, "Global batch (sequences).")
    flags.DEFINE_integer("seed", 0, "Initialisation seed (the same in every run).")
    flags.DEFINE_string(
        "data",
        None,
        "Training text (experiments.train --data) of the cases without a text of their own.",
    )
    flags.DEFINE_list("modes", list(modes), f"Modes to run, of {', '.join(sc.MODES)}.")
    flags.DEFINE_list(
        "train_cases",
        list(cases),
        f"Training cases, each a router on a text, of {', '.join(sc.CASES)} (skewed: the softmax "
        "router on a text of its own that skews it more).",
    )
    flags.register_validator("modes", lambda v: _validation(sc.unknown_names("mode", v, sc.MODES)))
    flags.register_validator(
        "train_cases", lambda v: _validation(sc.unknown_names("case", v, sc.CASES))
    )
    flags.register_multi_flags_validator(
        ["data", "train_cases"],
        lambda v: _validation(sc.data_conflict(v["data"], v["train_cases"])),
    )
    flags.register_validator("rounds", lambda v: v >= 1, "must be >= 1")
    flags.register_validator("steps", lambda v: v >= 2, "must be >= 2 (the first step compiles)")
    flags.register_validator(
        "pinned_ranks",
        lambda v: 0 <= v <= cores,
        f"must be 0 (simulated devices) or at most the {cores} cores this process may use (a "
        "pinned rank takes a core of its own)",
    )
