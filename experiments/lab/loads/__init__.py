"""Expert loads and the balancers compared on them (NumPy, host only; ultraep through JAX).

Modules: workloads (load matrices: generated Zipf and drifting streams, trace layers as load
matrices, metrics), traces (where the measured traces are and how their files read), baselines
(none, eplb_exact, eplb_periodic, eplb_plus, ultraep, each returning a ``Balanced``), exact
(whether any plan reaches a threshold: a mixed-integer program; small random cases).
"""
