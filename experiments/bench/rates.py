"""This machine's rates for the step model, at the break-even's layer shape, on pinned ranks.

    python -m experiments.bench.rates       # writes runs/rates/rates_cpu.json
    python -m experiments.bench.rates --json_out=experiments/results/rates_cpu.json  # committed
    python -m experiments.bench.rates --modes=train --tokens=256,2048 --json_out=/tmp/r.json
    python -m experiments.bench.rates --parts=rest --json_out=experiments/results/rates_cpu.json

The break-even's layers (`experiments.bench.breakeven`: D=128, F=512, E=8, top-2, EP=2 as two
pinned processes; `experiments.lab.skewed_layer`) take their time from a few rates, each measured
here on its own, so that the step model (`experiments.stepmodel_programs.pinned`) predicts their
ratios without being fitted to them:

  experts      the tiled expert kernel (`experts.registry.grouped_glu`, what the layer runs on
               CPU) on one rank's buffer of C rows with ``rows`` of them in ``groups`` groups,
               forward (prefill) and forward + backward (train): fitted as
               fixed + per buffer row x C + per row x rows + per group x groups
  stage        the balanced program's expert stage as the layer runs it on CPU
               (`replicas.streaming.experts_with_replicas` on both ranks: the kernel under
               its ``lax.cond``, and with a replica the transfer of its weights, a reduce-scatter
               forward and an all-gather backward), with no replica and with one, fitted alike
  a2a          gloo between the two pinned processes: the token all-to-all at each size the
               layer sends (R x T x k rows of D float32, the padded exchange's fixed size)
  planner      `uep.plan` at R=2, E=8 on one rank, per call
  overhead     the plain layers (dropless and capacity 1.05) with an unbiased router (skew 0)
               timed whole; what the experts and all-to-alls above leave of them is the layer's
               bookkeeping, fitted as fixed + per token x T + per buffer row x C
  rest         the rest of a training step of `experiments.train` at ``--rest_batch_size`` x
               ``--rest_seq_len`` tokens over the ranks (the ``moe_heavy`` preset at the layer's
               shape): the trainer's step with every routed-experts layer replaced by nothing
               (`experiments.bench.step_rest`), train mode only

``--parts`` picks what is measured: ``layer`` (every rate above but the rest) and / or ``rest``;
a run of some parts keeps the others of an existing ``--json_out`` file (same shape), and
notes in the file's provenance which part it re-measured when.

Every rate is a median of ``--repeats`` calls. Prints the rates, writes ``--json_out`` with the
provenance (machine, commit, command, date).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.experimental import multihost_utils
from jax.sharding import AxisType

import ultraep_jax as uep
from experiments.bench import step_rest
from experiments.bench.rates_file import PARTS, merged
from experiments.lab import cli, skewed_layer
from experiments.lab.concurrency import concurrency_check, concurrency_line
from experiments.lab.output_files import write_json
from experiments.lab.pinned_ranks import keep_freed_memory, launch_pinned_ranks, start_distributed
from experiments.lab.program import fail, run_main
from experiments.lab.stepmodel import calibration
from experiments.lab.walltime import median_seconds, seconds_per_plan
from models.presets import PRESETS
from ultraep_jax import tools

# The break-even's layer (bench.breakeven's shape, ranks and buffer), its tokens and modes.
_LAYER, _BALANCER = cli.define_layer_flags(
    pinned_ranks=2, swept=("tokens_per_device", "skew"), repeats=5, **skewed_layer.BREAKEVEN_SHAPE
)
cli.define_sweep_flags([256, 1024, 2048, 4096, 8192], skews=False)
cli.define_json_out()
cli.define_rank_flags()
# experiments/results/rates_cpu.json, which the step model's tests read, only when named.
flags.FLAGS.set_default("json_out", f"{cli.run_folder('rates')}/rates_cpu.json")
FLAGS = flags.FLAGS
_PARTS = flags.DEFINE_list("parts", list(PARTS), f"Parts to measure, of {', '.join(PARTS)}.")
flags.register_validator(
    "parts",
    lambda v: bool(v) and set(v) <= set(PARTS),
    f"must name some of {', '.join(PARTS)}",
)
_REST_BATCH = flags.DEFINE_integer(
    "rest_batch_size", 32, "The rest's global batch (sequences), as experiments.bench.step's."
)
_REST_SEQ = flags.DEFINE_integer("rest_seq_len", 128, "The rest's sequence length.")
#: The model whose rest is timed: experiments.bench.step's default preset, at the layer's shape.
REST_PRESET = "moe_heavy"

#: Busiest rank's rows per buffer, as multiples of the pairs a rank routes (T x k): the range
#: the break-even's ranks run (1.0 balanced, up to 1.8 at skew 3).
ROW_FACTORS = (0.5, 1.0, 1.8)
#: Non-empty groups of a rank: its E / R = 4 masters, with both spare slots filled.
GROUPS = (4, 6)


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()``."""
    return median_seconds(fn, repeats)


def _expert_fn(capacity: int, groups: int, mode: str):
    """A jitted call of the tiled kernel on a [capacity, D] buffer with ``groups`` groups of
    weights, forward (prefill) or forward + backward (train): fn(rows, weights, sizes)."""

    def forward(rows, weights, sizes):
        return tools.grouped_glu(rows, [weights], sizes, kernel="tiled")

    if mode == "prefill":
        return jax.jit(forward)

    def loss(rows, weights, sizes):
        return jnp.sum(jnp.square(forward(rows, weights, sizes)))

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def expert_points(mode: str, tokens: list[int], repeats: int) -> list[list[float]]:
    """[[C, rows, groups, seconds], ...]: the kernel timed over buffers of 1.05 x and R x the
    pairs a rank routes, busiest rows `ROW_FACTORS` and `GROUPS`."""
    D, F, K, R = FLAGS.d_model, FLAGS.d_ff, FLAGS.top_k, jax.device_count()
    rng = np.random.default_rng(0)
    points = []
    for t in tokens:
        pairs = K * t
        for capacity in sorted({math.ceil(FLAGS.capacity_factor * pairs), R * pairs}):
            x = jnp.asarray(rng.normal(size=(capacity, D)).astype(np.float32))
            for g in GROUPS:
                w = tuple(
                    jnp.asarray(rng.normal(size=s).astype(np.float32) * 0.05)
                    for s in ((g, D, F), (g, D, F), (g, F, D))
                )
                fn = _expert_fn(capacity, g, mode)
                for factor in ROW_FACTORS:
                    rows = min(capacity, round(factor * pairs))
                    sizes = jnp.asarray(np.diff(np.linspace(0, rows, g + 1).round()), jnp.int32)
                    seconds = _timed(lambda fn=fn, x=x, w=w, s=sizes: fn(x, w, s), repeats)
                    points.append([capacity, rows, g, seconds])
    return points


def _stage_fn(mesh, slot_expert: np.ndarray, mode: str):
    """The balanced program's expert stage on every rank (`streaming.experts_with_replicas`:
    the replica transfer and the kernel under the layer's ``lax.cond``) for the plan's slots
    ``slot_expert`` [R, S], forward or forward + backward: fn(rows, weights, sizes), each split
    over the ranks."""
    spec = jax.sharding.PartitionSpec("x")

    def stage(rows, w_gate, w_up, w_down, sizes):
        return tools.experts_with_replicas(
            rows,
            (w_gate, w_up, w_down),
            jnp.asarray(slot_expert),
            sizes,
            kernel="tiled",
            chunks=1,
            max_fanout=0,
            axis_name="x",
            backend="padded",
        )

    def loss(*args):
        return jnp.sum(jnp.square(stage(*args)))

    body = stage if mode == "prefill" else jax.grad(loss, argnums=(0, 1, 2, 3))
    out = spec if mode == "prefill" else (spec,) * 4
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=out))


def stage_points(mode: str, tokens: list[int], repeats: int, replicas: int) -> list[list[float]]:
    """[[C, rows, groups, seconds], ...]: the balanced program's expert stage (`_stage_fn`) with
    ``replicas`` (0 or 1) replicas, every rank at the same rows, over the buffers and rows of
    `expert_points`; a replica's slot takes an even share of the rows."""
    D, F, K, R = FLAGS.d_model, FLAGS.d_ff, FLAGS.top_k, jax.device_count()
    em, slots = FLAGS.num_experts // R, _BALANCER()["slots_per_rank"]
    mesh = jax.make_mesh((R,), ("x",), axis_types=(AxisType.Explicit,))
    sharding = jax.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    slot_expert = np.full((R, slots), -1, np.int32)
    slot_expert[1, : min(replicas, slots)] = 0  # rank 0's first expert on rank 1
    groups = em + replicas
    fn = _stage_fn(mesh, slot_expert, mode)  # jit: one compile per buffer size
    rng = np.random.default_rng(0)
    w = [
        jax.device_put(rng.normal(size=(R * em, *s)).astype(np.float32) * 0.05, sharding)
        for s in ((D, F), (D, F), (F, D))
    ]
    points = []
    for t in tokens:
        pairs = K * t
        for capacity in sorted({math.ceil(FLAGS.capacity_factor * pairs), R * pairs}):
            x = jax.device_put(rng.normal(size=(R * capacity, D)).astype(np.float32), sharding)
            for factor in ROW_FACTORS:
                rows = min(capacity, round(factor * pairs))
                sizes = np.zeros(em + slots, np.int32)
                sizes[:groups] = np.diff(np.linspace(0, rows, groups + 1).round())
                sizes = jax.device_put(np.tile(sizes, R), sharding)
                seconds = _timed(lambda x=x, s=sizes: fn(x, *w, s), repeats)
                points.append([capacity, rows, groups, seconds])
    return points


def a2a_points(tokens: list[int], repeats: int) -> list[list[float]]:
    """[[bytes per rank, seconds], ...]: the token all-to-all between the ranks at each
    ``tokens``, the size the padded exchange sends (R x T x k rows of D float32)."""
    D, K, R = FLAGS.d_model, FLAGS.top_k, jax.device_count()
    mesh = jax.make_mesh((R,), ("x",), axis_types=(AxisType.Explicit,))
    spec = jax.sharding.PartitionSpec("x")

    def a2a(x):
        return jax.lax.all_to_all(x, "x", 0, 0, tiled=True)

    fn = jax.jit(jax.shard_map(a2a, mesh=mesh, in_specs=spec, out_specs=spec))
    points = []
    for t in tokens:
        rows = R * K * t  # the padded exchange: R x max_chunk rows, max_chunk = T x k
        data = jax.device_put(jnp.zeros((R * rows, D)), jax.NamedSharding(mesh, spec))
        points.append([rows * D * 4, _timed(lambda data=data: fn(data), repeats)])
    return points


def planner_seconds(repeats: int) -> float:
    """Seconds per `uep.plan` call on a skewed [R, E] load with the layer's capacity
    (`walltime.seconds_per_plan`): what each rank runs per layer in the balanced programs."""
    R, E = jax.device_count(), FLAGS.num_experts
    cfg = uep.BalancerConfig(num_experts=E, ep_size=R, min_tokens_per_rank=0, **_BALANCER())
    loads = np.full((R, E), 256, np.int32)
    loads[:, : FLAGS.hot_experts] *= 4
    capacity = math.ceil(FLAGS.capacity_factor * int(loads.sum()) // R)
    return seconds_per_plan(loads, cfg, repeats, capacity=capacity)


def layer_points(mode: str, tokens: list[int], repeats: int) -> list[dict]:
    """The plain layers (dropless, capacity factor 1.05) with an unbiased router at each
    ``tokens``: their step (busiest rank's clock), buffer rows and busiest rank's rows."""
    mesh = jax.make_mesh((jax.device_count(),), ("expert",), axis_types=(AxisType.Auto,))
    out = []
    for t in tokens:
        layer = skewed_layer.SkewedLayer(**_LAYER(), tokens_per_device=t, skew=0.0)
        rng = np.random.default_rng(layer.seed)
        x, router = skewed_layer.skewed_inputs(mesh, layer, rng, one_rank=True)
        layers = {
            "dropless": skewed_layer.build(mesh, layer, None, router, None),
            "capped": skewed_layer.build(mesh, layer, None, router, FLAGS.capacity_factor),
        }
        runs = {name: skewed_layer.compile_step(moe, x, mode, t) for name, moe in layers.items()}
        skewed_layer.time_interleaved(runs, repeats)
        for name, r in runs.items():
            rows = min(r["buffer_rows"], max(r["rank_load_before"]))
            out.append(
                {
                    "layer": name,
                    "tokens": t,
                    "capacity": r["buffer_rows"],
                    "rows": rows,
                    "seconds": r["step_ms"] / 1e3,
                }
            )
    return out


def measure() -> dict:
    """Every layer rate of the module docstring on this run's ranks (every process runs it)."""
    tokens, modes, repeats = skewed_layer.sweep(
        FLAGS.tokens, FLAGS.modes, FLAGS.repeats, FLAGS.seq_len, FLAGS.quick
    )
    out = {"a2a": a2a_points(tokens, repeats), "modes": {}}
    multihost_utils.sync_global_devices("rates:collectives")
    out["planner_s"] = planner_seconds(repeats)
    for mode in modes:
        experts = expert_points(mode, tokens, repeats)
        multihost_utils.sync_global_devices(f"rates:{mode}")
        out["modes"][mode] = {
            "experts": experts,
            "stage": {str(n): stage_points(mode, tokens, repeats, n) for n in (0, 1)},
            "layers": layer_points(mode, tokens, repeats),
        }
    return out


def measure_rest() -> dict:
    """The rest of the training step (`step_rest.rest_seconds`) of `REST_PRESET` at the layer's
    shape, with its batch, tokens per rank and layers (every process runs it)."""
    shape = {k: getattr(FLAGS, k) for k in ("d_model", "d_ff", "num_experts", "top_k")}
    model = dataclasses.replace(PRESETS[REST_PRESET].model, **shape)
    batch, seq = _REST_BATCH.value, _REST_SEQ.value
    timed = step_rest.rest_seconds(model, batch, seq, FLAGS.repeats)
    return {
        "train": {
            **timed,
            "preset": REST_PRESET,
            "batch_size": batch,
            "seq_len": seq,
            "tokens": batch * seq // jax.device_count(),
            "num_layers": model.num_layers,
            "repeats": FLAGS.repeats,
        }
    }


def main(argv):
    """Starts the pinned rank processes, or (as one of them) measures; the first writes the
    rates with their provenance."""
    if len(argv) > 1:
        fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.num_processes == 1:
        code = launch_pinned_ranks(FLAGS.pinned_ranks, "experiments.bench.rates", sys.argv[1:])
        sys.exit(code)
    keep_freed_memory()  # as the break-even's ranks: time the kernels, not page faults
    start_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    layer = skewed_layer.SkewedLayer(**_LAYER())
    skewed_layer.check_shape(layer, jax.device_count(), one_rank=bool(FLAGS.pinned_ranks))
    cal = concurrency_check(FLAGS.top_k * 8192, FLAGS.d_model, FLAGS.d_ff)
    parts = list(_PARTS.value)
    rates = measure() if "layer" in parts else {}
    if "rest" in parts:
        multihost_utils.sync_global_devices("rates:rest")
        rates["rest"] = {**measure_rest(), "calibration": cal}
    if jax.process_index() == 0:
        print(concurrency_line(cal))
        shape = {k: getattr(FLAGS, k) for k in ("d_model", "d_ff", "num_experts", "top_k")}
        res = {
            "provenance": calibration.provenance("experiments.bench.rates"),
            "shape": {
                **shape,
                "ep_size": jax.device_count(),
                "hot_experts": FLAGS.hot_experts,
                "capacity_factor": FLAGS.capacity_factor,
                "repeats": FLAGS.repeats,
            },
            "calibration": cal,
            **rates,
        }
        path = pathlib.Path(FLAGS.json_out)
        old = json.loads(path.read_text()) if path.exists() else None
        try:
            res = merged(old, res, parts)
        except ValueError as err:
            fail(f"{FLAGS.json_out}: {err}")
        if "rest" in parts:
            print(f"rest of the step: {res['rest']['train']['seconds'] * 1e3:.1f} ms (median)")
        write_json(FLAGS.json_out, res)
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    run_main(main)
