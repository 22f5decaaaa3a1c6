"""Balancer configuration."""

from __future__ import annotations

import dataclasses
import math


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"BalancerConfig.{name} must be an int, got {type(value).__name__} {value!r}"
        )
    if value < minimum:
        raise ValueError(f"BalancerConfig.{name} must be >= {minimum}, got {value}")


@dataclasses.dataclass(frozen=True)
class BalancerConfig:
    """What the planner may do, for one expert-parallel group.

    Attributes:
        num_experts: E, logical experts; expert ``e`` lives on rank ``e // (E // ep_size)``.
        ep_size: R, ranks on the expert-parallel mesh axis; must divide ``num_experts``.
        slots_per_rank: S, spare slots per rank, each able to hold one replica expert's weights.
            0 disables replication (the plan then keeps every token on its master).
        min_tokens_per_replica: the least tokens a replica may carry (each replica costs a weight
            transfer); a smaller replica is allowed only when it exactly clears a rank's remaining excess.
        balance_eps: tolerance above the mean rank load: the planner aims for every rank at most
            ``ceil(mean * (1 + balance_eps))`` and raises the threshold only when that is infeasible.
        master_keep_tokens: tokens an expert's master always keeps for itself.
    """

    num_experts: int
    ep_size: int
    slots_per_rank: int = 2
    min_tokens_per_replica: int = 1024
    balance_eps: float = 0.01
    master_keep_tokens: int = 1

    def __post_init__(self):
        _check_int("num_experts", self.num_experts, 1)
        _check_int("ep_size", self.ep_size, 1)
        _check_int("slots_per_rank", self.slots_per_rank, 0)
        _check_int("min_tokens_per_replica", self.min_tokens_per_replica, 1)
        _check_int("master_keep_tokens", self.master_keep_tokens, 0)
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"BalancerConfig: num_experts={self.num_experts} is not divisible by "
                f"ep_size={self.ep_size}"
            )
        if isinstance(self.balance_eps, bool) or not isinstance(self.balance_eps, (int, float)):
            raise TypeError(f"BalancerConfig.balance_eps must be a float, got {self.balance_eps!r}")
        if not math.isfinite(self.balance_eps) or self.balance_eps < 0:
            raise ValueError(
                f"BalancerConfig.balance_eps must be finite and >= 0, got {self.balance_eps}"
            )

    @property
    def experts_per_rank(self) -> int:
        """E_m = E / R: master experts on each rank."""
        return self.num_experts // self.ep_size
