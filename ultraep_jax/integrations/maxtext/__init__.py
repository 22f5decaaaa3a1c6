"""ultraep_jax as MaxText's MoE backend (extra ``maxtext``; docs/maxtext.md).

`enable` makes every MaxText routed MoE block (`maxtext.layers.moe.RoutedMoE`, the routed part of
`RoutedAndSharedMoE` included) built or called in this process run balanced: MaxText's router,
aux loss and loss-free bias as MaxText computes them; the experts through
`ultraep_jax.routed_experts_local` inside one `jax.shard_map` over MaxText's mesh. Parameters,
optimizer state and checkpoints stay MaxText's: replicas live only inside the step. A setting
ultraep_jax does not cover (`block.refusal`) raises one line when the block is called, never a
silent fallback. `python -m ultraep_jax.integrations.maxtext` is MaxText's own trainer with it on.

    from ultraep_jax.integrations import maxtext as uep_maxtext
    uep_maxtext.enable(balancer=uep.BalancerConfig(slots_per_rank=2))
"""

from __future__ import annotations

import contextlib

from ultraep_jax.config import BalancerConfig, Execution
from ultraep_jax.integrations.maxtext.settings import Balancing

_UNSET = object()
#: The methods of `RoutedMoE` that `enable` replaces, as MaxText defines them (on first use).
_ORIGINAL: dict = {}
_active: Balancing | None = None


def _routed_moe():
    """MaxText's `RoutedMoE`, imported on first use (so that `requirements` runs before MaxText's
    own dependencies are installed); one line when MaxText cannot be imported."""
    try:
        from maxtext.layers import moe  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(
            "ultraep_jax.integrations.maxtext needs MaxText and its requirements, installed as "
            f"docs/maxtext.md says; importing it failed: {e}"
        ) from e
    if not _ORIGINAL:
        _ORIGINAL.update(__call__=moe.RoutedMoE.__call__, sparse_matmul=moe.RoutedMoE.sparse_matmul)
    return moe.RoutedMoE


def enable(
    balancer: BalancerConfig | None = _UNSET,
    capacity_factor: float | None = None,
    **execution,
) -> Balancing:
    """Runs MaxText's routed MoE blocks balanced in this process, until `disable`.

    Args:
      balancer: the `BalancerConfig` (default: ``BalancerConfig()``), or None for plain expert
        parallelism through ultraep_jax.
      capacity_factor: receive-buffer rows per EP rank as a multiple of the pairs it routes
        (pairs beyond it dropped and counted); None (default): nothing dropped, as MaxText's
        sparse_matmul.
      **execution: `Execution` fields (planner, expert_kernel, comm_backend, transfer_chunks).

    Returns:
      The `Balancing` now in force. Calling `enable` again replaces it; blocks compiled before
      keep what they were traced with.
    """
    balancing = Balancing(
        balancer=BalancerConfig() if balancer is _UNSET else balancer,
        capacity_factor=capacity_factor,
        execution=Execution(**execution),
    )
    return enable_balancing(balancing)


def enable_balancing(balancing: Balancing) -> Balancing:
    """`enable` from a `Balancing`."""
    global _active
    if not isinstance(balancing, Balancing):
        raise TypeError(f"maxtext: want a Balancing, got {type(balancing).__name__}")
    routed_moe = _routed_moe()
    _active = balancing
    routed_moe.__call__ = _checked_call
    routed_moe.sparse_matmul = _sparse_matmul
    return balancing


def disable() -> None:
    """MaxText's own blocks again (a no-op when not enabled)."""
    global _active
    _active = None
    if _ORIGINAL:
        routed_moe = _routed_moe()
        for name, method in _ORIGINAL.items():
            setattr(routed_moe, name, method)


def active() -> Balancing | None:
    """The `Balancing` in force, or None when MaxText's own blocks run."""
    return _active


@contextlib.contextmanager
def enabled(balancing: Balancing | None = None, **kwargs):
    """`enable` for the ``with`` block (a `Balancing`, or `enable`'s arguments), then what was
    in force before."""
    before = _active
    if balancing is not None and kwargs:
        raise TypeError("maxtext.enabled: pass a Balancing or enable's arguments, not both")
    if balancing is not None:
        enable_balancing(balancing)
    else:
        enable(**kwargs)
    try:
        yield _active
    finally:
        if before is None:
            disable()
        else:
            enable_balancing(before)


def _checked_call(self, *args, **kwargs):
    from ultraep_jax.integrations.maxtext import block  # noqa: PLC0415 (imports MaxText)

    block.check_supported(self, kwargs.get("forced_routed_experts"))
    return _ORIGINAL["__call__"](self, *args, **kwargs)


def _sparse_matmul(self, *args, **kwargs):
    from ultraep_jax.integrations.maxtext import block  # noqa: PLC0415

    return block.balanced_sparse_matmul(self, _active, *args, **kwargs)


__all__ = ["Balancing", "active", "disable", "enable", "enable_balancing", "enabled"]
