"""The planner's benchmarks:

        python -m experiments.planner         # balance, replicas and time per plan; baselines
        python -m experiments.planner.exact   # exact mode's misses against an exact solver

Modules: main (the entry: flags, tables), setup (its flags and load matrices), baselines (the
baseline table), exact (entry: the miss rate; its exact solver, a mixed-integer program, and
random cases are the library's `ultraep_jax.oracle`, the tests' reference too, through
`ultraep_jax.tools`).
"""
