"""usage: python -m experiments.serve --workdir=DIR [--prompts=FILES] [--flag=value ...]

Prefills a batch of prompts with the newest checkpoint of a workdir written by experiments.train,
balanced and with plain expert parallelism on the same batch, and prints per MoE layer the load
before and after balancing, the prefill time of each mode, whether both predict the same next
tokens, and a greedy continuation of each prompt. Each prompt file is one prompt; --prompts
defaults to the 24 prompts of experiments/serve/prompts.

examples:
  python -m experiments.serve --workdir=runs/default
  python -m experiments.serve --workdir=runs/default --prompts='my_prompts/*.txt' --new_tokens=0
  python -m experiments.serve --workdir=runs/default --prompts=experiments/serve/prompts \\
      --pinned_ranks=2           # EP=2 as two pinned processes: the busiest rank's time
"""

from absl import flags

from experiments.lab.program import run_main
from experiments.serve import main

# --helpshort lists the flags of the module run as a program: this one.
flags.adopt_module_key_flags(main)

if __name__ == "__main__":
    run_main(main.main)
