"""The relay schedule of the replica transfer: which rank sends each slot its weights, and when.

Without a bound, a master sends every replica of its expert itself. With ``max_fanout = f`` the
copies of one expert flow down a tree rooted at its master (ffi/TRANSFER.md is the spec):

  * replicas of expert e (on distinct ranks) are the nodes 1..k, those on ranks that master no
    replicated expert first, each group ordered by ``(rank - master) mod R``; the master is node
    0;
  * the master sends to ``a = max(1, f // c)`` of them, c being the number of replicated experts
    its rank masters (a rank's own masters cost it at most ``max(f, c)`` copies); every replica
    sends to at most f others;
  * nodes fill levels breadth first: level 1 holds nodes 1..a, level d >= 2 the next
    ``a * f**(d-2)`` nodes, and the i-th node of level d receives from node ``i mod |level
    d-1|`` of level d-1 in hop d.

With fast domains (``domain_size`` d < R: a node's GPUs, joined by slow links between nodes)
that tree covers the master's domain only; in each remote domain holding replicas the first node
is its gateway, the gateways form a tree of their own from the master (one slow-link crossing per
remote domain; a master with more than f experts to send across hands those with a local replica
to it), and each gateway roots its domain's tree; f bounds each link class separately.

Every rank computes the same schedule from the plan's ``slot_expert`` alone (jnp, inside jit, no
communication). Shapes follow the package's axis legend (`ultraep_jax`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ultraep_jax.base.layout import Layout


def static_hops(ep_size: int, max_fanout: int) -> int:
    """The most hops any plan's schedule can take on ``ep_size`` ranks: an expert has at most
    ``R - 1`` replicas, and with a root fan-out of 1 the first h levels hold ``1 + f + ... +
    f**(h-1)`` of them (1 hop when ``max_fanout`` is 0, no bound)."""
    if max_fanout == 0 or ep_size <= 2:
        return 1
    hops, held, level = 1, 1, 1
    while held < ep_size - 1:
        level *= max_fanout
        held += level
        hops += 1
    return hops


def hop_send_bound(
    ep_size: int,
    slots_per_rank: int,
    experts_per_rank: int,
    max_fanout: int,
    domain_size: int | None,
    hop: int,
) -> int:
    """The most expert copies one rank sends in hop ``hop`` (1-based) of any plan's schedule,
    the rows of the ragged transfer's operand (`replicas.transfer`). Without a bound (``max_fanout``
    0) a master sends every replica of its E_m experts itself, each on another rank. With f: in
    hop 1 only masters send, a rank's replicated masters sharing f root copies (at most max(f,
    E_m)); later only slots send, each to at most f others. With fast domains each link class
    has its own f (twice the copies; without a bound a gateway sends to the rest of its domain).
    Never more than the R x S slots. `tests/library/test_relay.py` and `test_domains.py` check it
    against every random plan's schedule."""
    R, S, em, f = ep_size, slots_per_rank, experts_per_rank, max_fanout
    one_domain = domain_size is None or domain_size == R
    if f == 0:  # with domains a gateway sends to the rest of its domain: no tighter bound
        return min(R * S, em * (R - 1)) if one_domain else R * S
    classes = 1 if one_domain else 2
    per_class = max(f, em) if hop == 1 else f * S
    return min(R * S, classes * per_class)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RelaySchedule:
    """Who sends each spare slot its expert's weights.

    Attributes:
      hop_RS: int32 [R, S], the hop (1-based) in which slot (t, s) receives; 0 for an empty slot.
      sender_RS: int32 [R, S], the rank that sends it; R for an empty slot.
      source_RS: int32 [R, S], the row the sender sends: its master's local index (hop 1, from
        the master) or the sender's slot holding the expert (hops >= 2, a relay); 0 when empty.
    """

    hop_RS: jax.Array
    sender_RS: jax.Array
    source_RS: jax.Array


def _tree_nodes(group_N, rank_N, master_N, busy_N, R):
    """(order, start_N, node_N), int32 [N] each: the replicas of one expert are consecutive in
    ``order`` (first those on ranks that master no replicated expert, ``busy_N`` False: they have
    sending to spare; each part by distance from the master); ``start_N`` is where a slot's expert
    begins in ``order`` and ``node_N`` its node (1-based) in that expert's tree."""
    n = group_N.shape[0]
    distance_N = (rank_N - master_N) % R
    order = jnp.lexsort((distance_N, busy_N, group_N))
    sorted_group = group_N[order]
    start_sorted = jnp.searchsorted(sorted_group, sorted_group, side="left").astype(jnp.int32)
    position_N = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    start_N = start_sorted[position_N]
    return order, start_N, position_N - start_N + 1


def _tree_levels(node_N, root_N, fanout: int, num_hops: int):
    """(level_N, parent_node_N), int32 [N]: each node's level (its hop) and the node it receives
    from (0: the master), levels filled breadth first: level 1 has ``root_N`` nodes, each next
    one ``fanout`` times the last; the i-th node of a level receives from node ``i mod |level
    above|`` of the level above."""
    n = node_N.shape[0]
    # Sizes capped at n + 1, more than any expert has replicas, so that nothing overflows.
    fanout = min(fanout, n + 1)
    first_N, size_N = jnp.ones(n, jnp.int32), root_N
    level_N = jnp.ones(n, jnp.int32)
    level_first_N = first_N  # first node of each node's own level
    prev_first_N, prev_size_N = jnp.zeros(n, jnp.int32), jnp.ones(n, jnp.int32)  # the level above
    for _ in range(1, num_hops):
        next_first_N = first_N + size_N
        deeper = node_N >= next_first_N
        level_N = level_N + deeper
        prev_first_N = jnp.where(deeper, first_N, prev_first_N)
        prev_size_N = jnp.where(deeper, size_N, prev_size_N)
        level_first_N = jnp.where(deeper, next_first_N, level_first_N)
        first_N = next_first_N
        size_N = jnp.where(size_N > (n + 1) // fanout, n + 1, size_N * fanout)
    parent_node_N = jnp.where(
        level_N == 1, 0, prev_first_N + (node_N - level_first_N) % prev_size_N
    )
    return level_N, parent_node_N


def schedule_hops(ep_size: int, max_fanout: int, domain_size: int | None = None) -> int:
    """The most hops any plan's schedule can take: the hop into the gateway tree's root, the
    gateway tree over the ``ep_size / domain_size`` domains (neither with one domain), then a
    domain's own tree (ffi/TRANSFER.md)."""
    d = ep_size if domain_size is None else domain_size
    domains = ep_size // d
    gateways = 1 + static_hops(domains, max_fanout) if domains > 1 else 0
    return gateways + static_hops(d, max_fanout)


def _masters_with(layout: Layout, expert_N: jax.Array, replica_N: jax.Array) -> jax.Array:
    """int32 [R]: experts each rank masters that have a slot (expert ``expert_N``) where
    ``replica_N``."""
    E = layout.num_experts
    marked_E = jnp.zeros(E, jnp.int32).at[jnp.where(replica_N, expert_N, E)].set(1, mode="drop")
    return layout.master_loads(marked_E)


@dataclasses.dataclass(frozen=True)
class _Slots:
    """What the schedule needs of each of the R * S slots (int32/bool [N] each)."""

    layout: Layout
    domain_size: int
    expert_N: jax.Array
    filled_N: jax.Array
    rank_N: jax.Array
    slot_N: jax.Array
    master_N: jax.Array
    local_N: jax.Array  # in its master's domain
    busy_N: jax.Array  # on a rank that masters a replicated expert

    @classmethod
    def of(cls, slot_expert_RS: jax.Array, experts_per_rank: int, d: int) -> _Slots:
        R, S = slot_expert_RS.shape
        layout = Layout(R * experts_per_rank, R, S)
        expert_N = slot_expert_RS.reshape(-1).astype(jnp.int32)
        filled_N = expert_N >= 0
        rank_N = jnp.asarray(layout.slot_ranks())
        master_N = jnp.where(filled_N, layout.master_rank(expert_N), 0)
        slot_N = jnp.arange(R * S, dtype=jnp.int32) % S
        local_N = rank_N // d == master_N // d
        busy_N = _masters_with(layout, expert_N, filled_N)[rank_N] > 0
        return cls(layout, d, expert_N, filled_N, rank_N, slot_N, master_N, local_N, busy_N)

    def masters_with(self, replica_N: jax.Array) -> jax.Array:
        """int32 [R]: experts each rank masters that have a slot where ``replica_N``."""
        return _masters_with(self.layout, self.expert_N, replica_N)

    def master_row(self) -> jax.Array:
        """int32 [N]: the master's local row of each slot's expert."""
        return self.layout.master_group(jnp.clip(self.expert_N, 0, None))

    def nodes(self, group_N: jax.Array):
        """`_tree_nodes` of the groups ``group_N``, relays first from ranks that master no
        replicated expert (they have sending to spare)."""
        return _tree_nodes(group_N, self.rank_N, self.master_N, self.busy_N, self.layout.ep_size)

    def senders(self, order, start_N, parent_N, first_N, root_rank_N, root_source_N):
        """(sender, source), int32 [N]: the root's (``root_*_N``) for a node whose parent is
        node 0, else the rank and slot of its parent, node ``parent_N`` of a tree whose node 1
        sits at ``order[start_N + first_N]``."""
        n = self.expert_N.shape[0]
        parent_flat_N = order[jnp.clip(start_N + first_N + parent_N - 1, 0, n - 1)]
        from_root_N = parent_N == 0
        sender_N = jnp.where(from_root_N, root_rank_N, self.rank_N[parent_flat_N])
        source_N = jnp.where(from_root_N, root_source_N, self.slot_N[parent_flat_N])
        return sender_N, source_N


def _level_fanout(slots: _Slots, max_fanout: int) -> int:
    """The fan-out of every level below a root: f, or with no bound (0) more than any expert
    has replicas."""
    return slots.expert_N.shape[0] + 1 if max_fanout == 0 else max_fanout


def _root_fanout(slots: _Slots, replica_N: jax.Array, max_fanout: int) -> jax.Array:
    """int32 [N]: how many nodes the master of each slot's expert sends to over one link class,
    a rank's masters with a replica ``replica_N`` sharing f (capped at n + 1, more than any
    expert has replicas, so that no level's bounds overflow int32 for a fan-out near 2**31)."""
    n = slots.expert_N.shape[0]
    if max_fanout == 0:
        return jnp.full(n, n + 1, jnp.int32)
    sharing_N = jnp.maximum(slots.masters_with(replica_N)[slots.master_N], 1)
    return jnp.minimum(jnp.maximum(1, max_fanout // sharing_N), n + 1)


def _domain_trees(slots: _Slots, max_fanout: int):
    """(hop, sender, source, gateway, node), int32 [N] each: every expert's tree inside each
    domain, rooted at the master in the master's domain (node 0) and at the first node, its
    gateway, in a remote one; a remote tree's hops count from its gateway's."""
    n, R, d = slots.expert_N.shape[0], slots.layout.ep_size, slots.domain_size
    E, local_N = slots.layout.num_experts, slots.local_N
    group_N = jnp.where(slots.filled_N, slots.expert_N * (R // d) + slots.rank_N // d, E * (R // d))
    order, start_N, node_N = slots.nodes(group_N)
    fanout = _level_fanout(slots, max_fanout)
    root_N = jnp.where(
        local_N, _root_fanout(slots, slots.filled_N & local_N, max_fanout), min(fanout, n + 1)
    )
    # A remote tree's node 0 is its gateway, the group's first slot in order.
    level_N, parent_N = _tree_levels(
        node_N - (~local_N), root_N, fanout, static_hops(d, max_fanout)
    )
    gateway_flat_N = order[start_N]
    root_rank_N = jnp.where(local_N, slots.master_N, slots.rank_N[gateway_flat_N])
    root_source_N = jnp.where(local_N, slots.master_row(), slots.slot_N[gateway_flat_N])
    sender_N, source_N = slots.senders(
        order, start_N, parent_N, (~local_N).astype(jnp.int32), root_rank_N, root_source_N
    )
    return level_N, sender_N, source_N, gateway_flat_N, node_N


def _gateway_tree(slots: _Slots, gate_N: jax.Array, domain_node_N: jax.Array, max_fanout: int):
    """(hop, sender, source), int32 [N] each: every expert's gateways (``gate_N``) in one tree
    over the slow links, rooted at the master; or, when the master has more than f experts to
    send across and this one has a replica in the master's domain, at that first local node
    (reached over a fast link in hop 1). ``domain_node_N``: each slot's node in its domain's
    tree (1: the first)."""
    n, R, d = slots.expert_N.shape[0], slots.layout.ep_size, slots.domain_size
    E = slots.layout.num_experts
    first_local_N = slots.filled_N & slots.local_N & (domain_node_N == 1)
    relay_E = (
        jnp.full(E, -1, jnp.int32)
        .at[jnp.where(first_local_N, slots.expert_N, E)]
        .set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    )
    relay_N = relay_E[jnp.clip(slots.expert_N, 0, E - 1)]
    # Only a master with more experts to send across than f hands them to local relays.
    crossing_N = slots.masters_with(slots.filled_N & ~slots.local_N)[slots.master_N]
    relayed_N = (relay_N >= 0) & (max_fanout > 0) & (crossing_N > max_fanout)
    relay_N = jnp.maximum(relay_N, 0)
    fanout = _level_fanout(slots, max_fanout)
    # The master shares f slow copies among its replicated experts that have no local relay.
    master_root_N = _root_fanout(slots, slots.filled_N & ~slots.local_N & ~relayed_N, max_fanout)
    order, start_N, node_N = slots.nodes(jnp.where(gate_N, slots.expert_N, E))
    level_N, parent_N = _tree_levels(
        node_N,
        jnp.where(relayed_N, min(fanout, n + 1), master_root_N),
        fanout,
        static_hops(R // d, max_fanout),
    )
    root_rank_N = jnp.where(relayed_N, slots.rank_N[relay_N], slots.master_N)
    root_source_N = jnp.where(relayed_N, slots.slot_N[relay_N], slots.master_row())
    sender_N, source_N = slots.senders(order, start_N, parent_N, 0, root_rank_N, root_source_N)
    return level_N + relayed_N, sender_N, source_N


def relay_schedule(
    slot_expert_RS: jax.Array,
    experts_per_rank: int,
    max_fanout: int,
    domain_size: int | None = None,
) -> RelaySchedule:
    """The relay tree of every replicated expert of a plan (see the module docstring).

    Args:
      slot_expert_RS: int32 [R, S], the plan's slots (-1 empty).
      experts_per_rank: E_m.
      max_fanout: f >= 0; 0 for no bound (every root sends to all its nodes in one hop).
      domain_size: d, ranks per fast domain (dividing R; None: one domain). With more than one
        domain a copy crosses into each remote domain once, to a gateway, and fans out there.
    """
    R, S = slot_expert_RS.shape
    d = R if domain_size is None else domain_size
    if max_fanout == 0 and d == R:
        return direct_schedule(slot_expert_RS, experts_per_rank)
    slots = _Slots.of(slot_expert_RS, experts_per_rank, d)
    hop_N, sender_N, source_N, gateway_flat_N, node_N = _domain_trees(slots, max_fanout)
    if d < R:
        gate_N = slots.filled_N & ~slots.local_N & (node_N == 1)
        gate_hop_N, gate_sender_N, gate_source_N = _gateway_tree(slots, gate_N, node_N, max_fanout)
        sender_N = jnp.where(gate_N, gate_sender_N, sender_N)
        source_N = jnp.where(gate_N, gate_source_N, source_N)
        # A gateway receives in its gateway tree's hop; its domain's tree follows it.
        remote_hop_N = gate_hop_N[gateway_flat_N] + jnp.where(gate_N, 0, hop_N)
        hop_N = jnp.where(slots.local_N, hop_N, remote_hop_N)
    filled_N = slots.filled_N
    return RelaySchedule(
        hop_RS=jnp.where(filled_N, hop_N, 0).reshape(R, S),
        sender_RS=jnp.where(filled_N, sender_N, R).reshape(R, S),
        source_RS=jnp.where(filled_N, source_N, 0).reshape(R, S),
    )


def direct_schedule(slot_expert_RS: jax.Array, experts_per_rank: int) -> RelaySchedule:
    """The schedule of ``max_fanout = 0`` in one domain: every slot from its expert's master, in
    hop 1 (the tree's root then sends to all its nodes; no sort needed)."""
    R = slot_expert_RS.shape[0]
    e_RS = slot_expert_RS.astype(jnp.int32)
    filled_RS = e_RS >= 0
    layout = Layout(R * experts_per_rank, R)
    return RelaySchedule(
        hop_RS=filled_RS.astype(jnp.int32),
        sender_RS=jnp.where(filled_RS, layout.master_rank(e_RS), R),
        source_RS=jnp.where(filled_RS, layout.master_group(e_RS), 0),
    )


def send_copies(schedule: RelaySchedule) -> jax.Array:
    """int32 [R]: expert copies each rank sends under ``schedule`` (all hops)."""
    R = schedule.sender_RS.shape[0]
    sent = schedule.sender_RS.reshape(-1)[None, :] == jnp.arange(R, dtype=jnp.int32)[:, None]
    return jnp.sum(sent, axis=1, dtype=jnp.int32)


def hop_copies(schedule: RelaySchedule, num_hops: int) -> tuple[jax.Array, jax.Array]:
    """(sent, received), int32 [H, R] each: copies each rank sends and receives in each of the
    first ``num_hops`` hops (for cost models: a hop lasts as long as its busiest link)."""
    R, S = schedule.sender_RS.shape
    hop_N = schedule.hop_RS.reshape(-1)
    in_range_N = (hop_N >= 1) & (hop_N <= num_hops)
    cell_N = jnp.where(in_range_N, (hop_N - 1) * R, num_hops * R)  # out-of-range: dropped
    receiver_N = jnp.repeat(jnp.arange(R, dtype=jnp.int32), S)  # the row of each slot
    ones_N = jnp.ones(R * S, jnp.int32)

    def count(rank_N):
        counts = jnp.zeros(num_hops * R, jnp.int32).at[cell_N + rank_N].add(ones_N, mode="drop")
        return counts.reshape(num_hops, R)

    return count(schedule.sender_RS.reshape(-1)), count(receiver_N)


def largest_send_bytes(schedule: RelaySchedule, copy_bytes: int) -> jax.Array:
    """float32 []: the most bytes one rank sends under ``schedule`` (``copy_bytes`` per expert
    copy, all hops, both link classes)."""
    return jnp.max(send_copies(schedule)).astype(jnp.float32) * jnp.float32(copy_bytes)
