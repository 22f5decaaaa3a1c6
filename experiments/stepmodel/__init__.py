"""The one model of a training step at scale, shared by every program that states a figure
beyond what this machine runs (sim, replay, bench.fanout, the GPU runbook's summary).

  shapes        every target shape, stated once in shapes.toml: models, clusters, parallel
                layouts, the anchor's published setup (one loader)
  links         all-to-all, replica copy and relayed transfer per link class (NVLink, IB)
  layer         one MoE layer's time from its terms, with one overlap rule; FLOP terms
  calibration   the model's rates in one object (Calibration) and their fit from the per-rank
                replay (fit, provenance, the calibration file); the GPU-side estimates' bands
  pinned        the model of this machine's two pinned ranks from measured rates
                (python -m experiments.bench.rates), against the measured ratios
  anchor        UltraEP's EP64 setup with the overheads a GPU adds, its plans and ours
  topology      topology-aware against topology-blind replica transfer on the traces, 8-GPU
                nodes and NVL72 (python -m experiments.stepmodel.topology)

The registry of balancing policies is `experiments.loads.policies`.
"""
