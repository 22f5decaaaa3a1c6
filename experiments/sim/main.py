"""``python -m experiments.sim``: the flags, and the run that prints the simulator's tables."""

from __future__ import annotations

import pathlib
import sys
import time

import jax
from absl import flags

from experiments.lab import cli, dataclass_flags
from experiments.lab.output_files import write_json
from experiments.lab.stepmodel.calibration import Calibration, ExpertCost
from experiments.lab.stepmodel.layer import CostParams
from experiments.lab.stepmodel.shapes import MODELS, SCENARIOS
from experiments.sim import assumptions, balancers, cell, report
from experiments.sim.streams import Sampling

_MODELS = flags.DEFINE_list("models", list(MODELS), f"Model shapes: {', '.join(MODELS)}.")
_SCENARIOS = flags.DEFINE_list("scenarios", list(SCENARIOS), f"Layouts: {', '.join(SCENARIOS)}.")
_WORKLOADS = flags.DEFINE_list(
    "workloads",
    ["trace", "zipf1.5", "zipf2.0", "zipf3.0"],
    "trace (the model's real trace), zipfX (rank-level Zipf at initial X), ezipfX (expert Zipf).",
)
_BASELINES = flags.DEFINE_list(
    "baselines", list(balancers.BASELINE_ORDER), "Baselines to report (none is always in)."
)
_SAMPLING = dataclass_flags.define_flags(Sampling)
_COST = dataclass_flags.define_flags(
    CostParams, only=("tokens_per_rank", "seq_len", "relay_fanout")
)
_RATES = dataclass_flags.define_flags(Calibration, only=("gemm_efficiency", "link_efficiency"))
_BALANCER = cli.define_balancer_flags()
_TIMING_BATCH = flags.DEFINE_integer("timing_batch", 256, "Matrices per timed planner call.")
_JSON = cli.define_json_out()
_CALIBRATION = flags.DEFINE_string(
    "calibration",
    None,
    "A per-rank replay calibration file (python -m experiments.replay --calibration_out): "
    "the experts' measured fixed, per-row and per-group costs replace their FLOP model.",
)
_TRACES = cli.define_traces_dir()


def _workload_ok(name: str) -> bool:
    """Whether ``name`` is ``trace``, ``zipfX`` or ``ezipfX`` with a number X."""
    if name == "trace":
        return True
    try:
        float(name.removeprefix("e").removeprefix("zipf"))
    except ValueError:
        return False
    return name.startswith(("zipf", "ezipf"))


flags.register_validator(
    "models", lambda v: set(v) <= set(MODELS), f"each must be one of {', '.join(MODELS)}"
)
flags.register_validator(
    "scenarios", lambda v: set(v) <= set(SCENARIOS), f"each must be one of {', '.join(SCENARIOS)}"
)
flags.register_validator(
    "workloads", lambda v: all(map(_workload_ok, v)), "each must be trace, zipfX or ezipfX"
)
# One-line errors for sizes and efficiencies the simulation cannot use.
for _name in ("layers_sampled", "microbatches", "dp_groups", "zipf_pool", "timing_batch"):
    flags.register_validator(_name, lambda v: v >= 1, "must be >= 1")
for _name in ("tokens_per_rank", "seq_len", "relay_fanout"):
    flags.register_validator(_name, lambda v: v >= 1, "must be >= 1")
flags.register_validator("history", lambda v: v >= 0, "must be >= 0")
for _name in ("gemm_efficiency", "link_efficiency"):
    flags.register_validator(_name, lambda v: 0 < v <= 1, "must lie in (0, 1]")
flags.register_validator(
    "baselines",
    lambda v: set(v) <= set(balancers.BASELINE_ORDER),
    f"each must be one of {', '.join(balancers.BASELINE_ORDER)}",
)


def _check_traces(traces_dir: str, models, workload_names) -> None:
    """Ends with one line ``error: ...`` when the trace workload needs a trace not in
    ``traces_dir``."""
    if "trace" not in workload_names:
        return
    needed = sorted({MODELS[m].trace for m in models})
    missing = [t for t in needed if not (pathlib.Path(traces_dir) / t).is_dir()]
    if missing:
        print(
            f"error: --traces_dir={traces_dir} has no {' or '.join(missing)} folder (the trace "
            f"workload needs it; leave out --workloads=trace to run without)",
            file=sys.stderr,
        )
        sys.exit(2)


def _expert_cost(path: str | None) -> ExpertCost | None:
    """The calibration at ``path`` (None without one); ends with one line ``error: ...`` when it
    cannot be read."""
    if path is None:
        return None
    try:
        return ExpertCost.read(path)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: --calibration={path}: {e}", file=sys.stderr)
        sys.exit(2)


def _print_tables(cells: list[dict], expert_cost: ExpertCost | None) -> None:
    """The regime, per-cell and headline tables, and the verdict."""
    names = list(dict.fromkeys(n for c in cells for n in c["rows"]))
    print("Ideal per-layer time, ms per microbatch (forward + backward), and one replica copy:")
    print("\n".join(report.regime_table(cells)))
    print("\nThroughput as % of the force-balanced ideal, per cell:")
    print("\n".join(report.detail_table(cells, names)))
    print(
        "\nHeadline (mean over layouts and workloads; peak rows = max over them, x mean = "
        "multiple of T*k):"
    )
    print("\n".join(report.headline_table(cells, names)))
    print()
    print("\n".join(report.verdict(cells)))
    if expert_cost is not None:
        print()
        print("\n".join(report.calibration_lines(expert_cost, cells)))


def main(argv):
    """Prints the assumptions and the tables of every (model, layout, workload) cell."""
    del argv
    start = time.perf_counter()
    _check_traces(_TRACES.value, _MODELS.value, _WORKLOADS.value)
    calibration = Calibration(**_RATES(), expert_cost=_expert_cost(_CALIBRATION.value))
    params = CostParams(**_COST(), calibration=calibration)
    sampling = Sampling(**_SAMPLING())
    cfg_kwargs = _BALANCER()
    chosen = balancers.make_balancers(_BASELINES.value, _TIMING_BATCH.value)
    print("\n".join(assumptions.assumption_lines(params, cfg_kwargs, sampling)))
    print(f"Baselines: {', '.join(chosen)} (experiments.lab.loads.baselines)")
    print(f"Planner timed on: {jax.devices()[0].device_kind} (CPU), not a GPU\n")
    cells = cell.run_all(
        _MODELS.value,
        _SCENARIOS.value,
        _WORKLOADS.value,
        chosen,
        cfg_kwargs,
        params,
        sampling,
        _TRACES.value,
    )
    _print_tables(cells, params.expert_cost)
    print(f"\n(simulated in {time.perf_counter() - start:.0f} s)")
    write_json(_JSON.value, cells)
