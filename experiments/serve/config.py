"""Configuration of a prefill run: a frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
import math
import pathlib

from experiments.lab.cli import check_capacity_factor
from experiments.lab.training.config import (
    BALANCED_CAPACITY_FACTOR,
    TrainConfig,
    balancer_options,
    execution_of,
)
from ultraep_jax.config import DEFAULT_MIN_TOKENS_PER_RANK

#: ``--balance`` values: one mode, or both (balanced against plain expert parallelism).
BALANCE_MODES = ("ultraep", "none", "both")
#: ``--output`` default, inside the workdir.
OUTPUT_FILE = "serve.json"
#: ``--prompts`` default: the 24 prompts shipped beside this module (found from any folder).
DEFAULT_PROMPTS = str(pathlib.Path(__file__).resolve().with_name("prompts"))


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Everything a prefill run needs; `experiments.serve` builds it from flags.

    Attributes:
      workdir: a folder written by experiments.train: its config.json gives the model's shape,
        its newest checkpoint the parameters.
      prompts: the prompts: a file, a folder (every file below it) or a glob; each file is one
        prompt, its bytes the tokens (default: the 24 prompts of experiments/serve/prompts).
      balance: expert load balancing: ultraep (balanced), none (plain expert parallelism), or
        both: each mode prefills the same batch and the report compares them.
      output: JSON file of each prompt's next-token prediction and greedy continuation (empty:
        <workdir>/serve.json).
      new_tokens: greedy continuation length per prompt, as decode steps on the fallback path
        (plain expert parallelism, dropless); 0: none.
      capacity_factor: receive buffer per rank of the balanced prefill, as a multiple of the
        pairs it routes; pairs beyond it are dropped (and counted). auto: 1.05 (room for the
        balanced load); none: dropless (worst-case buffers); or a number. Plain prefill is
        dropless.
      slots_per_rank: spare slots per rank (0: the workdir's training value).
      min_tokens_per_replica: least tokens a replica carries.
      balance_eps: balance tolerance over the mean.
      min_tokens_per_rank: balanced prefill compiles plain expert parallelism when each rank
        holds fewer tokens than this (BalancerConfig.min_tokens_per_rank; 0: always balance).
      repeats: timed prefill calls per mode (the median is reported).
      ep_size: devices on the expert axis (0: all the tensor axis leaves); the rest is data.
      tensor_size: devices on a "tensor" axis that splits each expert's hidden width (expert
        tensor parallelism, as experiments.train --tensor_size); 0: the workdir's training
        value. The weights are the same whatever it is: a workdir trained with one value serves
        with any other that divides the devices and --d_ff, to the same predictions.
      planner: the balanced prefill's planner, as experiments.train --planner (auto, native or
        portable).
      max_fanout: the balanced prefill's relay bound of the replica transfer, as
        experiments.train --max_fanout (0: no bound).
      transfer_chunks: the balanced prefill's replica transfer in this many chunks, as
        experiments.train --transfer_chunks.
      ranks_per_domain: the balanced prefill's EP ranks per fast domain, as experiments.train
        --ranks_per_domain (0: one domain).
    """

    workdir: str = ""
    prompts: str = DEFAULT_PROMPTS
    balance: str = "both"
    output: str = ""
    new_tokens: int = 16
    capacity_factor: float | str | None = BALANCED_CAPACITY_FACTOR
    slots_per_rank: int = 0
    min_tokens_per_replica: int = 8
    balance_eps: float = 0.01
    min_tokens_per_rank: int = DEFAULT_MIN_TOKENS_PER_RANK
    repeats: int = 5
    ep_size: int = 0
    tensor_size: int = 0
    planner: str = TrainConfig.planner
    max_fanout: int = TrainConfig.max_fanout
    transfer_chunks: int = TrainConfig.transfer_chunks
    ranks_per_domain: int = 0

    def __post_init__(self):
        if not self.workdir:
            raise ValueError("--workdir must name a folder written by experiments.train")
        if not self.prompts:
            raise ValueError("--prompts must name a prompt file, folder or glob")
        if self.balance not in BALANCE_MODES:
            raise ValueError(
                f"--balance must be one of {', '.join(BALANCE_MODES)}, got {self.balance!r}"
            )
        for name, minimum in (
            ("new_tokens", 0),
            ("slots_per_rank", 0),
            ("min_tokens_per_replica", 1),
            ("min_tokens_per_rank", 0),
            ("repeats", 1),
            ("ep_size", 0),
            ("tensor_size", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"--{name} must be an int >= {minimum}, got {value!r}")
        execution_of(self.planner, self.transfer_chunks)
        balancer_options(self.max_fanout, self.ranks_per_domain)
        cf = check_capacity_factor(self.capacity_factor, BALANCED_CAPACITY_FACTOR)
        object.__setattr__(self, "capacity_factor", cf)
        if not (
            isinstance(self.balance_eps, (int, float))
            and math.isfinite(self.balance_eps)
            and self.balance_eps >= 0
        ):
            raise ValueError(f"--balance_eps must be finite and >= 0, got {self.balance_eps!r}")

    @property
    def modes(self) -> tuple[str, ...]:
        """The balance modes to run, balanced first."""
        return ("ultraep", "none") if self.balance == "both" else (self.balance,)
