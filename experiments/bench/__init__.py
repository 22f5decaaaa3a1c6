"""Benchmarks of the layer, each a command:

        python -m experiments.bench.moe       # the MoE layer on 8 simulated CPU devices, or EP=2
                                              # as pinned processes (--pinned_ranks=2)
        python -m experiments.bench.step      # the whole training step against the
                                              # force-balanced ideal, pinned ranks
        python -m experiments.bench.compile   # compile time of the training step against depth
        python -m experiments.bench.compile_layer   # one layer's trace, lower and compile times
        python -m experiments.bench.fanout    # the replica transfer's fan-out on the real traces
        python -m experiments.bench.rates     # this machine's rates for the step model

The planner's benchmarks are in `experiments.planner`, the per-rank replay in
`experiments.replay`, the GPU checks in `experiments.gpu`.
"""
