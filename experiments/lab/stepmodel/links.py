"""The step model's links: what an all-to-all, a replica copy and a relayed replica transfer
cost, per link class (NVLink inside a node's domain, InfiniBand between domains).

Every rank sends and receives through its own links; the NVLink and InfiniBand parts of one
rank's traffic proceed concurrently, each at its class's rate; a rank's bytes to itself cost
nothing; the rank with the most to send or receive sets an exchange's time. Ranks are laid out
domain-contiguously: ranks ``r`` and ``d`` share NVLink when ``r // domain == d // domain``. A
single-class link (``Links.single``: one rate for every peer) is ``domain = 1``.

The relayed replica transfer has two charges: `relay_copies` counts it in copies (each hop as
long as the most copies one rank sends or receives in it, whatever their links), which the
simulator multiplies by one copy's expected time to a random rank (`copy_seconds`);
`relay_seconds` times each hop per link class (`busiest_seconds`, the all-to-all's rule), for
schedules whose copies' links matter (`experiments.stepmodel_programs.topology`).

Shapes: R ranks, N plans (or layouts), C slots per rank.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments.lab.batched import batched_transfer
from experiments.lab.loads.ranks import held_off_home
from experiments.lab.stepmodel.shapes import ExpertShape


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


def busiest_seconds(near_out, far_out, near_in, far_in, unit_bytes: float, links: Links):
    """Seconds of an exchange from the units each rank sends and receives over its own domain
    (``near_*``) and across domains (``far_*``), float arrays ``[..., R]``: per rank the two
    classes proceed concurrently, each at its rate, and sending and receiving are separate
    directions; the busiest rank sets the time. float ``[...]`` (the leading axes)."""

    def rank_seconds(near, far):
        near, far = np.asarray(near, np.float64), np.asarray(far, np.float64)
        return np.maximum(near / links.nvlink_bytes_s, far / links.ib_bytes_s)

    each = np.maximum(rank_seconds(near_out, far_out), rank_seconds(near_in, far_in))
    return unit_bytes * each.max(axis=-1)


def exchange_seconds(units_RR: np.ndarray, unit_bytes: float, links: Links) -> float:
    """Seconds of an all-to-all in which source r sends ``units_RR[r, d]`` units of
    ``unit_bytes`` to rank d (float [R, R]): per rank, the bytes to its domain and to the other
    domains proceed concurrently at their rates; the busiest rank, sending or receiving, sets
    the time (`busiest_seconds`). On a uniform matrix this is `uniform_seconds` of one rank's
    row."""
    units = np.asarray(units_RR, np.float64)
    R = units.shape[0]
    node = np.arange(R) // links.domain
    same = node[:, None] == node[None, :]
    off = units * (1 - np.eye(R))
    near, far = off * same, off * ~same
    out = busiest_seconds(near.sum(1), far.sum(1), near.sum(0), far.sum(0), unit_bytes, links)
    return float(out)


def copy_seconds(nbytes: float, ep: int, links: Links) -> float:
    """Expected time to send one replica of ``nbytes`` to a uniformly random other rank of the
    group of ``ep``."""
    if ep <= 1:
        return 0.0
    g = min(links.domain, ep)
    p_nvl, p_ib = (g - 1) / (ep - 1), (ep - g) / (ep - 1)
    return nbytes * (p_nvl / links.nvlink_bytes_s + p_ib / links.ib_bytes_s)


def exchange_and_transfer(
    token_rows_RR: np.ndarray, copies: float, experts: ExpertShape, links: Links
) -> tuple[float, float]:
    """``(one token all-to-all, one direction of the replica transfer)`` in seconds on
    ``links``: the dispatch's rows ``token_rows_RR`` [R, R] at ``experts``' row bytes
    (`exchange_seconds`), and ``copies``, the transfer's length in expert copies
    (`relay_copies`), each at one copy's expected time to a random other rank (`copy_seconds`)."""
    one_a2a = exchange_seconds(token_rows_RR, experts.row_bytes(), links)
    return one_a2a, copies * copy_seconds(experts.expert_bytes(), len(token_rows_RR), links)


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
    fn = batched_transfer(ranks, num_experts // ranks, fanout or 0)
    send, length, hops = (np.asarray(a, np.float64) for a in fn(held))
    return {"send": send, "length": length, "hops": hops}


def transfer_copy_times(layouts, num_experts: int, fanout: int | None) -> np.ndarray:
    """float [N]: the replica transfer's length in copies (`relay_copies`) of each physical
    layout ``[N, R, C]`` (expert per slot): its instances off their expert's home rank."""
    return relay_copies(held_off_home(layouts, num_experts), num_experts, fanout)["length"]


def relay_link_copies(hop_NRS, sender_NRS, domain: int) -> dict[str, np.ndarray]:
    """The copies of N relay schedules (`ultraep_jax.replicas.relay.RelaySchedule`'s ``hop_RS``
    and ``sender_RS``, int [N, R, S]: slot (t, s) receives in hop ``hop`` (0: empty) from rank
    ``sender``) per hop, rank and link class, the ranks laid out in domains of ``domain``
    consecutive ranks: int64 [N, H, R] each, H the most hops of any of them; ``near_out`` and
    ``far_out`` the copies a rank sends into its own domain and across domains, ``near_in`` and
    ``far_in`` those it receives."""
    hop, sender = np.asarray(hop_NRS, np.int64), np.asarray(sender_NRS, np.int64)
    N, R, _ = hop.shape
    H = int(hop.max(initial=0))
    receiver = np.broadcast_to(np.arange(R)[None, :, None], hop.shape)
    plan = np.broadcast_to(np.arange(N)[:, None, None], hop.shape)
    far = sender // domain != receiver // domain
    out = {}
    for name, rank, link in (
        ("near_out", sender, ~far),
        ("far_out", sender, far),
        ("near_in", receiver, ~far),
        ("far_in", receiver, far),
    ):
        sel = (hop > 0) & link
        out[name] = np.zeros((N, H, R), np.int64)
        np.add.at(out[name], (plan[sel], hop[sel] - 1, rank[sel]), 1)
    return out


def relay_seconds(hop_NRS, sender_NRS, copy_bytes: float, links: Links) -> dict[str, np.ndarray]:
    """One direction of the replica transfer of N relay schedules (`relay_link_copies`) on
    ``links``, copies of ``copy_bytes`` each: every hop is an exchange of whole copies
    (`busiest_seconds`: per rank the copies within its domain and across domains concurrently,
    each class at its rate; the busiest rank, sending or receiving, sets the hop), the hops one
    after another. float [N] each: ``seconds`` (the sum over hops), ``slow_copies`` (copies that
    cross domains) and ``hops`` (hops that move a copy)."""
    c = relay_link_copies(hop_NRS, sender_NRS, links.domain)
    hop_s = busiest_seconds(
        c["near_out"], c["far_out"], c["near_in"], c["far_in"], copy_bytes, links
    )
    moved = (c["near_out"] + c["far_out"]).sum(axis=2) > 0
    return {
        "seconds": hop_s.sum(axis=1),
        "slow_copies": c["far_out"].sum(axis=(1, 2)).astype(np.float64),
        "hops": moved.sum(axis=1).astype(np.float64),
    }


def gather_seconds(ep: int, num_experts: int, links: Links) -> float:
    """All-gather of the int32 load matrix ``[R, E]`` before planning (each rank receives it)."""
    return uniform_seconds(float(ep) * num_experts * 4, ep, links)
