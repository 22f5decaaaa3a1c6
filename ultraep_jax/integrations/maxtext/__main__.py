"""MaxText's own trainer with ultraep_jax balancing its MoE blocks.

    python -m ultraep_jax.integrations.maxtext <MaxText config.yml> [key=value ...]
        [ultraep_<key>=<value> ...]

Everything but the ``ultraep_*`` keys goes to MaxText as it is (`maxtext.trainers.pre_train.train`).
A setting the integration does not cover is refused in one line as soon as the trainer has read
MaxText's config, before it builds a model (`coverage.check_config`).
"""

from __future__ import annotations

import functools
import sys

from ultraep_jax.integrations.maxtext.settings import KEYS, PREFIX, command_settings, split_keys

USAGE = f"""usage: python -m ultraep_jax.integrations.maxtext CONFIG.yml [key=value ...] \\
           [{PREFIX}<key>=<value> ...]

MaxText's own trainer (maxtext.trainers.pre_train.train) with ultraep_jax balancing every routed
MoE block: CONFIG.yml and key=value are MaxText's (its configs/base.yml lists them); the
{PREFIX}* keys are ours, taken off before MaxText reads the rest (a leading -- is allowed).
Each step logs, after MaxText's line, the imbalance before -> after per MoE layer, the pairs
dropped and the replicas; they are also in MaxText's metrics as ultraep/... scalars.

The balancer's defaults (min_tokens_per_replica=1024, min_tokens_per_rank=256 tokens) are meant
for real batches: a small test run makes no replicas unless it lowers them (docs/maxtext.md).

ultraep_jax's keys:
""" + "\n".join(f"  {PREFIX}{k}: {v}" for k, v in KEYS.items())

#: What the command says when MaxText cannot be imported.
NO_MAXTEXT = (
    'error: MaxText is not installed: pip install ".[maxtext]" and its requirements, as '
    "docs/maxtext.md says ({})"
)


def main(argv: list[str]) -> int:
    """Runs MaxText's trainer on ``argv`` (program name first) with balancing on."""
    if any(a in ("-h", "--help", "--helpfull") for a in argv[1:]) or len(argv) < 2:
        print(USAGE)
        return 0 if len(argv) >= 2 else 2
    try:
        import maxtext  # noqa: F401, PLC0415 (the extra)
        from absl import app  # noqa: PLC0415 (MaxText's own, imported only to run)
    except ImportError as e:
        print(NO_MAXTEXT.format(e), file=sys.stderr)
        return 2
    from ultraep_jax.integrations import maxtext as integration  # noqa: PLC0415
    from ultraep_jax.integrations.maxtext import coverage  # noqa: PLC0415

    try:
        rest, keys = split_keys(argv[1:])
        balancing, allow_untested = command_settings(keys)
        integration.enable_balancing(balancing, allow_untested_maxtext=allow_untested)
    except (TypeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from maxtext.configs import pyconfig  # noqa: PLC0415
    from maxtext.trainers.pre_train import train  # noqa: PLC0415

    from ultraep_jax.integrations.maxtext import metrics  # noqa: PLC0415

    metrics.install()
    read = pyconfig.initialize
    pyconfig.initialize = checked_config(read)
    try:
        app.run(train.main, argv=[argv[0], *rest])
    except coverage.NotCovered as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        pyconfig.initialize = read
    return 0


def checked_config(read):
    """MaxText's config reader ``read`` (`pyconfig.initialize`), refusing a config the
    integration does not cover (`coverage.check_config`) as soon as it is read, before the
    trainer builds a model."""
    from ultraep_jax.integrations.maxtext import coverage  # noqa: PLC0415

    @functools.wraps(read)
    def initialize(*args, **kwargs):
        config = read(*args, **kwargs)
        coverage.check_config(config)
        return config

    return initialize


if __name__ == "__main__":
    sys.exit(main(sys.argv))
