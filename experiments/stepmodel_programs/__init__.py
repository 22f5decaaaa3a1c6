"""The programs that print figures from the step model (`experiments.lab.stepmodel`), each with its
flags and ``main``; the model imports none of them.

  pinned        the model of this machine's two pinned ranks from measured rates
                (python -m experiments.bench.rates), against the measured ratios
                (python -m experiments.stepmodel_programs.pinned)
  anchor        UltraEP's EP64 setup with the overheads a GPU adds, its plans and ours
                (python -m experiments.stepmodel_programs.anchor)
  topology      topology-aware against topology-blind replica transfer on the traces, 8-GPU
                nodes and NVL72 (python -m experiments.stepmodel_programs.topology); its figures
                in topology_cells, its tables and plot in topology_report
"""
