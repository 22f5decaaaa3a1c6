"""The per-rank replay: expert parallelism at any EP size, each rank's work timed one rank at a
time on one device.

        python -m experiments.replay                            # CPU, scaled shapes, minutes
        python -m experiments.replay --shape=deepseek_v3        # real shapes, for a GPU

Modules: main (the entry: flags, tables, calibration file), work (each rank's rows, groups,
slots and exchanges per policy, as the layer computes them), timing (the timed programs).
"""
