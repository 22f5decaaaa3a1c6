"""``python -m experiments.planner``: the planner benchmark (see `experiments.planner.main`)."""

from absl import flags

from experiments.lab.program import run_main
from experiments.planner import main

flags.adopt_module_key_flags(main)  # --help lists the benchmark's flags

if __name__ == "__main__":
    run_main(main.main)
