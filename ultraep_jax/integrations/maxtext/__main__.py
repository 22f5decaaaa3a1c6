"""MaxText's own trainer with ultraep_jax balancing its MoE blocks.

    python -m ultraep_jax.integrations.maxtext <MaxText config.yml> [key=value ...]
        [ultraep_<key>=<value> ...]

Everything but the ``ultraep_*`` keys goes to MaxText as it is (`maxtext.trainers.pre_train.train`).
"""

from __future__ import annotations

import sys

from ultraep_jax.integrations.maxtext.settings import KEYS, PREFIX, balancing_from_keys, split_keys

USAGE = f"""usage: python -m ultraep_jax.integrations.maxtext CONFIG.yml [key=value ...] \\
           [{PREFIX}<key>=<value> ...]

MaxText's own trainer (maxtext.trainers.pre_train.train) with ultraep_jax balancing every routed
MoE block: CONFIG.yml and key=value are MaxText's (its configs/base.yml lists them); the
{PREFIX}* keys are ours, taken off before MaxText reads the rest (a leading -- is allowed).
Each step logs, after MaxText's line, the imbalance before -> after per MoE layer, the pairs
dropped and the replicas; they are also in MaxText's metrics as ultraep/... scalars.

ultraep_jax's keys:
""" + "\n".join(f"  {PREFIX}{k}: {v}" for k, v in KEYS.items())


def main(argv: list[str]) -> int:
    """Runs MaxText's trainer on ``argv`` (program name first) with balancing on."""
    if any(a in ("-h", "--help", "--helpfull") for a in argv[1:]) or len(argv) < 2:
        print(USAGE)
        return 0 if len(argv) >= 2 else 2
    try:
        rest, keys = split_keys(argv[1:])
        balancing = balancing_from_keys(keys)
    except (TypeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from absl import app  # noqa: PLC0415 (MaxText's own, imported only to run)

    from ultraep_jax.integrations import maxtext  # noqa: PLC0415
    from ultraep_jax.integrations.maxtext import metrics  # noqa: PLC0415

    maxtext.enable_balancing(balancing)
    metrics.install()
    from maxtext.trainers.pre_train import train  # noqa: PLC0415

    app.run(train.main, argv=[argv[0], *rest])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
