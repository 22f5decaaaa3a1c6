"""The balanced blocks' stats in MaxText's own step metrics, beside its loss.

Each balanced block sows its call's stats (`block.SOWN`) into MaxText's intermediates. MaxText's
`train_step` hands its intermediates to `record_activation_metrics` only when
``record_internal_nn_metrics`` is on; `install` has `train_step` read that one key as on (the
model's layers keep reading the real config, so they sow nothing more) and puts the stats into
``metrics["scalar"]``: per MoE layer ``ultraep/layer_NNN/<stat>``, and over the layers
``ultraep/imbalance_before`` and ``ultraep/imbalance_after`` (the worst layer's),
``ultraep/dropped`` and ``ultraep/replicas`` (summed). The training log gets one line per step
after MaxText's own.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from maxtext.common import metric_logger
from maxtext.trainers.pre_train import train
from maxtext.utils import max_logging, maxtext_utils

from ultraep_jax.integrations.maxtext.block import SOWN

_ORIGINAL = {
    "train_step": train.train_step,
    "record_activation_metrics": train.record_activation_metrics,
    "log": metric_logger.MetricLogger._log_training_metrics,
}
#: How the per-layer stats combine over the layers.
_OVER_LAYERS = {
    "imbalance_before": jnp.max,
    "imbalance_after": jnp.max,
    "dropped": jnp.sum,
    "replicas": jnp.sum,
}


class _StatsRecorded:
    """MaxText's config as `train_step` reads it, with ``record_internal_nn_metrics`` on."""

    def __init__(self, config):
        object.__setattr__(self, "wrapped", config)

    def __getattr__(self, name):
        if name == "record_internal_nn_metrics":
            return True
        return getattr(self.wrapped, name)


def install() -> None:
    """Puts the stats into MaxText's train-step metrics and training log (this process)."""
    train.train_step = _train_step
    train.record_activation_metrics = _record
    metric_logger.MetricLogger._log_training_metrics = _log


def uninstall() -> None:
    """MaxText's own train step, metrics and log again."""
    train.train_step = _ORIGINAL["train_step"]
    train.record_activation_metrics = _ORIGINAL["record_activation_metrics"]
    metric_logger.MetricLogger._log_training_metrics = _ORIGINAL["log"]


def layer_stats(intermediates) -> dict[str, jnp.ndarray]:
    """{stat: [layers]} of the balanced blocks in ``intermediates`` (MaxText's), in the order
    MaxText collects them (scanned layers stacked); {} when none ran."""
    stats = {}
    for name in SOWN:
        values = maxtext_utils.collect_intermediates_by_suffix(intermediates, name)
        if values:
            stats[name.removeprefix("ultraep_")] = jnp.concatenate(values)
    return stats


def scalars(intermediates) -> dict[str, jnp.ndarray]:
    """The ``ultraep/...`` scalars of ``intermediates``: per layer and over the layers."""
    out = {}
    for stat, per_layer in layer_stats(intermediates).items():
        out[f"ultraep/{stat}"] = _OVER_LAYERS[stat](per_layer)
        for i in range(per_layer.shape[0]):
            out[f"ultraep/layer_{i:03d}/{stat}"] = per_layer[i]
    return out


@functools.wraps(_ORIGINAL["train_step"])
def _train_step(model, config, *args, **kwargs):
    return _ORIGINAL["train_step"](model, _StatsRecorded(config), *args, **kwargs)


def _record(metrics, intermediates, config):
    metrics["scalar"].update(scalars(intermediates))
    real = config.wrapped if isinstance(config, _StatsRecorded) else config
    if getattr(real, "record_internal_nn_metrics", False):
        _ORIGINAL["record_activation_metrics"](metrics, intermediates, real)


def _log(self, metrics, step):
    _ORIGINAL["log"](self, metrics, step)
    s = metrics["scalar"]
    if "ultraep/imbalance_after" not in s:
        return
    layers = sorted({k.split("/")[1] for k in s if k.startswith("ultraep/layer_")})
    per_layer = ", ".join(
        f"{float(s[f'ultraep/{n}/imbalance_before']):.3f}->"
        f"{float(s[f'ultraep/{n}/imbalance_after']):.3f}"
        for n in layers
    )
    max_logging.log(
        f"ultraep step {step}: imbalance {float(s['ultraep/imbalance_before']):.3f} -> "
        f"{float(s['ultraep/imbalance_after']):.3f} (worst layer), dropped "
        f"{int(s['ultraep/dropped'])}, replicas {int(s['ultraep/replicas'])}; per layer "
        f"{per_layer}"
    )
