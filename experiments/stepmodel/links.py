"""The step model's links: what an all-to-all, a replica copy and a relayed replica transfer
cost, per link class (NVLink inside a node's domain, InfiniBand between domains).

Every rank sends and receives through its own links; the NVLink and InfiniBand parts of one
rank's traffic proceed concurrently, each at its class's rate; a rank's bytes to itself cost
nothing; the rank with the most to send or receive sets an exchange's time. Ranks are laid out
domain-contiguously: ranks ``r`` and ``d`` share NVLink when ``r // domain == d // domain``. A
single-class link (``Links.single``: one rate for every peer) is ``domain = 1``.

Shapes: R ranks, N plans (or layouts), C slots per rank.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments import common
from experiments.loads.ranks import held_off_home


@dataclasses.dataclass(frozen=True)
class Links:
    """Effective link rates of one rank, bytes/s per direction.

    Attributes:
      domain: ranks that share the NVLink class (1: every peer is on ``ib_bytes_s``).
      nvlink_bytes_s: rate to a peer in the rank's domain.
      ib_bytes_s: rate to a peer outside it.
    """

    domain: int
    nvlink_bytes_s: float
    ib_bytes_s: float

    def __post_init__(self):
        if self.domain < 1:
            raise ValueError(f"Links.domain={self.domain} must be >= 1")
        for field in ("nvlink_bytes_s", "ib_bytes_s"):
            if not getattr(self, field) > 0:
                raise ValueError(f"Links.{field}={getattr(self, field)} must be > 0")

    @classmethod
    def single(cls, gbps: float) -> Links:
        """One class: every peer at ``gbps`` GB/s per direction."""
        return cls(1, gbps * 1e9, gbps * 1e9)


def link_fractions(ep: int, domain: int) -> tuple[float, float]:
    """Fractions of a rank's all-to-all rows that cross NVLink and InfiniBand.

    Sources (or destinations) are uniform over the ``ep`` ranks of the group, which is laid out
    NVLink-domain-contiguously: ``min(domain, ep) - 1`` peers are on NVLink, ``ep - min(domain,
    ep)`` across InfiniBand, and ``1 / ep`` of the rows stay on the rank.
    """
    g = min(domain, ep)
    return (g - 1) / ep, (ep - g) / ep


def uniform_seconds(nbytes: float, ep: int, links: Links) -> float:
    """Time for a rank to move ``nbytes`` spread uniformly over the ``ep`` ranks of its group
    (its own share included): the NVLink and InfiniBand parts concurrently."""
    intra, inter = link_fractions(ep, links.domain)
    return max(nbytes * intra / links.nvlink_bytes_s, nbytes * inter / links.ib_bytes_s)


def exchange_seconds(units_RR: np.ndarray, unit_bytes: float, links: Links) -> float:
    """Seconds of an all-to-all in which source r sends ``units_RR[r, d]`` units of
    ``unit_bytes`` to rank d (float [R, R]): per rank, the bytes to its domain and to the other
    domains proceed concurrently at their rates; the busiest rank, sending or receiving, sets
    the time. On a uniform matrix this is `uniform_seconds` of one rank's row."""
    units = np.asarray(units_RR, np.float64)
    R = units.shape[0]
    node = np.arange(R) // links.domain
    same = node[:, None] == node[None, :]
    off = units * (1 - np.eye(R))
    near, far = off * same, off * ~same

    def busiest(axis: int) -> float:
        return float(
            np.max(
                np.maximum(
                    near.sum(axis=axis) / links.nvlink_bytes_s,
                    far.sum(axis=axis) / links.ib_bytes_s,
                )
            )
        )

    return unit_bytes * max(busiest(1), busiest(0))


def copy_seconds(nbytes: float, ep: int, links: Links) -> float:
    """Expected time to send one replica of ``nbytes`` to a uniformly random other rank of the
    group of ``ep``."""
    if ep <= 1:
        return 0.0
    g = min(links.domain, ep)
    p_nvl, p_ib = (g - 1) / (ep - 1), (ep - g) / (ep - 1)
    return nbytes * (p_nvl / links.nvlink_bytes_s + p_ib / links.ib_bytes_s)


def relay_copies(held_NRC, num_experts: int, fanout: int | None) -> dict[str, np.ndarray]:
    """The replica transfer of each of N held matrices ``[N, R, C]`` (the experts each rank
    receives weights of, -1: none) under the relay bound ``fanout`` (`replicas.relay`; 0 or
    None: direct, every copy from its master's rank in one hop), in expert copies: the busiest
    rank's copies sent (``send``), the transfer's length (``length``: each hop as long as the
    most copies one rank sends or receives in it, the hops one after another) and its hops
    (``hops``). Each float [N]."""
    held = np.asarray(held_NRC, np.int32)
    if not (held >= 0).any():  # nothing moves (also: no slots, which the schedule cannot take)
        zeros = np.zeros(held.shape[0])
        return {"send": zeros, "length": zeros, "hops": zeros}
    ranks = held.shape[1]
    fn = common.batched_transfer(ranks, num_experts // ranks, fanout or 0)
    send, length, hops = (np.asarray(a, np.float64) for a in fn(held))
    return {"send": send, "length": length, "hops": hops}


def transfer_copy_times(layouts, num_experts: int, fanout: int | None) -> np.ndarray:
    """float [N]: the replica transfer's length in copies (`relay_copies`) of each physical
    layout ``[N, R, C]`` (expert per slot): its instances off their expert's home rank."""
    return relay_copies(held_off_home(layouts, num_experts), num_experts, fanout)["length"]


def gather_seconds(ep: int, num_experts: int, links: Links) -> float:
    """All-gather of the int32 load matrix ``[R, E]`` before planning (each rank receives it)."""
    return uniform_seconds(float(ep) * num_experts * 4, ep, links)
