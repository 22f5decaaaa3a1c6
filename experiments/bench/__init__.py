"""Benchmarks, each a command:

        python -m experiments.bench.planner         # planner quality and time; the baseline table
        python -m experiments.bench.planner_exact   # exact mode's misses against an exact solver
        python -m experiments.bench.moe             # the MoE layer on 8 simulated CPU devices
        python -m experiments.bench.gpu_check       # the GPU path on one GPU (--dry_run: on CPU)

Modules: planner (entry), planner_setup (its flags and load matrices), planner_baselines (the
baseline table); planner_exact (entry); moe; gpu_check (entry),
gpu_planner, gpu_gmm, gpu_moe (its sections).
"""
