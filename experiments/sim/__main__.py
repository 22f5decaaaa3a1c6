"""``python -m experiments.sim``: the at-scale simulator (see ``experiments/sim/simulate.py``)."""

from absl import app

from experiments.sim.simulate import main

if __name__ == "__main__":
    app.run(main)
