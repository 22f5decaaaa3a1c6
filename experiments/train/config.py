"""Configuration of a training run: a frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
import math

#: ``capacity_factor`` default: resolved on construction by `auto_capacity_factor`.
AUTO = "auto"
#: The receive buffer of a balanced run, as a multiple of the mean routed load: room for the
#: balanced load (within ``balance_eps``) plus rounding, so nothing is dropped in practice.
BALANCED_CAPACITY_FACTOR = 1.05

#: Fields that fix the shape or the meaning of the model and optimizer state: a workdir's
#: checkpoints can only be resumed with the same values.
STATE_FIELDS = ("d_model", "num_layers", "num_heads", "d_ff", "num_experts", "top_k", "seq_len")
#: Fields that only say how long to train and how often to report: free to change on resume.
SCHEDULE_FIELDS = ("steps", "checkpoint_every", "eval_every", "print_every")


def auto_capacity_factor(balance: str) -> float | None:
    """The capacity factor that ``"auto"`` stands for: `BALANCED_CAPACITY_FACTOR` when the run
    balances (the buffer fits the balanced load), None (dropless, worst-case buffers) without."""
    return BALANCED_CAPACITY_FACTOR if balance == "ultraep" else None


def parse_capacity_factor(text: str) -> float | str | None:
    """The ``--capacity_factor`` flag's value: ``"auto"``, None for ``none``, or a float.

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


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; `experiments.train` builds it from flags.

    ``capacity_factor`` is the MoE receive buffer per rank as a multiple of the pairs it routes.
    It may be given as ``"auto"`` (the default), which construction replaces with
    `auto_capacity_factor` of ``balance``: 1.05 when balanced, None (dropless) without. After
    construction it is always a float or None.
    """

    workdir: str
    balance: str = "ultraep"  # "none" or "ultraep"
    steps: int = 200
    data: str | None = None  # None: the Python standard library's source files
    max_corpus_bytes: int = 16 << 20
    eval_fraction: float = 0.02
    eval_batches: int = 4
    batch_size: int = 16
    seq_len: int = 128
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    d_ff: int = 128
    num_experts: int = 16
    top_k: int = 2
    slots_per_rank: int = 2
    min_tokens_per_replica: int = 8
    balance_eps: float = 0.01
    capacity_factor: float | str | None = AUTO  # None: dropless; "auto": see the class doc
    learning_rate: float = 3e-3
    seed: int = 0
    ep_size: int = 0  # 0: every device on the EP axis
    checkpoint_every: int = 50
    eval_every: int = 50
    print_every: int = 10
    profile_loads: bool = False  # per-step, per-layer loads to <workdir>/loads.jsonl

    def __post_init__(self):
        if self.balance not in ("none", "ultraep"):
            raise ValueError(f"unknown --balance={self.balance!r}; expected none or ultraep")
        positive = (
            "steps",
            "max_corpus_bytes",
            "eval_batches",
            "batch_size",
            "seq_len",
            "d_model",
            "num_layers",
            "num_heads",
            "d_ff",
            "num_experts",
            "top_k",
            "min_tokens_per_replica",
            "checkpoint_every",
            "eval_every",
            "print_every",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name} must be a positive integer, got {value!r}")
        if self.slots_per_rank < 0 or self.ep_size < 0:
            raise ValueError("--slots_per_rank and --ep_size must be >= 0")
        if self.top_k > self.num_experts:
            raise ValueError(f"--top_k={self.top_k} exceeds --num_experts={self.num_experts}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"--d_model={self.d_model} is not divisible by --num_heads={self.num_heads}"
            )
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"--eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.capacity_factor == AUTO:
            object.__setattr__(self, "capacity_factor", auto_capacity_factor(self.balance))
        cf = self.capacity_factor
        if cf is not None:
            if isinstance(cf, bool) or not isinstance(cf, (int, float)):
                raise ValueError(f"--capacity_factor must be a number, auto or none, got {cf!r}")
            if not (math.isfinite(cf) and cf > 0):
                raise ValueError(f"--capacity_factor must be a finite number > 0, got {cf}")
            object.__setattr__(self, "capacity_factor", float(cf))
        if self.learning_rate <= 0 or self.balance_eps < 0:
            raise ValueError("--learning_rate must be > 0 and --balance_eps >= 0")
        if not self.workdir:
            raise ValueError("--workdir must be set")

    def check_devices(self, num_devices: int) -> tuple[int, int]:
        """(data, ep) mesh shape for ``num_devices``; raises ValueError when they do not fit."""
        ep = self.ep_size or num_devices
        if num_devices % ep:
            raise ValueError(f"--ep_size={ep} does not divide the {num_devices} devices")
        if self.num_experts % ep:
            raise ValueError(
                f"--num_experts={self.num_experts} is not divisible by the EP size {ep}"
            )
        if self.batch_size % num_devices:
            raise ValueError(
                f"--batch_size={self.batch_size} is not divisible by the {num_devices} devices"
            )
        return num_devices // ep, ep

    def to_json(self) -> dict:
        """The configuration as a JSON-ready dict (what ``<workdir>/config.json`` holds)."""
        return dataclasses.asdict(self)

    def compare_saved(self, saved: dict) -> tuple[list[str], list[str]]:
        """How this configuration differs from ``saved`` (a `to_json` of an earlier run).

        Returns:
          ``(blocking, changed)``: ``"--name=<saved> (given: <this>)"`` for every `STATE_FIELDS`
          value that differs (the earlier run's checkpoints do not fit this configuration), and
          ``"--name=<saved> -> <this>"`` for every other differing field except `SCHEDULE_FIELDS`
          and ``workdir`` (allowed, but the run no longer follows one configuration).
        """
        blocking, changed = [], []
        for field in dataclasses.fields(self):
            name = field.name
            if name in SCHEDULE_FIELDS or name == "workdir" or name not in saved:
                continue
            old, new = saved[name], getattr(self, name)
            if old == new:
                continue
            if name in STATE_FIELDS:
                blocking.append(f"--{name}={_flag_text(old)} (given: {_flag_text(new)})")
            else:
                changed.append(f"--{name}={_flag_text(old)} -> {_flag_text(new)}")
        return blocking, changed


def _flag_text(value) -> str:
    """A configuration value as it is written on the command line."""
    if value is None:
        return "none"
    return str(value)
