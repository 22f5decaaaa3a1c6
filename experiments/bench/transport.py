r"""The replica transfer on pinned ranks: how much of it is this machine's transport.

    python -m experiments.bench.transport        # bench.step's layer shape: D=128 F=512, EP=2
    python -m experiments.bench.transport --d_model=64 --d_ff=128 --repeats=5

The whole training step (`experiments.bench.step`) pays, per MoE layer, the replica transfer
and its gradient: on CPU a reduce-scatter of the slot's weights forward and its transpose, an
all-gather, backward, with the row selections and scatter-adds around them
(`replicas.transfer`). On 2 pinned ranks joined by gloo (``--pinned_ranks``, one core each),
this times, medians of ``--repeats`` calls, each forward + backward:

  transfer     `tools.fetch_replica_experts` of one replica (rank 0's first expert on rank 1),
               the layer's own transfer, with its gradient back to the masters
  collectives  the same reduce-scatter and all-gather alone, on the same bytes (R rows of one
               expert's weights, P = 3 x D x F floats): the transport
  link         one all-gather of ``--link_mib`` MiB per rank alone: the bytes per second gloo
               moves between two pinned processes here, without the fixed cost per call

and prints each, the share of the transfer that is the collectives, and the collectives' time
per step for ``--layers`` layers, to set against the transfer term of `bench.step`'s profile.
"""

from __future__ import annotations

from experiments.lab.concurrency import concurrency_check, concurrency_line
from experiments.lab.devices import force_cpu_devices
from experiments.lab.output_files import write_json
from experiments.lab.pinned_ranks import keep_freed_memory, launch_pinned_ranks, start_distributed
from experiments.lab.program import fail, run_main

force_cpu_devices(1, cpu_only=True)  # one CPU device per pinned rank

import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.lab import cli
from experiments.lab.walltime import median_seconds
from ultraep_jax import tools

_D = flags.DEFINE_integer("d_model", 128, "Token width D (bench.step's moe_heavy preset).")
_F = flags.DEFINE_integer("d_ff", 512, "Expert hidden width F.")
_EM = flags.DEFINE_integer("experts_per_rank", 4, "Master experts per rank.")
_LAYERS = flags.DEFINE_integer("layers", 2, "MoE layers per step (moe_heavy: 2).")
_LINK_MIB = flags.DEFINE_float("link_mib", 16.0, "MiB per rank of the link-rate all-gather.")
_REPEATS = flags.DEFINE_integer("repeats", 31, "Timed calls per measurement (medians).")
_RANKS = flags.DEFINE_integer("pinned_ranks", 2, "Pinned rank processes (EP size).")
_VERBOSE = cli.define_verbose_ranks()
_JSON = cli.define_json_out()
_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID = cli.define_rank_flags()

AXIS = "x"


def _grad_fn(mesh, forward, num_args: int):
    """jit(shard_map(grad of sum(forward(*args)^2) w.r.t. the first argument))."""
    spec = P(AXIS)

    def loss(*args):
        return jnp.sum(jnp.square(forward(*args)))

    body = jax.grad(loss)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * num_args, out_specs=spec))


def transfer_fn(mesh, slot_expert_RS: np.ndarray):
    """Forward + backward of the layer's replica transfer (`tools.fetch_replica_experts`, the
    CPU backend) of the masters (w_gate, w_up, w_down) into the plan's slots."""
    slots = jnp.asarray(slot_expert_RS)

    def forward(w_gate, w_up, w_down):
        got = tools.fetch_replica_experts(
            (w_gate, w_up, w_down), slots, axis_name=AXIS, backend="padded"
        )
        return jnp.concatenate([g.reshape(g.shape[0], -1) for g in got], axis=1)

    return _grad_fn(mesh, forward, 3)


def collectives_fn(mesh):
    """Forward + backward of the transfer's collectives alone: a reduce-scatter of [R, P] rows
    (each rank one row per peer) whose transpose is an all-gather."""

    def forward(rows_RP):
        return jax.lax.psum_scatter(rows_RP, AXIS, scatter_dimension=0, tiled=True)

    return _grad_fn(mesh, forward, 1)


def link_fn(mesh):
    """One all-gather of each rank's block (the link's rate at a large size)."""
    spec = P(AXIS)

    def gather(block):
        return jax.lax.all_gather(block, AXIS, tiled=True)

    return jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=spec, out_specs=spec))


def measure() -> dict:
    """The three timings (seconds, medians) and the bytes they move."""
    D, F, em, R = _D.value, _F.value, _EM.value, jax.device_count()
    mesh = jax.make_mesh((R,), (AXIS,), axis_types=(AxisType.Explicit,))
    sharding = NamedSharding(mesh, P(AXIS))
    rng = np.random.default_rng(0)

    def put(shape):
        return jax.device_put(rng.normal(size=shape).astype(np.float32), sharding)

    weights = [put((R * em, D, F)), put((R * em, D, F)), put((R * em, F, D))]
    slot_expert = np.full((R, 2), -1, np.int32)
    slot_expert[1, 0] = 0  # rank 0's first expert on rank 1: one replica, as bench.step's
    transfer = transfer_fn(mesh, slot_expert)
    expert_floats = 3 * D * F
    rows = put((R * R, expert_floats))
    collectives = collectives_fn(mesh)
    link_floats = int(_LINK_MIB.value * 2**20 / 4)
    block = put((R * link_floats,))
    link = link_fn(mesh)
    repeats = _REPEATS.value
    return {
        "transfer_s": median_seconds(lambda: transfer(*weights), repeats),
        "collectives_s": median_seconds(lambda: collectives(rows), repeats),
        "link_s": median_seconds(lambda: link(block), repeats),
        "expert_bytes": expert_floats * 4,
        "link_bytes": link_floats * 4,
    }


def report(res: dict) -> list[str]:
    """The readable lines of ``res`` (`measure`'s, with the calibration)."""
    t, c, link = res["transfer_s"], res["collectives_s"], res["link_s"]
    # An all-gather of R blocks moves (R - 1) blocks into every rank.
    rate = (res["ranks"] - 1) * res["link_bytes"] / link
    layers = res["layers"]
    return [
        concurrency_line(res["calibration"]),
        f"one replica of {res['expert_bytes'] / 1e6:.2f} MB (D={res['d_model']} "
        f"F={res['d_ff']}, float32), forward + backward, medians of {res['repeats']}:",
        f"  transfer (the layer's, with its gathers and scatter-adds)  {t * 1e3:7.2f} ms",
        f"  its collectives alone (reduce-scatter + all-gather)        {c * 1e3:7.2f} ms"
        f"   ({c / t:.0%} of the transfer)",
        f"  link: all-gather of {res['link_bytes'] / 2**20:.0f} MiB per rank "
        f"{link * 1e3:7.2f} ms   ({rate / 1e9:.2f} GB/s into each rank)",
        f"per step of {layers} layers: transfer {layers * t * 1e3:.2f} ms, of which transport "
        f"{layers * c * 1e3:.2f} ms",
    ]


def main(argv):
    """Starts the pinned rank processes, or (as one of them) measures; the first prints and
    writes ``--json_out``."""
    if len(argv) > 1:
        fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if _NUM_PROCESSES.value == 1:
        try:
            code = launch_pinned_ranks(
                _RANKS.value, "experiments.bench.transport", sys.argv[1:], _VERBOSE.value
            )
        except ValueError as err:  # more ranks than cores
            fail(err)
        sys.exit(code)
    keep_freed_memory()
    start_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    # The rows of bench.step's layers per rank: top-2 of 2048 tokens.
    calibration = concurrency_check(2 * 2048, _D.value, _F.value)
    res = measure()
    if jax.process_index() == 0:
        res.update(
            calibration=calibration,
            ranks=jax.device_count(),
            layers=_LAYERS.value,
            repeats=_REPEATS.value,
            d_model=_D.value,
            d_ff=_F.value,
        )
        print("\n".join(report(res)))
        if _JSON.value:
            write_json(_JSON.value, res)


if __name__ == "__main__":
    run_main(main)
