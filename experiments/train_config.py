"""Configuration of a training run: a frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; `experiments.train` builds it from flags."""

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
    slots_per_rank: int = 4
    min_tokens_per_replica: int = 8
    balance_eps: float = 0.01
    capacity_factor: float | None = None  # None: dropless receive buffers
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
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"--capacity_factor must be > 0, got {self.capacity_factor}")
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
