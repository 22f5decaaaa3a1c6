"""NumPy reference of the relay schedule (ffi/TRANSFER.md), written from the spec with plain
loops over experts and tree levels; `ultraep_jax.replicas.relay` is compared against it."""

from __future__ import annotations

import numpy as np


def reference_schedule(slot_expert, experts_per_rank: int, max_fanout: int) -> dict:
    """hop, sender and source per slot ([R, S] each; 0 / R / 0 for an empty slot)."""
    slot_expert = np.asarray(slot_expert)
    R, S = slot_expert.shape
    em = experts_per_rank
    hop = np.zeros((R, S), np.int64)
    sender = np.full((R, S), R, np.int64)
    source = np.zeros((R, S), np.int64)
    experts = sorted({int(e) for e in slot_expert.ravel() if e >= 0})
    replicated_masters = np.zeros(R, np.int64)
    for e in experts:
        replicated_masters[e // em] += 1
    for e in experts:
        master = e // em
        replicas = [(t, s) for t in range(R) for s in range(S) if slot_expert[t, s] == e]
        # Relays first from ranks that master no replicated expert, then by distance.
        replicas.sort(key=lambda ts: (replicated_masters[ts[0]] > 0, (ts[0] - master) % R))
        if max_fanout == 0:
            root, fanout = len(replicas), len(replicas)
        else:
            root, fanout = max(1, max_fanout // replicated_masters[master]), max_fanout
        # Level 1 from the master, then each level from the one above, round robin.
        level = replicas[:root]
        for t, s in level:
            hop[t, s], sender[t, s], source[t, s] = 1, master, e % em
        rest, depth = replicas[root:], 1
        while rest:
            depth += 1
            below, rest = rest[: len(level) * fanout], rest[len(level) * fanout :]
            for i, (t, s) in enumerate(below):
                pt, ps = level[i % len(level)]
                hop[t, s], sender[t, s], source[t, s] = depth, pt, ps
            level = below
    return {"hop": hop, "sender": sender, "source": source}


def reference_send_copies(slot_expert, experts_per_rank: int, max_fanout: int) -> np.ndarray:
    """int [R]: copies each rank sends under the reference schedule."""
    sender = reference_schedule(slot_expert, experts_per_rank, max_fanout)["sender"]
    R = sender.shape[0]
    return np.bincount(sender.ravel(), minlength=R + 1)[:R]
