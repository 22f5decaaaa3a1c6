"""``python -m experiments.sim``: the at-scale simulator (see `experiments.sim`)."""

from absl import flags

from experiments.lab.program import run_main
from experiments.sim import main

flags.adopt_module_key_flags(main)  # --help lists the simulator's flags

if __name__ == "__main__":
    run_main(main.main)
