"""Benchmarks, each a command:

        python -m experiments.bench.planner         # planner quality and time; the baseline table
        python -m experiments.bench.planner_exact   # exact mode's misses against an exact solver
        python -m experiments.bench.moe             # the MoE layer on 8 simulated CPU devices
        python -m experiments.bench.replay          # per-rank replay: every rank's work at EP
                                                    # 32/64, timed one rank at a time on one device
        python -m experiments.bench.gpu_check       # the GPU path on one GPU (--dry_run: on CPU)

Modules: planner (entry), planner_setup (its flags and load matrices), planner_baselines (the
baseline table); planner_exact (entry); moe; replay (entry: flags, tables, calibration file),
replay_work (each rank's rows, groups, slots and exchanges per policy, as the layer computes
them), replay_timing (the timed programs); gpu_check (entry), gpu_planner, gpu_gmm, gpu_moe (its
sections).
"""
