"""The replica stage: the experts' weights copied to the spare slots their plan fills, and the
slot experts run on them.

  relay.py      the relay schedule: who sends each slot its weights, in which hop
  transfer.py   the weights moved hop by hop (gradients back by the transpose)
  streaming.py  masters and slots through the kernel, the transfer in chunks of F, skipped when
                the plan has no replica
"""
