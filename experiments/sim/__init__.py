"""Rack-scale step-time simulator for MoE training with expert load balancing.

        python -m experiments.sim             # the full table
        python -m experiments.sim --models=qwen3-235b --scenarios=ep64-nvl72
        python -m experiments.sim --traces_dir=path/to/traces

For each model shape (published configs of GLM-4.5-Air 106B, Qwen3-235B-A22B, DeepSeek-V3 671B),
each parallel layout (EP8 in one HGX H100 node; EP64 in a GB200 NVL72 rack; 2560 H100 GPUs as
DP40 x EP64 and as DP x EP=E) and each workload (the model's real expert-load trace, rank-level
Zipf at initial 1.5 / 2 / 3), the simulator samples per-layer, per-microbatch load matrices, runs
each balancer on them, and turns the per-rank loads into a step time with the step model
(`experiments.lab.stepmodel`: shapes, links, the layer's time, the calibration).
Throughput relative to the force-balanced ideal is step_ideal / step_baseline.

Modules, in the order the data flows:
  streams    load streams per (DP group, sampled layer): traces and generated Zipf; Sampling
  balancers  none, eplb_periodic, eplb_exact, eplb_plus (experiments.lab.loads.baselines), ultraep
  cell       one (model, layout, workload) cell: every balancer, step times, table rows
  assumptions  the assumptions printed before the tables
  report     the calibration, the tables and the verdict
  main       the flags and the run (``python -m experiments.sim``)
"""
