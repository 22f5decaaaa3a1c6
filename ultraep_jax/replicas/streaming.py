"""The experts of a balanced rank with the replica weights streamed in chunks of the hidden width.

A gated MLP is a sum over the hidden width F: ``(act(x @ w_gate) * (x @ w_up)) @ w_down`` equals
the sum over column chunks Fc of ``(act(x @ w_gate[:, Fc]) * (x @ w_up[:, Fc])) @ w_down[Fc]``
(the activation is elementwise). With
``chunks = n > 1`` the slots' weights move as n transfers, one per chunk (each through the relay
schedule), and each chunk's slot matmuls read only that chunk, so XLA may run chunk c's matmuls
while chunk c + 1 is still in flight (ffi/TRANSFER.md, "Streamed transfer"). Experts with biases
(gpt-oss) split the gate and up biases with their columns; the down bias, added to the sum,
travels with the first chunk only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from ultraep_jax import remat
from ultraep_jax._vma import vary, varying_axes
from ultraep_jax.checks import check_chunk_count
from ultraep_jax.experts.registry import fuses_stacks, grouped_glu
from ultraep_jax.replicas import relay, transfer


def hidden_chunks(d_ff: int, chunks: int) -> list[slice]:
    """``chunks`` consecutive column ranges of ``range(d_ff)``, sizes differing by at most 1."""
    check_chunk_count(chunks, d_ff)
    bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(d_ff), chunks)])
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def weight_chunk(weights: tuple, cols: slice, first: bool = True) -> tuple:
    """(w_gate[..., cols], w_up[..., cols], w_down[:, cols, :]) of gated-expert weights [G, D, F]
    x 2 and [G, F, D]; with biases (b_gate, b_up [G, F], b_down [G, D]) also (b_gate[:, cols],
    b_up[:, cols], b_down), b_down None unless this is the ``first`` chunk (it is added once to
    the chunks' sum)."""
    w_gate, w_up, w_down = weights[:3]
    chunk = (w_gate[..., cols], w_up[..., cols], w_down[:, cols, :])
    if len(weights) == 3:
        return chunk
    b_gate, b_up, b_down = weights[3:]
    return (*chunk, b_gate[:, cols], b_up[:, cols], b_down if first else None)


def experts_with_replicas(
    rows: jax.Array,
    masters: tuple[jax.Array, jax.Array, jax.Array],
    slot_expert_RS: jax.Array,
    group_sizes: jax.Array,
    *,
    kernel: str,
    chunks: int,
    max_fanout: int,
    domain_size: int | None = None,
    axis_name: str,
    backend: str,
    activation="silu",
    schedule: relay.RelaySchedule | None = None,
) -> jax.Array:
    """[C, D]: every received row through its local instance, the slot experts' weights fetched
    from their masters (`transfer.fetch_replica_experts`).

    Args:
      rows: [C, D], grouped by local instance from row 0 (E_m masters, then S slots).
      masters: (w_gate, w_up [E_m, D, F], w_down [E_m, F, D]), this rank's master experts,
        optionally followed by their biases (b_gate, b_up [E_m, F], b_down [E_m, D]), which the
        slots receive with the weights (and whose gradients return with theirs).
      slot_expert_RS: int32 [R, S], the plan's slots.
      group_sizes: int32 [E_m + S].
      kernel, activation: see `experts.registry.grouped_glu`.
      chunks: n >= 1 transfers of F / n columns each; 1: one transfer.
      max_fanout, domain_size, axis_name, backend, schedule: see
        `transfer.fetch_replica_experts` (one schedule serves every chunk).

    A plan with no replica (no slot filled on any rank) runs the masters alone: no transfer and
    no slot work, what plain expert parallelism runs. The plan is identical on every rank of the
    EP group, so every rank takes the same branch.
    """
    # The plan is agreed over the EP axis only: groups of other axes (data, FSDP) may take other
    # branches below. So the masters are typed to vary as the plan and the rows do before any
    # branch: an implicit cast inside one would transpose to a psum over those axes there, a
    # collective some groups never reach (a hang). Cast here, its psum runs outside, once.
    plan_axes = varying_axes(rows) | varying_axes(slot_expert_RS)
    masters = tuple(vary(w, plan_axes) for w in masters)
    run = functools.partial(
        grouped_glu, rows, group_sizes=group_sizes, kernel=kernel, activation=activation
    )

    def fetch(weights):
        # Named so that a profile tells the transfer (and, transposed, its gradient) apart.
        with jax.named_scope("replica_transfer"):
            fetched = transfer.fetch_replica_experts(
                tuple(w for w in weights if w is not None),  # a chunk's absent down bias
                slot_expert_RS,
                axis_name=axis_name,
                backend=backend,
                max_fanout=max_fanout,
                domain_size=domain_size,
                schedule=schedule,
            )
        got = iter(checkpoint_name(fetched, remat.REPLICAS))
        return tuple(None if w is None else next(got) for w in weights)

    active = transfer.active_slots(slot_expert_RS) > 0
    if chunks == 1 and fuses_stacks(kernel):
        return _fused(run, masters, fetch, active)
    return _masters_then_slots(run, rows, masters, fetch, active, chunks)


def _fused(run, masters, fetch, active) -> jax.Array:
    """[C, D]: masters and slots in one kernel call (one loop over both stacks costs less than
    two on a CPU); the slots' weights are fetched when the plan has a replica and are zeros
    otherwise (every slot group is then empty). Only the transfer sits in the `lax.cond`, so
    the kernel is compiled once."""
    fetched = jax.lax.cond(active, fetch, functools.partial(_no_fetch, fetch), masters)
    return run([masters, fetched])


def _no_fetch(fetch, masters) -> tuple:
    """Zeros of the shapes and types `fetch` returns for ``masters``."""
    shapes = jax.eval_shape(fetch, masters)
    return jax.tree.map(lambda s: vary(jnp.zeros(s.shape, s.dtype), varying_axes(s)), shapes)


def _masters_then_slots(run, rows, masters, fetch, active, chunks: int) -> jax.Array:
    """[C, D]: the masters' calls, plus the slots' (chunk by chunk, `_slots`) when the plan has a
    replica: each stack runs as its own calls, so that the masters' work need not wait for the
    weights. Each stack's rows get zeros from the other, so the two add exactly in the rows'
    dtype: the `lax.cond` returns [C, D] in that dtype, not in float32."""

    def no_slots():
        return vary(jnp.zeros(rows.shape, rows.dtype), varying_axes(rows))

    slots = functools.partial(_slots, run, masters, fetch, chunks)
    return run([masters, None]) + jax.lax.cond(active, slots, no_slots)


def _slots(run, masters, fetch, chunks: int) -> jax.Array:
    """[C, D] in the rows' dtype: the slot groups' rows, the weights fetched and run chunk by
    chunk of the hidden width (each chunk's output in the rows' dtype, the chunks added in
    float32 and the sum rounded to the rows' dtype)."""
    if chunks == 1:
        return run([None, fetch(masters)])
    out = None
    for c, cols in enumerate(hidden_chunks(masters[0].shape[-1], chunks)):
        part = run([None, fetch(weight_chunk(masters, cols, first=c == 0))])
        out = part.astype(jnp.float32) if out is None else out + part.astype(jnp.float32)
    return out.astype(part.dtype)
