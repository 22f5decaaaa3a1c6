"""usage: python -m experiments.replay [--flag=value ...]

Per-rank replay: each rank's work at EP32-64 (every rank's rows, groups, slots and exchanges as
the layer computes them) timed one rank at a time with the layer's kernels; the busiest rank's
step for each balancing policy against the force-balanced ideal (`experiments.replay.main`).

examples:
  python -m experiments.replay                                  # CPU, scaled shapes, minutes
  python -m experiments.replay --transfer_model=deepseek_v3     # + the layer at real ratios
  python -m experiments.replay --calibration_out=FILE           # + the experts' fit for the sim
"""

from absl import flags

from experiments.lab.program import run_main
from experiments.replay import main

flags.adopt_module_key_flags(main)  # --help lists the replay's flags

if __name__ == "__main__":
    run_main(main.main)
