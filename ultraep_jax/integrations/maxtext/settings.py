"""`Balancing`: how MaxText's MoE blocks run when ultraep_jax is switched on, and its
``ultraep_*`` keys (what the command takes off MaxText's own key=value overrides)."""

from __future__ import annotations

import ast
import dataclasses
import math

from ultraep_jax.base.arguments import check_finite
from ultraep_jax.config import BalancerConfig, Execution
from ultraep_jax.integrations.maxtext.coverage import OVERRIDE, TESTED_MAXTEXT
from ultraep_jax.integrations.maxtext.remat import canonical, names_from_text

#: The prefix of our keys among MaxText's key=value overrides.
PREFIX = "ultraep_"


def _text(default) -> str:
    """A default as the command takes it (None as none)."""
    return "none" if default is None else str(default)


_BALANCER_FIELDS = {
    f.name: f.default
    for f in dataclasses.fields(BalancerConfig)
    if f.name not in ("num_experts", "ep_size")
}
_EXECUTION_FIELDS = {
    f.name: f.default for f in dataclasses.fields(Execution) if f.name != "activation"
}
_BALANCER_KEYS = tuple(_BALANCER_FIELDS)
_EXECUTION_KEYS = tuple(_EXECUTION_FIELDS)
_FLAGS = {"true": True, "1": True, "yes": True, "on": True}
_FLAGS |= {"false": False, "0": False, "no": False, "off": False}

#: Every key the command accepts (without the prefix), with its help line.
KEYS = {
    "balancer": "on (default) or off: off runs plain expert parallelism through ultraep_jax",
    "capacity_factor": (
        "receive-buffer rows per EP rank as a multiple of the pairs it routes; none (default) "
        "drops nothing, as MaxText's sparse_matmul"
    ),
    "remat": (
        "the balanced block's stages MaxText's remat policy also saves: plan, dispatch, received, "
        "replicas, returned (or uep.remat's names, ultraep_plan, ...; comma-separated), all, or "
        "none (default: recomputed)"
    ),
    **{
        k: f"BalancerConfig.{k} (default {_text(v)}; docs/api.md)"
        for k, v in _BALANCER_FIELDS.items()
    },
    **{k: f"Execution.{k} (default {_text(v)}; docs/api.md)" for k, v in _EXECUTION_FIELDS.items()},
    OVERRIDE: (
        f"true runs on a MaxText release other than the tested one ({TESTED_MAXTEXT}), which is "
        "otherwise refused (default false)"
    ),
}


@dataclasses.dataclass(frozen=True)
class Balancing:
    """How MaxText's routed MoE blocks run under `ultraep_jax.integrations.maxtext.enable`.

    Attributes:
      balancer: the `BalancerConfig` (E and the EP size come from MaxText's config and mesh), or
        None for plain expert parallelism through ultraep_jax (no planner, no replicas).
      capacity_factor: receive-buffer rows per EP rank as a multiple of the (token, choice) pairs
        it routes; pairs beyond it are dropped and counted in the step's metrics. None (default)
        sizes the buffer so that nothing is ever dropped, as MaxText's own sparse_matmul.
      execution: planner, expert kernel, exchange backend and transfer chunks (`Execution`); the
        gated activation is MaxText's (``mlp_activations``) and may not be set here.
      remat_saved: the stages MaxText's remat policy saves besides its own (`remat.with_saved`),
        each as a `uep.remat.NAMES` entry or as the command spells it (``plan``; a string is
        read as the command reads it: ``"plan,dispatch"``, ``"all"``): the backward
        pass reuses them instead of re-planning and redoing the exchanges. () (default):
        MaxText's policy as it is.
    """

    balancer: BalancerConfig | None = BalancerConfig()
    capacity_factor: float | None = None
    execution: Execution = Execution()
    remat_saved: tuple[str, ...] = ()

    def __post_init__(self):
        if self.balancer is not None and not isinstance(self.balancer, BalancerConfig):
            raise TypeError(
                "maxtext: balancer must be a BalancerConfig or None, got "
                f"{type(self.balancer).__name__}"
            )
        if not isinstance(self.execution, Execution):
            raise TypeError(
                f"maxtext: execution must be an Execution, got {type(self.execution).__name__}"
            )
        if self.execution.activation != Execution().activation:
            raise ValueError(
                "maxtext: the experts' activation is MaxText's own (mlp_activations); leave "
                "Execution.activation unset"
            )
        if self.capacity_factor is not None:
            cf = check_finite("maxtext", "capacity_factor", self.capacity_factor, positive=True)
            object.__setattr__(self, "capacity_factor", cf)
        saved = self.remat_saved
        saved = names_from_text(saved) if isinstance(saved, str) else canonical(tuple(saved))
        object.__setattr__(self, "remat_saved", saved)


def balancing_from_keys(keys: dict[str, str]) -> Balancing:
    """The `Balancing` that ``ultraep_*`` keys (prefix taken off, values as typed on a command
    line) describe; raises one line naming an unknown key or a bad value."""
    unknown = sorted(set(keys) - set(KEYS))
    if unknown:
        raise ValueError(
            f"maxtext: unknown key(s) {', '.join(PREFIX + k for k in unknown)}; the keys are "
            f"{', '.join(PREFIX + k for k in KEYS)}"
        )
    if OVERRIDE in keys:
        raise ValueError(f"maxtext: {PREFIX}{OVERRIDE} is the command's (command_settings)")
    keys = dict(keys)
    remat_saved = names_from_text(keys.pop("remat", "none"))
    values = {k: _value(k, v) for k, v in keys.items()}
    switch = values.pop("balancer", "on")
    if switch not in ("on", "off"):
        raise ValueError(f"maxtext: {PREFIX}balancer must be on or off, got {switch!r}")
    balancer_args = {k: values.pop(k) for k in _BALANCER_KEYS if k in values}
    if switch == "off" and balancer_args:
        raise ValueError(
            f"maxtext: {PREFIX}balancer=off with balancer settings "
            f"({', '.join(PREFIX + k for k in balancer_args)}): drop one or the other"
        )
    execution_args = {k: values.pop(k) for k in _EXECUTION_KEYS if k in values}
    return Balancing(
        balancer=BalancerConfig(**balancer_args) if switch == "on" else None,
        capacity_factor=values.pop("capacity_factor", None),
        execution=Execution(**execution_args),
        remat_saved=remat_saved,
    )


def command_settings(keys: dict[str, str]) -> tuple[Balancing, bool]:
    """The command's ``ultraep_*`` keys (prefix taken off) as the `Balancing` and whether to run
    an untested MaxText release (`coverage.OVERRIDE`); raises one line for a bad key or value."""
    keys = dict(keys)
    text = keys.pop(OVERRIDE, "false")
    if text.lower() not in _FLAGS:
        raise ValueError(f"maxtext: {PREFIX}{OVERRIDE} must be true or false, got {text!r}")
    return balancing_from_keys(keys), _FLAGS[text.lower()]


def split_keys(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """``argv`` less its ``ultraep_<key>=<value>`` items (also ``--ultraep_<key>=<value>``), and
    those items as {key: value} with the prefix taken off; raises one line for one without a
    value or given twice."""
    rest, ours = [], {}
    for arg in argv:
        bare = arg[2:] if arg.startswith("--") else arg
        if not bare.startswith(PREFIX):
            rest.append(arg)
            continue
        key, sep, value = bare[len(PREFIX) :].partition("=")
        if not sep:
            raise ValueError(f"maxtext: {arg!r} needs a value ({PREFIX}{key}=...)")
        if key in ours:
            raise ValueError(f"maxtext: {PREFIX}{key} given twice")
        ours[key] = value
    return rest, ours


def _value(key: str, text: str):
    """A key's value from its text: none/None -> None, numbers as numbers, else the string;
    raises one line for a number that is not finite (nan, inf)."""
    if text.lower() == "none":
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = _float_or_none(text)
        if value is None:
            return text
    if isinstance(value, bool | int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"maxtext: {PREFIX}{key}={text} is not a finite number")
        return value
    raise ValueError(f"maxtext: {PREFIX}{key}={text!r} is not a number, a name or none")


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
