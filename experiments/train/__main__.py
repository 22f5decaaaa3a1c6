"""``python -m experiments.train``: the training run (see ``experiments/train/main.py``)."""

from absl import app

from experiments.train.main import main

if __name__ == "__main__":
    app.run(main)
