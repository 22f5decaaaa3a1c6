"""The balanced blocks' stats in MaxText's own step metrics, beside its loss.

Each balanced block sows its call's stats (`block.SOWN`) into MaxText's intermediates. MaxText's
pre-training `train_step` hands its intermediates to `record_activation_metrics` only when its
config has ``record_internal_nn_metrics`` on; `install` hands `train_step` a copy of MaxText's
config with that key on (a `HyperParameters` of its own, no proxy; the model's layers keep the
config they were built with, so they sow nothing more) and puts the stats into
``metrics["scalar"]``: per MoE layer ``ultraep/layer_NNN/<stat>``, and over the layers
``ultraep/imbalance_before`` and ``ultraep/imbalance_after`` (the worst layer's),
``ultraep/dropped`` and ``ultraep/replicas`` (summed). Under gradient accumulation MaxText sums
the intermediates over the microbatches: the imbalance ratios are reported as their means over
the microbatches, the counts as their sums. The training log gets one line per step after
MaxText's own.

Only MaxText's pre-training trainer (`maxtext.trainers.pre_train.train`, which the command
runs) records them; another trainer's training log, with balanced blocks on, is refused in one
line.
"""

from __future__ import annotations

import weakref

import jax.numpy as jnp
from maxtext.utils import max_logging, maxtext_utils

from ultraep_jax.integrations.maxtext.block import SOWN

#: MaxText's functions that `install` replaces, by name; filled by the first `install`.
_ORIGINAL: dict = {}
#: How the per-layer stats combine over the layers.
_OVER_LAYERS = {
    "imbalance_before": jnp.max,
    "imbalance_after": jnp.max,
    "dropped": jnp.sum,
    "replicas": jnp.sum,
}
#: The stats that are ratios (a mean over gradient-accumulation microbatches); the others are
#: counts (a sum).
RATIOS = ("imbalance_before", "imbalance_after")
#: The recording copy of each MaxText config `train_step` was called with (`recording_config`).
_RECORDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COPIES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def install() -> None:
    """Puts the stats into MaxText's train-step metrics and training log (this process)."""
    from maxtext.common import metric_logger  # noqa: PLC0415 (MaxText's trainer, imported on use)
    from maxtext.trainers.pre_train import train  # noqa: PLC0415

    if not _ORIGINAL:
        _ORIGINAL.update(
            train_step=train.train_step,
            record_activation_metrics=train.record_activation_metrics,
            log=metric_logger.MetricLogger._log_training_metrics,
        )
    train.train_step = _train_step
    train.record_activation_metrics = _record
    metric_logger.MetricLogger._log_training_metrics = _log


def uninstall() -> None:
    """MaxText's own train step, metrics and log again (a no-op before `install`)."""
    if not _ORIGINAL:
        return
    from maxtext.common import metric_logger  # noqa: PLC0415
    from maxtext.trainers.pre_train import train  # noqa: PLC0415

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


def scalars(intermediates, accumulation_steps: int = 1) -> dict[str, jnp.ndarray]:
    """The ``ultraep/...`` scalars of ``intermediates``: per layer and over the layers.

    ``intermediates`` summed over ``accumulation_steps`` microbatches (MaxText's gradient
    accumulation): the ratios (`RATIOS`) as their means over the microbatches, the counts as
    their sums.
    """
    out = {}
    for stat, per_layer in layer_stats(intermediates).items():
        if stat in RATIOS:
            per_layer = per_layer / accumulation_steps
        out[f"ultraep/{stat}"] = _OVER_LAYERS[stat](per_layer)
        for i in range(per_layer.shape[0]):
            out[f"ultraep/layer_{i:03d}/{stat}"] = per_layer[i]
    return out


def recording_config(config):
    """``config`` (MaxText's `HyperParameters`) with ``record_internal_nn_metrics`` on: itself
    when it is on, else a copy with that one key on (one per config, a `HyperParameters` like
    it, not a proxy)."""
    if getattr(config, "record_internal_nn_metrics", False):
        return config
    if config not in _RECORDING:
        copy = object.__new__(type(config))
        pydantic_config = config._pydantic_config.model_copy(
            update={"record_internal_nn_metrics": 1}
        )
        object.__setattr__(copy, "_pydantic_config", pydantic_config)
        flat = {**config.get_keys(), "record_internal_nn_metrics": 1}
        object.__setattr__(copy, "_flat_config", flat)
        _RECORDING[config] = copy
        _COPIES[id(copy)] = copy
    return _RECORDING[config]


def _train_step(model, config, *args, **kwargs):
    return _ORIGINAL["train_step"](model, recording_config(config), *args, **kwargs)


def _record(metrics, intermediates, config):
    steps = getattr(config, "gradient_accumulation_steps", 1)
    metrics["scalar"].update(scalars(intermediates, steps))
    ours = _COPIES.get(id(config)) is config
    if not ours and getattr(config, "record_internal_nn_metrics", False):
        _ORIGINAL["record_activation_metrics"](metrics, intermediates, config)


def _log(self, metrics, step):
    s = metrics["scalar"]
    if "ultraep/imbalance_after" not in s:
        _check_recorded(self.config)
        _ORIGINAL["log"](self, metrics, step)
        return
    _ORIGINAL["log"](self, metrics, step)
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


def _check_recorded(config) -> None:
    """Raises one line when balanced blocks run in this process but the step whose training
    metrics are logged did not record their stats (a trainer other than MaxText's
    pre-training one)."""
    from ultraep_jax.integrations import maxtext  # noqa: PLC0415

    if maxtext.active() is not None and getattr(config, "num_experts", 1) > 1:
        raise RuntimeError(
            "ultraep_jax.integrations.maxtext.metrics: this trainer's step does not record the "
            "balanced blocks' stats (only maxtext.trainers.pre_train.train does, which the "
            "command runs); call metrics.uninstall() to train with it without them"
        )
