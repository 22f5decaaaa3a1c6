"""The ratios a whole training step is judged by: `experiments.bench.step` measures them between
its modes and the step model (`experiments.lab.stepmodel.cpu_step`) predicts the same ones; here, in
the model, so that the model imports no program."""

#: The ratios reported: name -> (mode A, mode B, scale): per round, A's step time / B's x scale.
RATIOS = {
    "balanced_pct_of_ideal": ("ideal", "balanced", 100.0),
    "balanced_x_over_plain": ("plain", "balanced", 1.0),
    "balanced_x_over_plain@1.25": ("plain@1.25", "balanced", 1.0),
    "plain_pct_of_ideal": ("ideal", "plain", 100.0),
}
