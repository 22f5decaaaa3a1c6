"""usage: python -m experiments.train [--flag=value ...]

Trains a small MoE language model with exact-load expert balancing fused into the jitted step, on
8 simulated CPU devices (or the accelerators there are), writing checkpoints, metrics.jsonl, a
plot and summary.json into --workdir. Rerunning the same command continues from the last
checkpoint; Ctrl-C or SIGTERM stops it after the current step, with everything saved.

examples:
  python -m experiments.train                                     # the default run: runs/default
  python -m experiments.train --preset=deepseek_v3 --steps=100    # in runs/deepseek_v3
  python -m experiments.train --balance=none --workdir=runs/none  # plain EP, to compare
"""

from absl import flags

from experiments.lab.program import run_main
from experiments.train import main

# --helpshort lists the flags of the module run as a program: this one.
flags.adopt_module_key_flags(main)

if __name__ == "__main__":
    run_main(main.main)
