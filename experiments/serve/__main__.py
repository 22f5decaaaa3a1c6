"""``python -m experiments.serve``: prefill with a trained workdir (experiments/serve/main.py)."""

from absl import flags

from experiments.common import run_main
from experiments.serve import main

# --helpshort lists the flags of the module run as a program: this one.
flags.adopt_module_key_flags(main)

if __name__ == "__main__":
    run_main(main.main)
