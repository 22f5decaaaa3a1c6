"""The tests' independent references, one home each (tests of them: test_*.py beside them). They
import nothing from experiments/ or models/.

moe.py       the dense one-device MoE (and `HIGHEST`, the matmul precision of every reference)
routing.py   the routers: which experts a token picks, the weights and the router losses
layer.py     the dense layer: the router's weights of a given choice, then the dense MoE
planner.py   the NumPy planner of ffi/PLANNER.md
dispatch.py  the dispatch rules: prefix-sum transport, kept pairs, instances
relay.py     the relay schedule of ffi/TRANSFER.md

The exact solver (a mixed-integer program) and its small cases are `ultraep_jax.oracle`, so that
the experiments may use it too (test_oracle.py here checks it).
"""
