"""A training run's parts that other programs share (serve loads a run's checkpoints and config;
bench.step times the trainer's step; the step model's programs read its config): the config
(`config`), where its devices go (`mesh_sizes`), the corpus (`data`), the mesh, the model and the
step (`build`), the run's folder (`workdir`), its checkpoints (`checkpoints`) and each step's
layer records (`layer_stats`). `experiments.train` is the program that runs them."""
