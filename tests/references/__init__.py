"""The tests' independent references, one home each (tests of them: test_*.py beside them).

moe.py       the dense one-device MoE (and `HIGHEST`, the matmul precision of every reference)
planner.py   the NumPy planner of ffi/PLANNER.md
dispatch.py  the dispatch rules: prefix-sum transport, kept pairs, instances
relay.py     the relay schedule of ffi/TRANSFER.md
"""
