"""The GPU runbook and its checks:

        bash experiments/gpu/run_all.sh              # every GPU figure, into experiments/results/
        python -m experiments.gpu.check --out=DIR    # the GPU path on one GPU (--dry_run: on CPU)
        python -m experiments.gpu.summary --dir=DIR  # summary.md of a run_all.sh folder

Modules: check (the entry), planner, gmm, moe, exchange (its sections), hlo_schedule (where the
replica transfer sits in a compiled schedule), summary.
"""
