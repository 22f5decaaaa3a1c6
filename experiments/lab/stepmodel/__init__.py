"""The one model of a training step at scale, shared by every program that states a figure
beyond what this machine runs (sim, replay, bench.fanout, the GPU runbook's summary). The model
alone: no flags, no ``main``; the programs that print its figures (pinned, anchor, topology) are
`experiments.stepmodel_programs`.

  shapes        every target shape, stated once in shapes.toml: models, clusters, parallel
                layouts, the anchor's published setup (one loader)
  links         all-to-all, replica copy and relayed transfer per link class (NVLink, IB)
  layer         one MoE layer's time from its terms, with one overlap rule; FLOP terms
  cpu_rates     this machine's two pinned CPU ranks' rates (`experiments.bench.rates`'s file)
                read into a Calibration, and one layer's seconds from them
  calibration   the model's rates in one object (Calibration, with the measured fits it may
                carry: the replay's expert costs, the pinned ranks' layer terms) and the replay's
                fit (provenance, the calibration file); the GPU-side estimates' bands

The registry of balancing policies and their runner is `experiments.lab.loads.policies`.
"""
