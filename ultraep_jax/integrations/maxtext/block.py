"""MaxText's routed MoE block, balanced: what runs in place of `RoutedMoE.sparse_matmul`.

MaxText's router runs as MaxText computes it (`RoutedMoE.get_topk`: softmax top-k, DeepSeek's
sigmoid groups and scaling, ``norm_topk_prob``, per-expert scales), its aux loss as its
sparse path computes it, and the loss-free bias update from the exact global expert loads
(`MoEStats.expert_load`). The experts run in one `jax.shard_map` over MaxText's mesh around
`ultraep_jax.routed_experts_local`: tokens split as MaxText splits them (its
``activation_batch`` and ``activation_norm_length`` axes), experts over the ``expert`` axis,
their hidden width over ``tensor`` when that axis has more than one device.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from maxtext.layers import moe

from ultraep_jax.config import ExpertParallel
from ultraep_jax.core import routed_experts_local
from ultraep_jax.integrations.maxtext import coverage
from ultraep_jax.integrations.maxtext.coverage import activation
from ultraep_jax.integrations.maxtext.settings import Balancing
from ultraep_jax.stats import MoEStats

#: The stats each balanced block sows into MaxText's intermediates, by the name it sows them
#: under (the metrics hook reads them by these names).
SOWN = {
    "ultraep_imbalance_before": lambda s: s.imbalance_before,
    "ultraep_imbalance_after": lambda s: s.imbalance_after,
    "ultraep_dropped": lambda s: s.dropped,
    "ultraep_replicas": lambda s: s.replicas,
}

#: MaxText's EP mesh axis, the one the integration balances over.
EXPERT_AXIS = "expert"
#: MaxText's tensor-parallel axis, over which ultraep_jax splits each expert's hidden width.
TENSOR_AXIS = "tensor"


def refusal(module, forced_routed_experts=None) -> str | None:
    """Why ``module`` (a MaxText `RoutedMoE`) cannot run balanced, in one line naming the
    setting; None when it can. Its config's refusals (`coverage.config_refusal`), then what only
    the module knows."""
    reason = coverage.config_refusal(module.config)
    if reason is not None:
        return reason
    reasons = (
        (module.quant is not None, "quantized expert weights (the block's quant) are not covered"),
        (module.is_hash_routing, "hash routing (DeepSeek V4's first layers) is not covered"),
        (forced_routed_experts is not None, "forced_routed_experts is not covered"),
        (
            module._expert_parallelism_name != EXPERT_AXIS,
            f"the EP axis {module._expert_parallelism_name!r} (only {EXPERT_AXIS!r} is covered)",
        ),
    )
    for refused, reason in reasons:
        if refused:
            return reason
    return None


def check_supported(module, forced_routed_experts=None) -> None:
    """Raises one line (`refusal`) unless ``module`` can run balanced."""
    reason = refusal(module, forced_routed_experts)
    if reason is not None:
        raise coverage.NotCovered(coverage.refused_message(reason))


def token_axes(module) -> tuple[tuple, tuple]:
    """MaxText's mesh axes of the block's batch and length dims (``activation_batch``,
    ``activation_norm_length``), each a tuple of axis names."""
    spec = module._logical_to_mesh_axes(("activation_batch", "activation_norm_length", None))

    def axes(entry):
        if entry is None:
            return ()
        return (entry,) if isinstance(entry, str) else tuple(entry)

    return axes(spec[0]), axes(spec[1])


@functools.lru_cache(maxsize=64)
def expert_parallel(mesh, num_experts: int, axes: tuple, activation_, balancing: Balancing):
    """The `ExpertParallel` of a MaxText block: its mesh, E, the token axes, ``tensor`` as the
    tensor axis when it has more than one device."""
    tensor = TENSOR_AXIS if mesh.shape.get(TENSOR_AXIS, 1) > 1 else None
    return ExpertParallel(
        mesh,
        num_experts,
        balancing.balancer,
        capacity_factor=balancing.capacity_factor,
        expert_axis=EXPERT_AXIS,
        token_axes=axes,
        tensor_axis=tensor,
        execution=balancing.execution,
        activation=activation_,
    )


def balanced_sparse_matmul(
    module,
    balancing: Balancing,
    inputs,
    gate_logits,
    pre_bias_logits,
    w0_kernel,
    w1_kernel,
    wo_kernel,
    w0_bias,
    w1_bias,
    wo_bias,
    input_ids=None,
    forced_routed_experts=None,
):
    """`RoutedMoE.sparse_matmul`'s contract, balanced: ``inputs`` [B, L, D], the gate's logits
    [B, L, E] (and DeepSeek's pre-bias logits), the kernels w0, w1 [E, D, F], wo [E, F, D] and
    biases (or None) in; (y [B, L, D], the aux loss or None, the routed-bias update [E] or
    None) out. Sows the call's stats (`SOWN`) into the module's intermediates."""
    del input_ids  # hash routing only, refused
    check_supported(module, forced_routed_experts)
    cfg = module.config
    weights, experts = module.get_topk(gate_logits, pre_bias_logits, module.rngs)
    batch_axes, length_axes = token_axes(module)
    _check_token_split(module.mesh, inputs.shape, batch_axes, length_axes)
    axes = batch_axes + length_axes
    if EXPERT_AXIS not in axes:
        raise ValueError(
            "ultraep_jax.integrations.maxtext: MaxText does not split this block's batch over "
            f"the {EXPERT_AXIS!r} axis (its batch axes: {batch_axes}); not covered"
        )
    ep = expert_parallel(module.mesh, module.num_experts, axes, activation(cfg), balancing)
    biases = () if w0_bias is None else (w0_bias, w1_bias, wo_bias)
    y, stats = _routed_experts(ep, batch_axes, length_axes)(
        inputs, experts, weights.astype(jnp.float32), (w0_kernel, w1_kernel, wo_kernel) + biases
    )
    _sow(module, stats)
    return (
        y.astype(inputs.dtype),
        _aux_loss(module, experts, gate_logits, pre_bias_logits),
        (_bias_updates(module, stats)),
    )


def _sow(module, stats: MoEStats) -> None:
    """The call's stats into the module's intermediates, as MaxText's own block sows its
    (Flax's sow outside `nnx.capture`, which MaxText's trainer reads back, and which Flax 0.12
    warns is deprecated: the warning is MaxText's design, not ours to act on)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Using 'Module.sow", DeprecationWarning)
        for name, value in SOWN.items():
            module.sow(nnx.Intermediate, name, value(stats))


def _routed_experts(ep: ExpertParallel, batch_axes: tuple, length_axes: tuple):
    """The shard_map of `routed_experts_local` over MaxText's token layout: (x [B, L, D],
    experts [B, L, K], weights [B, L, K], params) -> (y [B, L, D], `MoEStats`)."""
    token = P(batch_axes or None, length_axes or None, None)

    def run(x, experts, weights, params):
        specs = ep.weight_specs + (ep.bias_specs if len(params) > 3 else ())
        return jax.shard_map(
            lambda x, e, w, *p: routed_experts_local(x, e, w, p, ep),
            mesh=ep.mesh,
            in_specs=(token, token, token, *specs),
            out_specs=(token, P()),
        )(x, experts, weights, *params)

    return run


def _check_token_split(mesh, shape, batch_axes: tuple, length_axes: tuple) -> None:
    """Raises one line unless the batch and length dims divide over their mesh axes."""
    for dim, axes, what in ((shape[0], batch_axes, "batch"), (shape[1], length_axes, "length")):
        devices = math.prod(mesh.shape[a] for a in axes)
        if dim % devices:
            raise ValueError(
                f"ultraep_jax.integrations.maxtext: the block's {what} {dim} does not divide "
                f"over the mesh axes {axes} ({devices} devices); not covered"
            )


def _aux_loss(module, experts, gate_logits, pre_bias_logits):
    """MaxText's load-balancing loss as its sparse path computes it (None when off)."""
    cfg = module.config
    if cfg.load_balance_loss_weight <= 0.0 or module.is_hash_routing:
        return None
    scores = pre_bias_logits if pre_bias_logits is not None else gate_logits
    if moe.uses_megatron_seq_aux_loss(cfg):
        return module.megatron_seq_aux_loss(scores)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(module.dtype)
    return module.load_balance_loss(experts, probs)


def _bias_updates(module, stats: MoEStats):
    """The loss-free routed-bias update from the exact global expert loads (None when off);
    the raw loads under gradient accumulation, which MaxText sums before its sign."""
    if not module.should_update_load_balance():
        return None
    cfg = module.config
    if getattr(cfg, "gradient_accumulation_steps", 1) > 1:
        return stats.expert_load
    return moe.load_balance_updates_from_counts(
        stats.expert_load, cfg.num_experts, cfg.routed_bias_update_rate
    )
