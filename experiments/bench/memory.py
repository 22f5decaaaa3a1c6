r"""Memory per device of the MoE layer's training step at DeepSeek-V3's shape, compiled, never run.

    python -m experiments.bench.memory          # DeepSeek-V3's layer, 4096 tokens/rank, bf16
    python -m experiments.bench.memory --ep_sizes=8 --modes=balanced,ideal --d_model=1792
    python -m experiments.bench.memory --json_out=experiments/results/memory.json \
        --table_out=experiments/results/memory.txt
    JAX_PLATFORMS=cpu python -m experiments.bench.memory --target=h100 --ep_sizes=8,64 \
        --expert_kernel=ragged_dot           # XLA:GPU for 8 and 8 x 8 H100s, no GPU needed

For each EP size R (R simulated CPU devices: the program asks XLA's host platform for the largest
R before JAX starts its backend; with ``--target=h100`` or ``h200``, R compile-only GPUs of that
kind from the CUDA plugin, one node of R up to 8, else R / 8 nodes of 8: XLA:GPU's compiler on
this host, `ultraep_jax.tools.compile_only_mesh`) and each layer below, jits the training step of
one `uep.MoE`
call (the loss mean(y^2) with its gradient w.r.t. x and every parameter), lowers and compiles it
for abstract inputs (`jax.ShapeDtypeStruct`s with the layer's shardings, the layer made by
`nnx.eval_shape`: nothing is allocated and nothing runs), and reads XLA's memory analysis of the
compiled program, per device: temporaries, arguments, outputs, generated code. Layers (`MODES`):

  balanced  the default `BalancerConfig` (always balancing), receive buffers of
            --balanced_factor (1.05) x the pairs a rank routes
  balanced_dropless  the same balancer with ``capacity_factor=None``: R x the pairs
  dropless  plain EP, no balancer, ``capacity_factor=None``: R x the pairs, nothing dropped
            whatever the routing
  plain     plain EP at --plain_factor (1.25) x the pairs (drops past them)
  ideal     the force-balanced ideal (``balancer=None, force_balanced=True``) at
            --balanced_factor, the buffer a perfect balancer costing nothing would need

A compiled program has static shapes, so the routing does not matter here; the buffers the layer
sizes do. The receive buffer per rank is `MoE.capacity` rows x D x the dtype's bytes
(`receive_buffer_bytes`); the table gives its share of the temporaries, and each layer's
temporaries and peak over the ideal's. On CPU the token exchange
is the portable fixed-size all-to-all (XLA:CPU cannot compile ``ragged_all_to_all``), whose
blocks hold R x min(pairs, capacity) rows (`exchange_block_bytes`) in every layer; a GPU's
``ragged_all_to_all`` has no such block (the GPU targets' rows give 0). The CPU figures are
XLA:CPU's program: its dtype handling and the CPU expert kernel hold float32 copies a GPU's
program may not, so compare the layers with each other, not with a GPU's bytes; the GPU targets'
are XLA:GPU's buffer assignment for those GPUs (without autotuning: no GPU to time on).

Prints the table and writes ``--json_out`` (default runs/memory/memory.json) with the
provenance (machine, commit, command, date) and, with ``--table_out``, the table as text.
"""

from __future__ import annotations

import dataclasses
import pathlib
import resource
import time

import jax
import jax.numpy as jnp
from absl import flags
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from experiments.bench.memory_config import MemoryConfig, check_ep_size
from experiments.bench.memory_report import per_buffer_row, table
from experiments.lab import cli, dataclass_flags
from experiments.lab.devices import force_cpu_devices, host_for_compile_only_gpus
from experiments.lab.output_files import check_output_path, write_json
from experiments.lab.program import fail, run_main
from experiments.lab.stepmodel.calibration import provenance
from ultraep_jax import tools

#: The layers compiled, by name, in the table's order.
MODES = ("balanced", "balanced_dropless", "dropless", "plain", "ideal")
#: The EP sizes of the default sweep.
EP_SIZES = (8, 16, 32, 64)
#: Where the program writes its JSON by default (the committed one only when the flag names it).
JSON_OUT = f"{cli.run_folder('memory')}/memory.json"
#: XLA's memory analysis fields read, by the name the record gives them.
FIELDS = {
    "temp_bytes": "temp_size_in_bytes",
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "generated_code_bytes": "generated_code_size_in_bytes",
    "peak_bytes": "peak_memory_in_bytes",
}


def layer_options(config: MemoryConfig, mode: str, ep_size: int) -> dict:
    """The `uep.MoE` keywords that make ``mode`` (`MODES`) at ``ep_size``: balancer, capacity
    factor and the ideal's switch (the expert kernel: `abstract_layer`)."""
    if mode in ("balanced", "balanced_dropless"):
        # min_tokens_per_rank=0: balance at any batch, as the benchmarks measuring balancing do.
        balancer = uep.BalancerConfig(
            num_experts=config.num_experts,
            ep_size=ep_size,
            slots_per_rank=config.slots_per_rank,
            min_tokens_per_rank=0,
        )
        factor = config.balanced_factor if mode == "balanced" else None
        return {"balancer": balancer, "capacity_factor": factor}
    if mode == "dropless":
        return {"balancer": None, "capacity_factor": None}
    if mode == "plain":
        return {"balancer": None, "capacity_factor": config.plain_factor}
    if mode == "ideal":
        return {"balancer": None, "capacity_factor": config.balanced_factor, "force_balanced": True}
    raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")


def abstract_layer(config: MemoryConfig, mode: str, mesh) -> uep.MoE:
    """``mode``'s layer on ``mesh`` with abstract parameters (`nnx.eval_shape`: none allocated)."""
    dtype = jnp.dtype(config.dtype)
    shape = (config.d_model, config.d_ff, config.num_experts, config.top_k)
    options = layer_options(config, mode, mesh.size) | {"expert_kernel": config.expert_kernel}
    return nnx.eval_shape(
        lambda: uep.MoE(*shape, mesh, param_dtype=dtype, rngs=nnx.Rngs(0), **options)
    )


def _with_shardings(layer: uep.MoE, state):
    """``state``'s leaves as `jax.ShapeDtypeStruct`s on the layer's shardings: the experts'
    weights split over the EP axis (`ExpertParallel.weight_shardings`), every other variable
    replicated, as `MoE` places them."""
    split = dict(zip(("w_gate", "w_up", "w_down"), layer.ep.weight_shardings, strict=True))
    replicated = NamedSharding(layer.mesh, P())

    def typed(path, leaf):
        sharding = split.get(str(getattr(path[0], "key", path[0])), replicated)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(typed, state)


def training_step(layer: uep.MoE):
    """(jitted step(params, rest, x) -> ((loss, stats), (d params, d x)), params, rest): the
    layer's training step, its parameters and other state split off as abstract arrays."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, rest, x):
        y, stats = nnx.merge(graphdef, params, rest)(x)
        return jnp.mean(jnp.square(y), dtype=jnp.float32), stats

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True))
    return step, _with_shardings(layer, params), _with_shardings(layer, rest)


def receive_buffer_bytes(config: MemoryConfig, capacity_rows: int) -> int:
    """Bytes of one rank's receive buffer: ``capacity_rows`` (`MoE.capacity`) x D x the dtype's
    bytes."""
    return capacity_rows * config.d_model * config.itemsize


def exchange_block_bytes(config: MemoryConfig, ep_size: int, capacity_rows: int) -> int:
    """Bytes of one block of the portable (CPU) token exchange: R x min(pairs, capacity) rows of D
    (`comm.padded` moves ``R * max_chunk`` rows; the dispatch bounds its chunk by both); 0 on a
    GPU target, whose exchange ("auto": ``ragged_all_to_all``) has no block."""
    if config.target != "cpu":
        return 0
    return ep_size * min(config.pairs_per_rank, capacity_rows) * config.d_model * config.itemsize


def replica_block_bytes(config: MemoryConfig, ep_size: int, mode: str) -> int:
    """Bytes of one block of the balanced layer's replica weight transfer: R x S rows of one
    expert's weights (3 x D x F) (`replicas.transfer`'s hops build their operand of ``R * S``
    rows); 0 for the other layers (no replicas)."""
    if mode != "balanced":
        return 0
    expert = 3 * config.d_model * config.d_ff * config.itemsize
    return ep_size * config.slots_per_rank * expert


def measure(config: MemoryConfig, mode: str, mesh) -> dict:
    """XLA's memory analysis per device of ``mode``'s training step on ``mesh`` (one axis,
    "expert"), compiled for abstract inputs, with the layer's buffer sizes.

    Returns a dict: ``temp_bytes``, ``argument_bytes``, ``output_bytes``, ``alias_bytes``,
    ``generated_code_bytes``, ``peak_bytes`` (`FIELDS`), ``capacity_rows``,
    ``receive_buffer_bytes``, ``receive_share`` (of the temporaries), ``exchange_block_bytes``,
    ``replica_block_bytes``, ``compile_s``.

    Raises:
      ValueError: one line when the EP size does not divide E or XLA gives no analysis.
    """
    R = mesh.size
    check_ep_size(config, R)
    layer = abstract_layer(config, mode, mesh)
    step, params, rest = training_step(layer)
    T, D = config.tokens_per_rank, config.d_model
    x = jax.ShapeDtypeStruct(
        (R, T, D), jnp.dtype(config.dtype), sharding=NamedSharding(mesh, P(mesh.axis_names[0]))
    )
    start = time.perf_counter()
    analysis = step.lower(params, rest, x).compile().memory_analysis()
    compile_s = time.perf_counter() - start
    if analysis is None:
        raise ValueError(f"XLA gave no memory analysis for {mode} at EP{R}")
    out = {name: int(getattr(analysis, field)) for name, field in FIELDS.items()}
    capacity = layer.capacity(T)
    receive = receive_buffer_bytes(config, capacity)
    out.update(
        capacity_rows=capacity,
        receive_buffer_bytes=receive,
        receive_share=receive / out["temp_bytes"],
        exchange_block_bytes=exchange_block_bytes(config, R, capacity),
        replica_block_bytes=replica_block_bytes(config, R, mode),
        compile_s=compile_s,
    )
    return out


def expert_mesh(ep_size: int, config: MemoryConfig | None = None):
    """A mesh ("expert",) of the first ``ep_size`` devices, its axis in Auto mode (the layer
    splits the work with shard_map itself): this process's (CPU) devices, or with a GPU
    ``config.target`` that many compile-only GPUs of its kind (`tools.compile_only_mesh`)."""
    if config is not None and config.device_kind is not None:
        return tools.compile_only_mesh(ep_size, 1, config.device_kind, axis_types=(AxisType.Auto,))
    devices = jax.devices()
    if len(devices) < ep_size:
        raise ValueError(f"EP{ep_size} needs {ep_size} devices, found {len(devices)}")
    return jax.make_mesh(
        (ep_size,), ("expert",), axis_types=(AxisType.Auto,), devices=devices[:ep_size]
    )


def sweep(config: MemoryConfig, ep_sizes, modes, report=print) -> list[dict]:
    """One row per (EP size, mode): ``ep_size``, ``mode`` and `measure`'s fields, with
    ``temp_vs_ideal`` and ``peak_vs_ideal`` where the ideal was compiled at that EP size;
    ``report`` gets a line per compile."""
    rows = []
    for ep_size in ep_sizes:
        mesh = expert_mesh(ep_size, config)
        at_r = []
        for mode in modes:
            row = {"ep_size": ep_size, "mode": mode, **measure(config, mode, mesh)}
            at_r.append(row)
            report(
                f"EP{ep_size} {mode}: temporaries {row['temp_bytes'] / 2**30:.2f} GiB, peak "
                f"{row['peak_bytes'] / 2**30:.2f} GiB (compiled in {row['compile_s']:.1f} s)"
            )
        ideal = next((r for r in at_r if r["mode"] == "ideal"), None)
        for row in at_r:
            for name in ("temp", "peak"):
                ratio = row[f"{name}_bytes"] / ideal[f"{name}_bytes"] if ideal else None
                row[f"{name}_vs_ideal"] = ratio
        rows += at_r
    return rows


def main(argv):
    """Compiles every (EP size, mode), prints the table, writes the JSON (and the text)."""
    if len(argv) > 1:
        fail(f"unexpected arguments: {' '.join(argv[1:])}")
    f = flags.FLAGS
    try:
        config = MemoryConfig(**_CONFIG())
        ep_sizes = [int(e) for e in f.ep_sizes]
        for ep_size in ep_sizes:
            check_ep_size(config, ep_size)
        if f.json_out:
            check_output_path(f.json_out, "--json_out")
        if f.table_out:
            check_output_path(f.table_out, "--table_out")
        if config.target == "cpu":
            force_cpu_devices(max(ep_sizes), cpu_only=True)
        else:
            host_for_compile_only_gpus()
        rows = sweep(config, ep_sizes, list(f.modes), report=lambda s: print(s, flush=True))
    except ValueError as err:
        fail(err)
    lines = table(rows, config)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    lines.append(f"(this process's peak resident memory while compiling: {peak_mib:,.0f} MiB)")
    print("\n" + "\n".join(lines))
    record = {
        "provenance": provenance("experiments.bench.memory"),
        "config": dataclasses.asdict(config),
        "device_kind": config.device_kind,
        "topologies": {
            str(r): tools.topology_name(r) for r in ep_sizes if config.device_kind is not None
        },
        "ep_sizes": ep_sizes,
        "modes": list(f.modes),
        "rows": rows,
        "temp_per_buffer_row": {str(r): s for r, s in per_buffer_row(rows, config).items()},
        "peak_rss_mib": peak_mib,
    }
    write_json(f.json_out, record)
    if f.table_out:
        path = pathlib.Path(f.table_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
    written = [path for path in (f.json_out, f.table_out) if path]
    if written:
        print(f"wrote {' and '.join(written)}")


def _define_flags():
    """The program's flags (defined when it runs, not on import: tests import this module beside
    programs with flags of the same names)."""
    global _CONFIG
    _CONFIG = dataclass_flags.define_flags(MemoryConfig)
    flags.DEFINE_list("ep_sizes", [str(r) for r in EP_SIZES], "EP sizes R to compile for.")
    flags.DEFINE_list("modes", list(MODES), f"Layers to compile: some of {', '.join(MODES)}.")
    flags.DEFINE_string("json_out", JSON_OUT, "The rows as JSON ('' for none).")
    flags.DEFINE_string("table_out", "", "Also write the table here as text ('' for none).")
    flags.register_validator(
        "ep_sizes", lambda v: bool(v) and all(e.isdigit() and int(e) > 0 for e in v),
        "must be positive integers",
    )  # fmt: skip
    flags.register_validator(
        "modes", lambda v: bool(v) and set(v) <= set(MODES), f"must name some of {MODES}"
    )


if __name__ == "__main__":
    _define_flags()
    run_main(main)
