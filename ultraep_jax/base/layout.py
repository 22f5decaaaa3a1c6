"""The instance layout of an EP group: where each expert's master and each spare slot live.

R ranks, E experts, E_m = E / R masters per rank, S spare slots per rank. Expert ``e``'s master
is on rank ``e // E_m``, in local group ``e % E_m``. A rank's G = E_m + S local groups are its
masters, then its slots. Instances (the I = E + R*S columns of the reroute counts) are the E
masters in expert order, then the R*S slots in (rank, slot) order: instance ``E + r*S + s`` is
slot ``s`` of rank ``r``, in local group ``E_m + s``. ``ffi/layout.h`` is the same rule in C++.

The index tables depend on the sizes alone, so they are NumPy constants (static under `jit`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def check_divisible(
    num_experts: int,
    ep_size: int,
    where: str,
    *,
    axis: str | None = None,
    devices: int | None = None,
) -> None:
    """Raises ValueError (one line, prefixed by ``where``) unless the EP size divides
    ``num_experts`` (every rank masters E_m = E / R experts), naming the EP sizes that would: the
    divisors of E, those that also divide ``devices`` when given (the devices the EP axis shares
    with the data axes), and the mesh ``axis`` of the EP size when given."""
    if num_experts % ep_size == 0:
        return
    limit = num_experts if devices is None else devices
    fits = [d for d in range(1, limit + 1) if num_experts % d == 0 and limit % d == 0]
    listed = str(fits[0]) if len(fits) == 1 else f"{', '.join(map(str, fits[:-1]))} or {fits[-1]}"
    on = "" if axis is None else f" (mesh axis {axis!r})"
    among = "" if devices is None else f" within the {devices} token devices"
    raise ValueError(
        f"{where}: num_experts={num_experts} is not divisible by the EP size {ep_size}{on}; "
        f"EP sizes that fit {num_experts} experts{among}: {listed} (or num_experts a multiple "
        f"of {ep_size})"
    )


@dataclasses.dataclass(frozen=True)
class Layout:
    """The sizes of one EP group and the index tables they imply (see the module docstring).

    Attributes:
      num_experts: E.
      ep_size: R; divides E.
      slots_per_rank: S (0: masters only).
    """

    num_experts: int
    ep_size: int
    slots_per_rank: int = 0

    def __post_init__(self):
        check_divisible(self.num_experts, self.ep_size, "Layout")

    @classmethod
    def of(cls, loads_RE, slot_expert_RS=None) -> Layout:
        """The layout read from shapes: ``loads_RE`` [R, E] and the plan's ``slot_expert`` [R, S]
        (no slots when None)."""
        R, E = loads_RE.shape[-2:]
        S = 0 if slot_expert_RS is None else slot_expert_RS.shape[-1]
        return cls(int(E), int(R), int(S))

    @property
    def experts_per_rank(self) -> int:
        """E_m = E / R."""
        return self.num_experts // self.ep_size

    @property
    def num_groups(self) -> int:
        """G = E_m + S local groups per rank."""
        return self.experts_per_rank + self.slots_per_rank

    @property
    def num_instances(self) -> int:
        """I = E + R * S."""
        return self.num_experts + self.ep_size * self.slots_per_rank

    def master_rank(self, expert):
        """The rank of expert ``expert``'s master (int or int array, any shape)."""
        return expert // self.experts_per_rank

    def master_group(self, expert):
        """Expert ``expert``'s local group (its index among its rank's masters)."""
        return expert % self.experts_per_rank

    def slot_ranks(self) -> np.ndarray:
        """int32 [R * S]: the rank of each slot, slots in (rank, slot) order."""
        return np.repeat(np.arange(self.ep_size, dtype=np.int32), self.slots_per_rank)

    def instance_ranks(self) -> np.ndarray:
        """int32 [I]: the rank that hosts each instance."""
        masters = self.master_rank(np.arange(self.num_experts, dtype=np.int32))
        return np.concatenate([masters, self.slot_ranks()])

    def instance_groups(self) -> np.ndarray:
        """int32 [I]: each instance's local group on its rank (masters, then slots)."""
        masters = self.master_group(np.arange(self.num_experts, dtype=np.int32))
        slots = self.experts_per_rank + np.arange(self.slots_per_rank, dtype=np.int32)
        return np.concatenate([masters, np.tile(slots, self.ep_size)])

    def instance_at(self) -> np.ndarray:
        """int32 [R, G]: the instance in each (rank, local group)."""
        table = np.zeros((self.ep_size, self.num_groups), np.int32)
        table[self.instance_ranks(), self.instance_groups()] = np.arange(self.num_instances)
        return table

    def master_loads(self, expert_load_E: jax.Array) -> jax.Array:
        """int32 [..., R]: what each rank's masters hold, from per-expert loads [..., E]."""
        shape = expert_load_E.shape[:-1] + (self.ep_size, self.experts_per_rank)
        return jnp.sum(expert_load_E.reshape(shape), axis=-1, dtype=jnp.int32)

    def instance_experts(self, slot_expert_RS: jax.Array) -> jax.Array:
        """int32 [I]: the expert of each instance (-1 for an empty slot), from a plan's
        ``slot_expert`` [R, S]."""
        masters = jnp.arange(self.num_experts, dtype=jnp.int32)
        return jnp.concatenate([masters, slot_expert_RS.reshape(-1).astype(jnp.int32)])
