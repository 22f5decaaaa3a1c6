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

try:
    from maxtext.layers import moe as _moe
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ultraep_jax.integrations.maxtext needs MaxText: install it as docs/maxtext.md says "
        f'(pip install ".[maxtext]" and MaxText\'s CPU requirements); {e}'
    ) from e

from ultraep_jax.integrations.maxtext import block  # noqa: E402 (after MaxText's check)

_UNSET = object()
#: The methods of `RoutedMoE` that `enable` replaces, as MaxText defines them.
_ORIGINAL = {"__call__": _moe.RoutedMoE.__call__, "sparse_matmul": _moe.RoutedMoE.sparse_matmul}
_active: Balancing | None = None


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
    _active = balancing
    _moe.RoutedMoE.__call__ = _checked_call
    _moe.RoutedMoE.sparse_matmul = _sparse_matmul
    return balancing


def disable() -> None:
    """MaxText's own blocks again (a no-op when not enabled)."""
    global _active
    _active = None
    for name, method in _ORIGINAL.items():
        setattr(_moe.RoutedMoE, name, method)


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
    block.check_supported(self, kwargs.get("forced_routed_experts"))
    return _ORIGINAL["__call__"](self, *args, **kwargs)


def _sparse_matmul(self, *args, **kwargs):
    return block.balanced_sparse_matmul(self, _active, *args, **kwargs)


__all__ = ["Balancing", "active", "disable", "enable", "enable_balancing", "enabled"]
