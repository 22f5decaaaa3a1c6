"""NumPy reference of the relay schedule (ffi/TRANSFER.md), written from the spec with plain
loops over experts, domains and tree levels; `ultraep_jax.replicas.relay` is compared against
it."""

from __future__ import annotations

import numpy as np


def _tree(root, nodes, fanout, first_hop, hop, sender, source, root_sender, root_source):
    """Writes the breadth-first tree of ``nodes`` ((rank, slot) in node order) below a root that
    sends to ``root`` of them in hop ``first_hop``; each later level ``fanout`` times the one
    above, node i of a level from node i mod |level above|."""
    level, rest, depth = nodes[:root], nodes[root:], first_hop
    for t, s in level:
        hop[t, s], sender[t, s], source[t, s] = depth, root_sender, root_source
    while rest:
        depth += 1
        below, rest = rest[: len(level) * fanout], rest[len(level) * fanout :]
        for i, (t, s) in enumerate(below):
            pt, ps = level[i % len(level)]
            hop[t, s], sender[t, s], source[t, s] = depth, pt, ps
        level = below


def reference_schedule(
    slot_expert, experts_per_rank: int, max_fanout: int, domain_size: int | None = None
) -> dict:
    """hop, sender and source per slot ([R, S] each; 0 / R / 0 for an empty slot)."""
    slot_expert = np.asarray(slot_expert)
    R, S = slot_expert.shape
    d = R if domain_size is None else domain_size
    em, f = experts_per_rank, max_fanout
    hop = np.zeros((R, S), np.int64)
    sender = np.full((R, S), R, np.int64)
    source = np.zeros((R, S), np.int64)
    out = (hop, sender, source)
    experts = sorted({int(e) for e in slot_expert.ravel() if e >= 0})

    def holders(e):
        return [(t, s) for t in range(R) for s in range(S) if slot_expert[t, s] == e]

    # c(r); its experts with a replica inside the master's domain; and those with one outside
    # it only (whose gateways the master sends to itself).
    c, c_fast, c_cross, c_slow = (np.zeros(R, np.int64) for _ in range(4))
    for e in experts:
        m = e // em
        c[m] += 1
        c_fast[m] += any(t // d == m // d for t, _ in holders(e))
        c_cross[m] += any(t // d != m // d for t, _ in holders(e))

    def relayed(e):  # a master with more than f experts to send across hands them to a local relay
        m = e // em
        local = any(t // d == m // d for t, _ in holders(e))
        return local and f > 0 and c_cross[m] > f

    for e in experts:
        m = e // em
        c_slow[m] += any(t // d != m // d for t, _ in holders(e)) and not relayed(e)
    for e in experts:
        m = e // em
        # Relays first from ranks that master no replicated expert, then by distance.
        nodes = sorted(holders(e), key=lambda ts: (c[ts[0]] > 0, (ts[0] - m) % R))
        local = [ts for ts in nodes if ts[0] // d == m // d]
        remote = {}
        for ts in nodes:
            if ts[0] // d != m // d:
                remote.setdefault(ts[0] // d, []).append(ts)
        gateways = [members[0] for members in remote.values()]
        gateways.sort(key=lambda ts: (c[ts[0]] > 0, (ts[0] - m) % R))

        def root_fanout(count, nodes_below):
            return len(nodes_below) if f == 0 else max(1, f // max(count, 1))

        fan = len(nodes) if f == 0 else f
        _tree(root_fanout(c_fast[m], local), local, fan, 1, *out, m, e % em)
        if relayed(e):  # the first local node relays to the gateways, from hop 2
            (lt, ls) = local[0]
            _tree(fan, gateways, fan, 2, *out, lt, ls)
        else:
            _tree(root_fanout(c_slow[m], gateways), gateways, fan, 1, *out, m, e % em)
        for members in remote.values():
            gt, gs = members[0]
            _tree(fan, members[1:], fan, hop[gt, gs] + 1, *out, gt, gs)
    return {"hop": hop, "sender": sender, "source": source}


def reference_send_copies(
    slot_expert, experts_per_rank: int, max_fanout: int, domain_size: int | None = None
) -> np.ndarray:
    """int [R]: copies each rank sends under the reference schedule."""
    sender = reference_schedule(slot_expert, experts_per_rank, max_fanout, domain_size)["sender"]
    R = sender.shape[0]
    return np.bincount(sender.ravel(), minlength=R + 1)[:R]


def reference_slow_copies(slot_expert, experts_per_rank: int, schedule: dict, domain_size: int):
    """int: copies whose sender and receiver are in different domains of ``domain_size``."""
    sender = schedule["sender"]
    R, S = sender.shape
    receiver = np.repeat(np.arange(R), S).reshape(R, S)
    sent = sender < R
    return int(np.sum(sent & (sender // domain_size != receiver // domain_size)))
