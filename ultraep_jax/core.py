"""The per-device core of the balanced expert-parallel MoE, for use inside a `jax.shard_map`.

`routed_experts_local` is what one device runs: its own tokens, their routing and its shard of
the expert weights in, its tokens' output and the call's stats out. It runs the stages

  plan:     exact loads of this microbatch, all-gathered over the EP axis (`planning.loads`) ->
            the planner (`planning.planner`: the native FFI call or the portable one in JAX)
  dispatch: reroute counts and offsets (`dispatch.plan_dispatch`) -> token all-to-all (`comm`)
  experts:  replica weights fetched (`replicas`: relayed, in chunks) -> grouped gated MLP over
            masters and slots (`experts.registry`)
  combine:  results back (the reversed all-to-all) -> weighted sum per token (`dispatch`)

`over_mesh.routed_experts` wraps it in its own `shard_map`; a codebase that already runs
one calls it directly. The stage results carry `remat` names, so that a
``save_only_these_names`` policy keeps them for the backward pass.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ultraep_jax import comm, remat
from ultraep_jax._vma import vary
from ultraep_jax.checks import check_local_inputs
from ultraep_jax.config import BalancerConfig, ExpertParallel
from ultraep_jax.dispatch import combine, from_groups, plan_dispatch, to_groups
from ultraep_jax.experts.registry import local_experts
from ultraep_jax.planning.loads import gathered_loads, masters_only_plan, pair_experts
from ultraep_jax.planning.planner import plan as make_plan
from ultraep_jax.replicas import relay, streaming
from ultraep_jax.stats import MoEStats


def routed_experts_local(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    params: tuple[jax.Array, ...],
    ep: ExpertParallel,
    token_mask: jax.Array | None = None,
) -> tuple[jax.Array, MoEStats]:
    """One device's routed experts, balanced by the plan of this call's exact loads.

    Call it inside a `jax.shard_map` over ``ep.mesh`` (or a mesh of the same axis names and
    sizes) whose in_specs split the tokens over ``ep.token_axes`` and the expert weights by
    ``ep.weight_specs`` (over the EP axis; F over the ``tensor_axis`` if any, whose ranks get the
    same tokens). Every device of an EP group must call it at the same point.

    Args:
      x: [..., D], this device's tokens (any leading shape; T tokens in all).
      experts: int [..., K], each token's experts, in [0, E). Under `jit` an id outside the range
        cannot be checked: such a pair is skipped (nothing in y or the gradients, in no load) and
        counted in ``MoEStats.invalid``.
      weights: [..., K], each choice's weight.
      params: this device's expert weights: (w_gate [E_m, D, F_t], w_up [E_m, D, F_t], w_down
        [E_m, F_t, D]) with E_m = E / R (R = ``ep.ep_size``; all E without an EP axis) and F_t =
        F / ``ep.tensor_size`` hidden columns, optionally followed by the experts' biases
        (b_gate, b_up [E_m, F_t], b_down [E_m, D]; split as ``ep.bias_specs`` says): an expert
        then computes ``glu(x @ w_gate + b_gate, x @ w_up + b_up) @ w_down + b_down``, the down
        bias added once over the tensor ranks.
      ep: the configuration (`ExpertParallel`).
      token_mask: bool [...] (x's leading shape), True for a real token, or None (all real). A
        masked token is routed nowhere: it is in no load, plan or capacity, its output is 0 and
        it contributes 0 to every gradient; it is counted in ``MoEStats.masked``.

    Returns:
      y [..., D] in x's dtype: ``sum_j weights[..., j] * expert_{experts[..., j]}(x)`` (0 for a
      masked token), and the call's `MoEStats`, summed or maxed over the EP groups so that every
      device holds the same (typed invariant over the token axes).
    """
    check_local_inputs(x, experts, weights, params, ep, token_mask)
    for axis, size in ((ep.expert_axis, ep.ep_size), (ep.tensor_axis, ep.tensor_size)):
        if axis is not None and jax.lax.axis_size(axis) != size:
            raise ValueError(
                f"routed_experts_local: the shard_map's axis {axis!r} has "
                f"{jax.lax.axis_size(axis)} devices, the ExpertParallel's mesh {size}"
            )
    D, K = x.shape[-1], experts.shape[-1]
    T = math.prod(x.shape[:-1])
    mask_T = None if token_mask is None else token_mask.reshape(T)
    capacity = ep.capacity(T, K)
    with jax.named_scope("routed_experts"):
        y_TD, stats = _pipeline(
            x.reshape(T, D),
            experts.reshape(T, K),
            weights.reshape(T, K),
            mask_T,
            params,
            ep,
            capacity,
        )
    return y_TD.reshape(x.shape), stats


def _pipeline(x_TD, experts_TK, weights_TK, mask_T, params, ep: ExpertParallel, capacity: int):
    """plan -> dispatch -> experts -> combine -> stats on this device's [T, ...] tokens."""
    T, K = experts_TK.shape
    # Below the balancer's token threshold (static: T) the layer compiles plain EP, dropless
    # (`ExpertParallel.capacity`).
    balancer = ep.active_balancer if ep.balances(T) else None
    experts_N = pair_experts(experts_TK, ep.num_experts, mask_T)
    masked = jnp.int32(0) if mask_T is None else T - jnp.sum(mask_T, dtype=jnp.int32)
    x_TD, weights_TK = _split_over_tensor((x_TD, weights_TK), ep)
    params = _down_bias_once(params, ep)

    with jax.named_scope("plan"):
        loads_RE, masked_R, plan = _plan(experts_N, masked, ep, balancer, capacity)
        loads_RE, masked_R, plan = checkpoint_name((loads_RE, masked_R, plan), remat.PLAN)
    with jax.named_scope("dispatch"):
        dispatch = plan_dispatch(experts_N, loads_RE, plan, _ep_rank(ep), capacity)
        dispatch = checkpoint_name(dispatch, remat.DISPATCH)
        sent_CD = _exchange(x_TD[dispatch.send_order_N // K], dispatch.exchange, ep)
        rows_CD = checkpoint_name(to_groups(sent_CD, dispatch), remat.RECEIVED)
    # The relay schedule, once per call: the transfer follows it and the stats count its sends.
    with jax.named_scope("relay_schedule"):
        schedule = None if balancer is None else _relay_schedule(plan, params, balancer)
    with jax.named_scope("experts"):
        done_CD = _experts(rows_CD, params, plan, dispatch.group_sizes_G, ep, balancer, schedule)
    with jax.named_scope("combine"):
        back_ND = _exchange(from_groups(done_CD, dispatch), dispatch.exchange.reversed(), ep)
        back_ND = checkpoint_name(back_ND, remat.RETURNED)
        y_TD = combine(back_ND, dispatch, weights_TK)
        if mask_T is not None:
            y_TD = jnp.where(mask_T[:, None], y_TD, 0)
        y_TD = _summed_over_tensor(y_TD, ep)
    with jax.named_scope("stats"):
        send_max = 0.0 if schedule is None else _transfer_send_max(schedule, params)
        stats = _stats(ep, capacity, K, experts_N, loads_RE, masked_R, plan, dispatch, send_max)
    return y_TD.astype(x_TD.dtype), stats


def _experts(rows_CD, params, plan, group_sizes_G, ep: ExpertParallel, balancer, schedule):
    """[C, D]: the received rows through the masters and, with replicas (a relay ``schedule``;
    None without), the plan's slots."""
    how = ep.execution
    if schedule is None:
        return local_experts(
            rows_CD, params, None, group_sizes_G, how.expert_kernel, how.activation
        )
    return streaming.experts_with_replicas(
        rows_CD,
        params,
        plan.slot_expert,
        group_sizes_G,
        kernel=how.expert_kernel,
        chunks=how.transfer_chunks,
        max_fanout=balancer.max_fanout,
        domain_size=balancer.domain_size,
        axis_name=ep.expert_axis,
        backend=how.comm_backend,
        activation=how.activation,
        schedule=schedule,
    )


def _split_over_tensor(arrays: tuple, ep: ExpertParallel) -> tuple:
    """``arrays`` (x [T, D], weights [T, K]: the same on every tensor rank) typed varying over
    the tensor axis (as they are without one): each tensor rank computes its F slice from them,
    and the transpose sums their gradients' partial slices over the tensor axis."""
    if ep.tensor_axis is None:
        return arrays
    return tuple(vary(a, (ep.tensor_axis,)) for a in arrays)


def _down_bias_once(params: tuple, ep: ExpertParallel) -> tuple:
    """``params`` with the down bias (if any) zero on every tensor rank but the first: each
    tensor rank's expert outputs are partial sums over its F slice, summed over the tensor axis
    after the combine (`_summed_over_tensor`), so the bias enters that sum once. Its gradient is
    the first rank's; the others' zeros add nothing to it."""
    if ep.tensor_axis is None or len(params) == 3:
        return params
    b_down = params[5]
    first = jax.lax.axis_index(ep.tensor_axis) == 0
    return (*params[:5], jnp.where(first, b_down, jnp.zeros_like(b_down)))


def _summed_over_tensor(y_TD, ep: ExpertParallel) -> jax.Array:
    """[T, D]: the tensor ranks' partial outputs (each its F slice) summed over the tensor axis
    (as it is without one). After the combine, which is linear, the sum moves T rows instead of
    the C >= K * T received rows a sum before the return exchange would."""
    return y_TD if ep.tensor_axis is None else jax.lax.psum(y_TD, ep.tensor_axis)


def _ep_rank(ep: ExpertParallel) -> jax.Array:
    """int32 []: this device's index on the EP axis (0 without one)."""
    return jax.lax.axis_index(ep.expert_axis) if ep.has_ep_axis else jnp.int32(0)


def _exchange(operand, exchange, ep: ExpertParallel) -> jax.Array:
    """The token exchange over the EP axis; with one EP rank a local copy (nothing crosses the
    network; XLA's ragged all-to-all over one device is slow on GPU)."""
    if ep.ep_size == 1:
        return comm.local_exchange(operand, exchange)
    backend = ep.execution.comm_backend
    with jax.named_scope("exchange"):  # a profile's "exchange" term (`experiments.lab.step_terms`)
        return comm.exchange_by_backend(
            operand, exchange, axis_name=ep.expert_axis, backend=backend
        )


def _plan(experts_N, masked, ep: ExpertParallel, balancer: BalancerConfig | None, capacity: int):
    """(loads [R, E], masked tokens [R], plan) of this EP group: the exact loads and masked
    counts all-gathered over the EP axis, and their plan (every expert on its master without a
    balancer), typed varying as the loads are (by the planner: identical across the EP group,
    different between EP groups)."""
    axis = ep.expert_axis if ep.has_ep_axis else None
    loads_RE, masked_R = gathered_loads(experts_N, masked, ep.num_experts, axis)
    if balancer is None:
        plan = masters_only_plan(loads_RE)
    else:
        plan = make_plan(loads_RE, balancer, capacity=capacity, planner=ep.execution.planner)
    return loads_RE, masked_R, plan


def _relay_schedule(plan, masters, balancer: BalancerConfig) -> relay.RelaySchedule:
    """The relay schedule of ``plan``'s slots under the balancer's fan-out bound and domains."""
    em = masters[0].shape[0]
    return relay.relay_schedule(plan.slot_expert, em, balancer.max_fanout, balancer.domain_size)


def _transfer_send_max(schedule: relay.RelaySchedule, masters) -> jax.Array:
    """float32 []: the most bytes one EP rank sends in the replica transfer under ``schedule``."""
    copy_bytes = sum(w[0].size * w.dtype.itemsize for w in masters)
    return relay.largest_send_bytes(schedule, copy_bytes)


def _stats(ep, capacity, K, experts_N, loads_RE, masked_R, plan, dispatch, send_max) -> MoEStats:
    """The call's `MoEStats`, typed invariant over the token axes."""
    # Pairs of unmasked tokens with ids outside [0, E) are in no load (`planning.loads`) and sent
    # nowhere (`dispatch`); masked tokens' pairs are neither, and counted apart.

    masked = jnp.sum(masked_R)
    invalid = loads_RE.shape[0] * experts_N.shape[0] - jnp.sum(loads_RE) - K * masked
    stats = MoEStats.of_group(
        loads_RE,
        plan,
        dispatch.dropped,
        invalid,
        masked,
        capacity,
        dispatch.group_sizes_RG,
        jnp.float32(send_max),
    )
    # Invariant over the EP axis (a function of the gathered loads and the plan); summed or
    # maxed over the EP groups, then invariant over every token axis.
    return jax.tree.map(lambda a: vary(a, ep.data_axes), stats).over_groups(ep.data_axes)
