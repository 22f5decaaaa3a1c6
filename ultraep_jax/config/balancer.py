"""`BalancerConfig`: what the planner may do, frozen and hashable (it keys compiled code)."""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from ultraep_jax.base.arguments import INT64_MAX, check_int
from ultraep_jax.base.layout import Layout, check_divisible

# Every integer field reaches the native planner as an int64 FFI attribute.
_INT64_MAX = INT64_MAX
#: The fields that may stay None (sizes read from the layer or the loads; one domain).
_OPTIONAL = ("num_experts", "ep_size", "ranks_per_domain")
# Loads are int32, so no expert ever has more tokens: a larger floor would mean the same.
MAX_MIN_TOKENS_PER_REPLICA = 2**31 - 1
# A rank fills at most num_experts - num_experts / ep_size slots (each foreign expert once); the
# bound keeps the planner's [ep_size, slots_per_rank] outputs and workspace allocatable.
MAX_SLOTS_PER_RANK = 4096
# The relay schedule computes in int32 (`relay`); no plan has that many copies of an expert.
MAX_FANOUT = 2**31 - 1
# Below this many tokens per EP rank a balanced layer cost more than plain dropless EP on every
# measured load, skewed or not (docs/serving.md, "The small-batch fallback").
DEFAULT_MIN_TOKENS_PER_RANK = 256


def _as_int(name: str, value, minimum: int, maximum: int = _INT64_MAX) -> int:
    """``value`` as a Python int in [minimum, maximum] (`check_int`: TypeError for a
    non-integer, ValueError out of range); NumPy integer scalars are accepted."""
    return check_int(f"BalancerConfig.{name}", value, minimum, maximum)


def _as_float(name: str, value) -> float:
    """``value`` as a finite Python float >= 0 (ints and NumPy integer/float scalars accepted)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"BalancerConfig.{name} must be a float, got {type(value).__name__} {value!r}"
        )
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"BalancerConfig.{name} must be finite and >= 0, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class BalancerConfig:
    """What the planner may do, for one expert-parallel group.

    Integer fields accept Python or NumPy integers and ``balance_eps`` any real scalar (NumPy
    float32 included); they are stored as Python ``int`` / ``float``.

    Attributes:
        num_experts: E, logical experts; expert ``e`` lives on rank ``e // (E // ep_size)``
            (`layout`). Optional: `plan` reads it from the load matrix's shape and the layer
            (`MoE`, `ExpertParallel`) from its own; when given, it must agree with them.
        ep_size: R, ranks on the expert-parallel mesh axis; must divide ``num_experts``.
            Optional, like ``num_experts`` (read from the loads' shape or the mesh).
        slots_per_rank: S, spare slots per rank, each able to hold one replica expert's weights,
            0 to 4096 (a rank fills at most ``num_experts - num_experts / ep_size`` of them). 0
            disables replication in `plan` (every token stays on its master); a layer refuses a
            balancer with 0 (it could never balance: pass ``balancer=None`` for plain EP).
        min_tokens_per_replica: the least tokens a replica may carry (each replica costs a weight
            transfer), 1 to 2**31 - 1 (no expert has more tokens, loads being int32); a smaller
            replica is allowed only when it exactly clears a rank's remaining excess, or in exact
            mode (``balance_eps == 0``) when the floor would stop the planner from reaching the
            mean.
        balance_eps: tolerance above the mean rank load: the planner aims for every rank at most
            ``ceil(mean * (1 + balance_eps))`` and raises the threshold only when its attempts
            fail there. 0 (exactly; a subnormal value is a tolerance) is exact mode: every rank
            at ``M = ceil(mean)`` whenever the planner's attempts find such a plan, with replicas
            below ``min_tokens_per_replica`` where needed. That is guaranteed whenever any plan at
            ``M`` exists if ``ep_size == 2`` or ``slots_per_rank >= num_experts - num_experts /
            ep_size``; otherwise the attempts are a heuristic, which missed ``M`` in 1 in 60,000
            to 80,000 small random cases where a plan at ``M`` exists (ffi/PLANNER.md, "What is
            guaranteed").
        master_keep_tokens: tokens an expert's master always keeps for itself.
        max_fanout: f, the relay bound of the replica weight transfer (ffi/TRANSFER.md): an
            expert's master sends its weights to at most f of its replicas (a rank whose masters
            are replicated shares f first-hop copies among them, at least one each) and every
            replica forwards them to at most f others, in a tree of as few hops as that allows;
            gradients return along the tree, summed at each relay. 0: no bound (every master sends
            every copy itself). The default 2 gave the shortest modelled transfer on the
            DeepSeek-R1, Qwen1.5-MoE and Switch traces (docs/results.md, "Relay"). At
            most 2**31 - 1 (the schedule computes in int32). Not
            a planner input: the plan is the same for every f. The portable (CPU) exchange moves
            every copy in one hop whatever f is: there every rank sends the same rows.
        min_tokens_per_rank: the fallback threshold: a layer whose EP ranks each hold fewer
            tokens than this (a static shape, so decided when the layer is traced) compiles plain
            expert parallelism, with no planner call, no replica slots and no weight transfer
            (`applies`), with a receive buffer that holds every pair (`ExpertParallel.capacity`:
            the fallback never drops a pair the balanced path would have kept). Small batches
            gain too little from balancing to repay the planner and the transfer. The default,
            256, is where balancing began to pay against plain dropless EP on skewed loads
            (docs/serving.md); 0: always balance.
        ranks_per_domain: d, the EP ranks joined by fast links (an NVLink domain: the GPUs of
            one node), each domain ``d`` consecutive ranks of the EP axis; must divide the EP
            size. The replica transfer then sends an expert's weights across the slow links once
            per remote domain that needs them and fans them out inside it (ffi/TRANSFER.md,
            "Fast domains"; ``max_fanout`` bounds each link class). The planner reads it too:
            among the targets that can take all a rank still has to shed, it prefers one in the
            master's domain or in a domain already holding a replica of the expert, which cut the
            slow-link copies by 10.6-26.1 % on the real traces at the same balance
            (ffi/PLANNER.md, ``pick_target``; docs/results.md). None (default): one domain, the
            whole EP group (the plans and the schedule of no domains, bit for bit).
    """

    num_experts: int | None = None
    ep_size: int | None = None
    slots_per_rank: int = 2
    min_tokens_per_replica: int = 1024
    balance_eps: float = 0.01
    master_keep_tokens: int = 1
    max_fanout: int = 2
    min_tokens_per_rank: int = DEFAULT_MIN_TOKENS_PER_RANK
    ranks_per_domain: int | None = None

    def __post_init__(self):
        # Normalised in place (the dataclass is frozen), so equal configs hash equal whatever
        # scalar types they were built from.
        for name, minimum, maximum in (
            ("num_experts", 1, _INT64_MAX),
            ("ep_size", 1, _INT64_MAX),
            ("slots_per_rank", 0, MAX_SLOTS_PER_RANK),
            ("min_tokens_per_replica", 1, MAX_MIN_TOKENS_PER_REPLICA),
            ("master_keep_tokens", 0, _INT64_MAX),
            ("max_fanout", 0, MAX_FANOUT),
            ("min_tokens_per_rank", 0, _INT64_MAX),
            ("ranks_per_domain", 1, _INT64_MAX),
        ):
            if getattr(self, name) is not None or name not in _OPTIONAL:
                value = _as_int(name, getattr(self, name), minimum, maximum)
                object.__setattr__(self, name, value)
        object.__setattr__(self, "balance_eps", _as_float("balance_eps", self.balance_eps))
        if self.num_experts is not None and self.ep_size is not None:
            check_divisible(self.num_experts, self.ep_size, "BalancerConfig")
        if self.ep_size is not None and self.ranks_per_domain is not None:
            if self.ep_size % self.ranks_per_domain:
                raise ValueError(
                    f"BalancerConfig: ranks_per_domain ({self.ranks_per_domain}) must divide the "
                    f"EP size ({self.ep_size})"
                )

    def sized(self, num_experts: int, ep_size: int, holder: str) -> BalancerConfig:
        """This configuration for E = ``num_experts`` experts on R = ``ep_size`` ranks, the sizes
        of ``holder`` (what they are read from, for the error): raises one line if the
        configuration states other sizes."""
        stated = (self.num_experts, self.ep_size)
        if any(
            v is not None and v != want
            for v, want in zip(stated, (num_experts, ep_size), strict=True)
        ):
            raise ValueError(
                f"BalancerConfig(num_experts={self.num_experts}, ep_size={self.ep_size}) does not "
                f"match {holder} ({num_experts} experts on {ep_size} ranks): leave num_experts and "
                f"ep_size out of the BalancerConfig (they are read from {holder})"
            )
        return dataclasses.replace(self, num_experts=num_experts, ep_size=ep_size)

    def applies(self, tokens_per_rank: int) -> bool:
        """Whether a layer whose EP ranks hold ``tokens_per_rank`` tokens each (static) balances:
        False below ``min_tokens_per_rank``, where it runs plain expert parallelism."""
        return tokens_per_rank >= self.min_tokens_per_rank

    @property
    def domain_size(self) -> int:
        """d, EP ranks per fast domain (the EP size when ``ranks_per_domain`` is None)."""
        if self.ranks_per_domain is not None:
            return self.ranks_per_domain
        if self.ep_size is None:
            raise ValueError(
                "BalancerConfig.domain_size: ep_size is not set (BalancerConfig.sized sets it)"
            )
        return self.ep_size

    @property
    def experts_per_rank(self) -> int:
        """E_m = E / R: master experts on each rank (of a configuration with both sizes)."""
        if self.num_experts is None or self.ep_size is None:
            raise ValueError(
                "BalancerConfig.experts_per_rank: num_experts and ep_size are not set (they are "
                "read from the loads or the layer; BalancerConfig.sized(E, R, ...) sets them)"
            )
        return Layout(self.num_experts, self.ep_size).experts_per_rank
