"""Plain NumPy rendering of the layer's dispatch rules, written independently of the library:
the reroute (which instance of an expert each source rank's pairs go to) and the capacity rule
(which pairs fit in the destination's receive buffer).

Instances: the E masters in expert order (expert e on rank e // E_m, local group e % E_m), then
the R*S spare slots in (rank, slot) order (local group E_m + slot).
"""

from __future__ import annotations

import numpy as np


def instances(slot_expert, num_experts: int):
    """(expert [I], host rank [I], local group [I]); expert -1 for an empty slot."""
    slot_expert = np.asarray(slot_expert)
    R, S = slot_expert.shape
    em = num_experts // R
    expert = np.concatenate([np.arange(num_experts), slot_expert.reshape(-1)])
    host = np.concatenate([np.arange(num_experts) // em, np.repeat(np.arange(R), S)])
    group = np.concatenate([np.arange(num_experts) % em, np.tile(em + np.arange(S), R)])
    return expert, host, group


def prefix_transport(loads, slot_expert, slot_quota, master_quota) -> np.ndarray:
    """int64 [R, I]: pairs each source sends to each instance, by the documented rule.

    Locality first: a source hosting an instance of expert e fills it from its own pairs (up to
    the quota). The rest is matched in a fixed order: sources 0..R-1 (what each has left) against
    e's instances in instance order (what each still needs), first come first served.
    """
    loads = np.asarray(loads, np.int64)
    R, E = loads.shape
    expert, host, _ = instances(slot_expert, E)
    quota = np.concatenate([np.asarray(master_quota), np.asarray(slot_quota).reshape(-1)])
    quota = np.where(expert >= 0, quota, 0).astype(np.int64)
    assign = np.zeros((R, expert.size), np.int64)
    for e in range(E):
        inst = [int(i) for i in np.flatnonzero(expert == e)]
        left = loads[:, e].copy()
        need = {i: int(quota[i]) for i in inst}
        for i in inst:
            take = min(left[host[i]], need[i])
            assign[host[i], i] += take
            left[host[i]] -= take
            need[i] -= take
        pending = [i for i in inst if need[i] > 0]
        for r in range(R):
            while left[r] > 0:
                i = pending[0]
                take = min(left[r], need[i])
                assign[r, i] += take
                left[r] -= take
                need[i] -= take
                if need[i] == 0:
                    pending.pop(0)
        assert not pending, "quotas exceed the expert's load"
    return assign


def kept_pairs(experts, assign, slot_expert, capacity: int) -> np.ndarray:
    """bool [R, N]: which pairs of each source fit in their destination's receive buffer.

    ``experts`` [R, N] is each source's pairs in pair order (token-major, then choice). The q-th
    pair (in pair order) of source r for expert e goes to the instance of e whose slice of r's
    counts, taken in instance order, holds q. A destination stores sources in rank order, each
    source's rows by local group, each group's rows in pair order, and keeps the first
    ``capacity`` rows.
    """
    experts = np.asarray(experts)
    R, N = experts.shape
    E = assign.shape[1] - np.asarray(slot_expert).size
    expert_of, host, group = instances(slot_expert, E)
    inst = np.zeros((R, N), np.int64)
    for r in range(R):
        seen = np.zeros(E, np.int64)
        for n in range(N):
            e = experts[r, n]
            q = seen[e]
            seen[e] += 1
            for i in np.flatnonzero(expert_of == e):
                if q < assign[r, i]:
                    inst[r, n] = i
                    break
                q -= assign[r, i]
            else:
                raise AssertionError("the counts do not cover the pairs")
    kept = np.zeros((R, N), bool)
    for d in range(R):
        used = 0
        for r in range(R):
            for g in sorted(set(group[host == d])):
                for n in range(N):
                    if host[inst[r, n]] == d and group[inst[r, n]] == g:
                        kept[r, n] = used < capacity
                        used += 1
    return kept
