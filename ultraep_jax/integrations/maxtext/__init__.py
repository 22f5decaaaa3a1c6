"""ultraep_jax as MaxText's MoE backend (extra ``maxtext``; docs/maxtext.md).

`enable` makes every MaxText routed MoE block (`maxtext.layers.moe.RoutedMoE`, the routed part of
`RoutedAndSharedMoE` included) built or called in this process run balanced: MaxText's router,
aux loss and loss-free bias as MaxText computes them; the experts through
`ultraep_jax.routed_experts_local` inside one `jax.shard_map` over MaxText's mesh. Parameters,
optimizer state and checkpoints stay MaxText's: replicas live only inside the step. A setting
ultraep_jax does not cover (`coverage`, `block.refusal`) raises one line when the block is built
(the command: as soon as MaxText's config is read) and when it is called, never a silent
fallback; so does a MaxText release other than the tested one (`coverage.TESTED_MAXTEXT`) unless
``allow_untested_maxtext=True``. `python -m ultraep_jax.integrations.maxtext` is MaxText's own
trainer with it on.

    from ultraep_jax.integrations import maxtext as uep_maxtext
    uep_maxtext.enable(balancer=uep.BalancerConfig(slots_per_rank=2))
"""

from __future__ import annotations

import contextlib
import functools

from ultraep_jax.config import BalancerConfig, Execution
from ultraep_jax.integrations.maxtext.coverage import check_version
from ultraep_jax.integrations.maxtext.remat import with_saved
from ultraep_jax.integrations.maxtext.settings import Balancing

_UNSET = object()
#: The methods `enable` replaces, by name: (their MaxText class, MaxText's own method); filled
#: on first use.
_ORIGINAL: dict = {}
_active: Balancing | None = None


def _patched_classes():
    """MaxText's `RoutedMoE` and `NNXDecoder`, imported on first use (so that `requirements` runs
    before MaxText's own dependencies are installed); one line when MaxText cannot be
    imported."""
    try:
        from maxtext.layers import moe, nnx_decoders  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(
            "ultraep_jax.integrations.maxtext needs MaxText and its requirements, installed as "
            f"docs/maxtext.md says; importing it failed: {e}"
        ) from e
    if not _ORIGINAL:
        for cls, name in (
            (moe.RoutedMoE, "__init__"),
            (moe.RoutedMoE, "__call__"),
            (moe.RoutedMoE, "sparse_matmul"),
            (nnx_decoders.NNXDecoder, "get_remat_policy"),
        ):
            _ORIGINAL[name] = (cls, getattr(cls, name))
        functools.update_wrapper(_checked_init, _ORIGINAL["__init__"][1])
        functools.update_wrapper(_checked_call, _ORIGINAL["__call__"][1])
    return moe.RoutedMoE, nnx_decoders.NNXDecoder


def enable(
    balancer: BalancerConfig | None = _UNSET,
    capacity_factor: float | None = None,
    remat_saved: tuple[str, ...] = (),
    allow_untested_maxtext: bool = False,
    **execution,
) -> Balancing:
    """Runs MaxText's routed MoE blocks balanced in this process, until `disable`.

    Args:
      balancer: the `BalancerConfig` (default: ``BalancerConfig()``), or None for plain expert
        parallelism through ultraep_jax.
      capacity_factor: receive-buffer rows per EP rank as a multiple of the pairs it routes
        (pairs beyond it dropped and counted); None (default): nothing dropped, as MaxText's
        sparse_matmul.
      remat_saved: the balanced block's stages that MaxText's remat policy saves besides its own,
        as `uep.remat.NAMES` (``"ultraep_plan"``) or as the command spells them (``"plan"``)
        (default (): recomputed in the backward pass, the planner included).
      allow_untested_maxtext: run on a MaxText release other than the tested one
        (`coverage.TESTED_MAXTEXT`), which is otherwise refused.
      **execution: `Execution` fields (planner, expert_kernel, comm_backend, transfer_chunks).

    Returns:
      The `Balancing` now in force. Calling `enable` again replaces it; blocks compiled before
      keep what they were traced with.
    """
    balancing = Balancing(
        balancer=BalancerConfig() if balancer is _UNSET else balancer,
        capacity_factor=capacity_factor,
        execution=Execution(**execution),
        remat_saved=remat_saved,
    )
    return enable_balancing(balancing, allow_untested_maxtext=allow_untested_maxtext)


def enable_balancing(balancing: Balancing, *, allow_untested_maxtext: bool = False) -> Balancing:
    """`enable` from a `Balancing`."""
    global _active
    if not isinstance(balancing, Balancing):
        raise TypeError(f"maxtext: want a Balancing, got {type(balancing).__name__}")
    routed_moe, decoder = _patched_classes()
    check_version(allow_untested_maxtext)
    _active = balancing
    routed_moe.__init__ = _checked_init
    routed_moe.__call__ = _checked_call
    routed_moe.sparse_matmul = _sparse_matmul
    decoder.get_remat_policy = _remat_policy
    return balancing


def disable() -> None:
    """MaxText's own blocks again (a no-op when not enabled)."""
    global _active
    _active = None
    for name, (cls, method) in _ORIGINAL.items():
        setattr(cls, name, method)


def active() -> Balancing | None:
    """The `Balancing` in force, or None when MaxText's own blocks run."""
    return _active


@contextlib.contextmanager
def enabled(balancing: Balancing | None = None, *, allow_untested_maxtext: bool = False, **kwargs):
    """`enable` for the ``with`` block (a `Balancing`, or `enable`'s arguments), then what was
    in force before."""
    before = _active
    if balancing is not None and kwargs:
        raise TypeError("maxtext.enabled: pass a Balancing or enable's arguments, not both")
    if balancing is not None:
        enable_balancing(balancing, allow_untested_maxtext=allow_untested_maxtext)
    else:
        enable(allow_untested_maxtext=allow_untested_maxtext, **kwargs)
    try:
        yield _active
    finally:
        if before is None:
            disable()
        else:
            enable_balancing(before, allow_untested_maxtext=True)  # checked when it was enabled


def _checked_init(self, *args, **kwargs):
    from ultraep_jax.integrations.maxtext import block  # noqa: PLC0415 (imports MaxText)

    _ORIGINAL["__init__"][1](self, *args, **kwargs)
    block.check_supported(self)


def _checked_call(self, *args, **kwargs):
    from ultraep_jax.integrations.maxtext import block  # noqa: PLC0415 (imports MaxText)

    block.check_supported(self, kwargs.get("forced_routed_experts"))
    return _ORIGINAL["__call__"][1](self, *args, **kwargs)


def _sparse_matmul(self, *args, **kwargs):
    from ultraep_jax.integrations.maxtext import block  # noqa: PLC0415

    return block.balanced_sparse_matmul(self, _active, *args, **kwargs)


def _remat_policy(self):
    return with_saved(_ORIGINAL["get_remat_policy"][1](self), _active.remat_saved)


__all__ = ["Balancing", "active", "disable", "enable", "enable_balancing", "enabled"]
