"""The experiments' shared part: what more than one program uses. The programs (bench, gpu,
planner, replay, serve, sim, stepmodel_programs, train, hf_fixtures) are leaves over it: each
imports `experiments.lab`, `models` and `ultraep_jax`, never another program.

  loads/       load matrices (generated, drifting, the measured traces and their readers), the
               baselines and the policies' one runner
  stepmodel/   the step cost model at scale: shapes, links, one layer's time, the calibration
  training/    a training run's reusable parts: config, data, mesh and model, workdir,
               checkpoints, each step's layer records
  one file per job: cli, program, output_files, records, devices, pinned_ranks, concurrency,
               walltime, summaries, batched, step_terms
"""
