"""The anchor: UltraEP's published EP64 setup through the step model, with the overheads a GPU
run adds, for UltraEP's plans and ours.

    python -m experiments.stepmodel_programs.anchor               # the table of docs/results.md
    python -m experiments.stepmodel_programs.anchor --seeds=2 --scenario=ep64-nvl72

The setup is the step model's ``ANCHOR`` (DeepSeek-V3, EP64, 2 spare slots per rank, top-8,
8192 tokens per rank; `shapes.toml`), on ``--scenario``'s cluster. For each of its published
initial max/mean (1.51 / 2.01 / 3.03):

  UltraEP  its plans as published: the busiest rank at the final max/mean (1.01) in E/R masters
           and both slots, the replica transfer as long as the most copies of one expert (sent
           directly by its master), its planner at its published GPU time
  ours     `uep.plan` on rank-level Zipf loads generated to that initial max/mean
           (`experiments.lab.loads.workloads.rank_zipf_loads`), the busiest rank's own groups, the
           relayed transfer (`links.relay_copies`), our planner at its GPU time

each charged by `layer.layer_time`'s one rule in every MoE layer of a training step, against the
force-balanced ideal (every rank at the mean in E/R groups, nothing moved, no planner, no added
kernel) and against no balancing (the initial busiest rank). The GPU-side terms are estimates
with a band (`calibration`): the grouped matmul's rate (measured on an H100, 506-550 TFLOP/s
forward + backward) with each group's last tile padded to 128 rows, the planner's GPU time
(ours measured, 0.244-0.264 ms; UltraEP's published 0.067-0.078 ms), a kernel launch latency of
2-10 us for each of the 12 kernels balancing adds. Each figure is printed at the middle of every
band and as the lowest and highest over the bands' corners. The links are the cluster's nominal
rates at the model's link efficiency (not varied: they cost the ideal as much).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
from absl import flags

import ultraep_jax as uep
from experiments.lab.loads import policies, workloads
from experiments.lab.program import run_main
from experiments.lab.stepmodel import calibration as cal
from experiments.lab.stepmodel import layer, links
from experiments.lab.stepmodel.shapes import ANCHOR, CLUSTERS, SCENARIOS


@dataclasses.dataclass(frozen=True)
class Corner:
    """One choice within each estimated term's band.

    Attributes:
      rates: the step model's rates at this choice (`Calibration`): ``expert_tflops`` the grouped
        matmul's forward + backward rate, ``launch_s`` the latency of the kernels balancing adds
        to a layer (`corner`).
      plan_at: where in each planner's GPU time range (0: low end, 1: high end); the range is the
        planner's own (`Load.plan_ms`), not a rate of the step.
    """

    rates: cal.Calibration
    plan_at: float

    def __post_init__(self):
        if self.rates.expert_tflops is None or not 0 <= self.plan_at <= 1:
            raise ValueError(f"Corner: {self}")

    def plan_s(self, plan_ms: tuple[float, float]) -> float:
        """Seconds of a planner whose GPU time is in ``plan_ms`` (low, high)."""
        return 1e-3 * (plan_ms[0] + self.plan_at * (plan_ms[1] - plan_ms[0]))


def corner(gmm_tflops: float, launch_us: float, plan_at: float) -> Corner:
    """The corner of a grouped-matmul rate (TFLOP/s), one added kernel's launch latency (us, for
    each of `calibration.EXTRA_KERNELS`) and a place in the planners' ranges."""
    launch = 1e-6 * launch_us * cal.EXTRA_KERNELS
    return Corner(cal.Calibration(expert_tflops=gmm_tflops, launch_s=launch), plan_at)


MIDDLE = corner(float(np.mean(cal.GPU_GMM_FWD_BWD_TFLOPS)), float(np.mean(cal.LAUNCH_US)), 0.5)
CORNERS = tuple(
    corner(g, u, p)
    for g, u, p in itertools.product(cal.GPU_GMM_FWD_BWD_TFLOPS, cal.LAUNCH_US, (0.0, 1.0))
)


@dataclasses.dataclass(frozen=True)
class Load:
    """One layer's balanced load on its busiest rank, as the step model charges it.

    Attributes:
      busiest_G: float [G], rows of the busiest rank's groups after balancing.
      none_G: float [G], rows of the busiest rank's master groups before it.
      copies: the replica transfer's length in expert copies.
      plan_ms: the planner's GPU time range (low, high).
      replicas: replicas the plan makes.
    """

    busiest_G: np.ndarray
    none_G: np.ndarray
    copies: float
    plan_ms: tuple[float, float]
    replicas: float


def layer_of(load: Load, corner: Corner, balanced: bool, scenario) -> layer.LayerTime:
    """One MoE layer of a training step at ``load``: balanced, or as routed (``balanced``
    False: no planner, no transfer, no added kernel)."""
    model, cluster = ANCHOR.shape, CLUSTERS[scenario.cluster]
    rates = corner.rates if balanced else dataclasses.replace(corner.rates, launch_s=0.0)
    params = layer.CostParams(calibration=rates)
    rows_G = load.busiest_G if balanced else load.none_G
    return layer.layer_time(
        float(np.sum(rows_G)),
        load.copies if balanced else 0.0,
        corner.plan_s(load.plan_ms) if balanced else 0.0,
        model,
        scenario.ep,
        cluster,
        params,
        layer.tiled_expert_seconds(rows_G, model, rates.expert_tflops),
    )


def anchor_step_seconds(load: Load, corner: Corner, balanced: bool, scenario) -> float:
    """A training step's seconds: every MoE layer at ``load`` (`layer_of`), plus the dense
    layers and the LM head."""
    model, cluster = ANCHOR.shape, CLUSTERS[scenario.cluster]
    per_layer = layer_of(load, corner, balanced, scenario).total
    fixed = layer.fixed_seconds(model, cluster, layer.CostParams())
    return layer.group_step_seconds(per_layer, 1, model, fixed, 1)


def ideal_seconds(corner: Corner, scenario) -> float:
    """The force-balanced ideal step: every rank at the mean rows in its E/R master groups."""
    em = ANCHOR.experts_per_rank
    mean = np.full(em, ANCHOR.pairs_per_rank / em)
    ideal = Load(mean, mean, 0.0, (0.0, 0.0), 0)
    return anchor_step_seconds(ideal, corner, False, scenario)


def published_load(i: int) -> Load:
    """UltraEP's plan at its ``i``-th initial max/mean, from its published counts: the busiest
    rank at the final max/mean over E/R masters and both slots alike, its initial busiest rank
    over E/R masters alike, the transfer as long as the most replicas of one expert."""
    mean, em, slots = ANCHOR.pairs_per_rank, ANCHOR.experts_per_rank, ANCHOR.slots_per_rank
    after = np.full(em + slots, ANCHOR.final_imbalance * mean / (em + slots))
    before = np.full(em, ANCHOR.initial_imbalance[i] * mean / em)
    copies = float(ANCHOR.max_replicas_per_expert[i])
    return Load(after, before, copies, ANCHOR.plan_ms, ANCHOR.replicas[i])


def our_loads(initial: float, seeds: int) -> list[Load]:
    """Our planner's plans on ``seeds`` rank-level Zipf load matrices at ``initial`` max/mean:
    per matrix, the busiest rank's groups after and before balancing and the relayed
    transfer's length (`CostParams.relay_fanout`)."""
    R, E, k = ANCHOR.ep, ANCHOR.shape.num_experts, ANCHOR.shape.top_k
    batch = np.stack(
        [
            workloads.rank_zipf_loads(R, E, ANCHOR.tokens_per_rank, k, initial, s)
            for s in range(seeds)
        ]
    )
    cfg = uep.BalancerConfig(num_experts=E, ep_size=R, slots_per_rank=ANCHOR.slots_per_rank)
    plans = policies.ultraep_balanced(batch, cfg)
    em = ANCHOR.experts_per_rank
    held = np.stack([p.layout[:, em:] for p in plans])  # each rank's slots: what it receives
    copies = links.relay_copies(held, E, layer.CostParams().relay_fanout)["length"]
    out = []
    for loads, plan, c in zip(batch, plans, copies, strict=True):
        masters = loads.sum(axis=0).reshape(R, em)  # [R, E/R]: each rank's experts' rows
        out.append(
            Load(
                plan.quota[np.argmax(plan.rank_load)].astype(np.float64),
                masters[np.argmax(masters.sum(axis=1))].astype(np.float64),
                float(c),
                cal.GPU_PLAN_MS,
                plan.num_replicas,
            )
        )
    return out


def figures(loads: list[Load], scenario) -> dict:
    """% of the ideal and the speedup over no balancing, each averaged over ``loads``, at
    `MIDDLE` and their lowest and highest over `CORNERS`; the balanced layer's ms and what
    balancing adds to it (planner with the load all-gather, launches, exposed transfer) at
    `MIDDLE`."""

    def at(corner):
        ideal = ideal_seconds(corner, scenario)
        steps = [anchor_step_seconds(x, corner, True, scenario) for x in loads]
        nones = [anchor_step_seconds(x, corner, False, scenario) for x in loads]
        pct = 100.0 * float(np.mean([ideal / s for s in steps]))
        return pct, float(np.mean([n / s for n, s in zip(nones, steps, strict=True)]))

    mid, every = at(MIDDLE), [at(c) for c in CORNERS]
    terms = [layer_of(x, MIDDLE, True, scenario) for x in loads]
    return {
        "added_ms": 1e3 * float(np.mean([t.plan + t.launch + t.transfer_exposed for t in terms])),
        "layer_ms": 1e3 * float(np.mean([t.total for t in terms])),
        "pct": mid[0],
        "pct_band": (min(p for p, _ in every), max(p for p, _ in every)),
        "speedup": mid[1],
        "speedup_band": (min(s for _, s in every), max(s for _, s in every)),
        "replicas": float(np.mean([x.replicas for x in loads])),
        "final": float(np.mean([np.sum(x.busiest_G) for x in loads])) / ANCHOR.pairs_per_rank,
    }


def table(seeds: int, scenario_name: str) -> list[str]:
    """The anchor's table: per initial max/mean, UltraEP's plans and ours."""
    scenario = SCENARIOS[scenario_name]
    lines = [
        f"UltraEP's EP{ANCHOR.ep} setup ({ANCHOR.shape.source}, {ANCHOR.slots_per_rank} slots per "
        f"rank, top-{ANCHOR.shape.top_k}, {ANCHOR.tokens_per_rank} tokens per rank) on "
        f"{scenario.note}; training step, {ANCHOR.shape.moe_layers} MoE layers. % of the "
        "force-balanced ideal and speedup over no balancing at the middle of the estimated "
        "bands [lowest, highest]:",
        f"{'initial':>8} {'plans':>8} {'replicas':>9} {'final':>6} {'layer ms':>9} "
        f"{'added ms':>9} {'% of ideal':>22} {'x none':>20}",
    ]
    for i, initial in enumerate(ANCHOR.initial_imbalance):
        rows = {
            "UltraEP": [published_load(i)],
            "ours": our_loads(initial, seeds),
        }
        for name, loads in rows.items():
            f = figures(loads, scenario)
            lines.append(
                f"{initial:8.2f} {name:>8} {f['replicas']:9.1f} {f['final']:6.3f} "
                f"{f['layer_ms']:9.2f} {f['added_ms']:9.3f} "
                f"{f['pct']:8.2f} [{f['pct_band'][0]:5.2f}, {f['pct_band'][1]:5.2f}] "
                f"{f['speedup']:6.3f} [{f['speedup_band'][0]:5.3f}, {f['speedup_band'][1]:5.3f}]"
            )
    lines.append(
        f"UltraEP measured {ANCHOR.pct_ideal} % of the ideal and {ANCHOR.speedup}x over none "
        f"(its exposed overhead under {ANCHOR.exposed_overhead_ms} ms per layer). Estimated "
        f"here: grouped matmul {cal.GPU_GMM_FWD_BWD_TFLOPS[0]:g}-{cal.GPU_GMM_FWD_BWD_TFLOPS[1]:g}"
        f" TFLOP/s with {cal.GPU_GMM_TILE_ROWS}-row tiles, {cal.EXTRA_KERNELS} added kernels at "
        f"{cal.LAUNCH_US[0]:g}-{cal.LAUNCH_US[1]:g} us, planner {cal.GPU_PLAN_MS[0]}-"
        f"{cal.GPU_PLAN_MS[1]} ms (ours, measured) / {ANCHOR.plan_ms[0]}-{ANCHOR.plan_ms[1]} ms "
        "(UltraEP, published); links and the rest of the step as `python -m experiments.sim`."
    )
    return lines


def main(argv):
    """Prints the table."""
    del argv
    print("\n".join(table(flags.FLAGS.seeds, flags.FLAGS.scenario)))


if __name__ == "__main__":
    # Defined here, not on import: the tests import this module beside programs with flags.
    flags.DEFINE_integer("seeds", 5, "Generated load matrices per initial max/mean (ours).")
    layouts = [n for n, s in SCENARIOS.items() if s.ep == ANCHOR.ep]
    flags.DEFINE_enum("scenario", "dp40xep64", layouts, "The layout and its cluster.")
    run_main(main)
