"""Names of the MoE layer's stage results for rematerialisation policies.

Each is given with `jax.ad_checkpoint.checkpoint_name` inside `core.routed_experts_local`. Under
``jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names(*uep.remat.NAMES))``
the backward pass reuses them: it neither re-plans nor redoes the token all-to-alls or the replica
weight transfer (its own all-to-alls, the transposes, remain). Save a subset to trade memory for
recomputation: `RECEIVED`, `RETURNED` and `REPLICAS` hold activations and weights (C rows of D,
T * K rows of D, S experts' weights per device); `PLAN` and `DISPATCH` hold small integer arrays.
"""

#: The plan, the all-gathered loads [R, E] and masked-token counts [R] it was made from.
PLAN = "ultraep_plan"
#: The dispatch arithmetic (`dispatch.Dispatch`: send order, exchange sizes and offsets, groups).
DISPATCH = "ultraep_dispatch"
#: The received token rows [C, D], grouped by local expert instance: the experts' input.
RECEIVED = "ultraep_received"
#: The replica experts' weights fetched from their masters, [S, ...] per tensor (per chunk).
REPLICAS = "ultraep_replicas"
#: The expert outputs returned to this device [T * K, D], before the weighted combine.
RETURNED = "ultraep_returned"

NAMES = (PLAN, DISPATCH, RECEIVED, REPLICAS, RETURNED)
