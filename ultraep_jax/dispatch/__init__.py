"""The dispatch stage: from the loads and the plan, where each (token, choice) pair goes, in what
order rows travel, every size and offset of the token all-to-all, what the receive buffer keeps,
and the combine on the way back.

  reroute.py  pairs each source rank sends to each expert instance (locality first)
  counts.py   every rank's pairs per (source, destination, local group) and what fits
  order.py    this rank's `Dispatch`: pair instances, send order, the `comm.Exchange`
  combine.py  received rows to and from groups, the weighted combine
"""

from ultraep_jax.dispatch import reroute
from ultraep_jax.dispatch.combine import combine, from_groups, sent_pairs, to_groups
from ultraep_jax.dispatch.counts import GroupCounts, group_counts, kept_counts, rank_group_counts
from ultraep_jax.dispatch.order import (
    Dispatch,
    group_major_positions,
    pair_instances,
    plan_dispatch,
    send_order,
)

__all__ = [
    "Dispatch",
    "GroupCounts",
    "combine",
    "from_groups",
    "group_counts",
    "group_major_positions",
    "kept_counts",
    "pair_instances",
    "plan_dispatch",
    "rank_group_counts",
    "reroute",
    "send_order",
    "sent_pairs",
    "to_groups",
]
