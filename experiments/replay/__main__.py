"""``python -m experiments.replay``: the per-rank replay (see `experiments.replay.main`)."""

from absl import app, flags

from experiments.replay import main

flags.adopt_module_key_flags(main)  # --help lists the replay's flags

if __name__ == "__main__":
    app.run(main.main)
