"""The child process of the GPU check's exchange section, one per XLA flag variant
(``python -m experiments.gpu.exchange_child SPEC.json``, started by
`experiments.gpu.exchange_run`): the exchanges timed and checked (`experiments.gpu.exchange`),
and the replica step's compiled schedule (`hlo_schedule`: does the replica transfer run while
the masters' matmuls do?)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from experiments.gpu import hlo_schedule
from experiments.gpu.exchange import (
    AXIS,
    SKIP_RAGGED,
    ExchangeSetup,
    check_gradients,
    compare_arrays,
    exchange_mesh,
    filled_slots,
    random_masters,
    random_split,
    time_tokens,
    time_weights,
)
from experiments.lab.output_files import write_json
from experiments.lab.walltime import median_seconds
from ultraep_jax import tools


def replica_step(mesh, s: ExchangeSetup, backend: str):
    """(jitted step, its arguments): value and gradients (masters, rows) of the mean square of
    the balanced experts on ``s.check_rows`` rows per rank, E_m masters and S filled slots
    (`streaming.experts_with_replicas`, one transfer hop). With this loss the only matmuls that
    do not depend on the forward transfer are the masters' forward ones."""

    R, groups = mesh.size, s.masters + s.slots

    def per_rank(rows, sizes, slots_RS, *masters):
        return tools.experts_with_replicas(
            rows,
            masters,
            slots_RS,
            sizes,
            kernel=s.kernel,
            chunks=1,
            max_fanout=0,
            axis_name=AXIS,
            backend=backend,
        )

    specs = (P(AXIS), P(AXIS), P(), P(AXIS), P(AXIS), P(AXIS))
    experts = jax.shard_map(per_rank, mesh=mesh, in_specs=specs, out_specs=P(AXIS))

    def loss(masters, rows, sizes, slots):
        return jnp.mean(jnp.square(experts(rows, sizes, slots, *masters).astype(jnp.float32)))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    sizes = np.tile(np.diff(np.linspace(0, s.check_rows, groups + 1).astype(np.int64)), R)
    args = (
        random_masters(mesh, s, 30),
        random_split(mesh, (R * s.check_rows, s.d_model), s.dtype, 40),
        jax.device_put(sizes.astype(np.int32)),
        filled_slots(R, s.masters, s.slots),
    )
    return step, args


def check_replica_step(mesh, s: ExchangeSetup, backends, hlo_path: str | None) -> dict:
    """Per backend: the replica step's median ms and where each collective of its compiled
    schedule sits (`hlo_schedule.overlap_report`; the first is the forward transfer); the first
    call's value and gradients of the ragged path against the padded path's."""

    out, first = {}, {}
    for backend in backends:
        step, args = replica_step(mesh, s, backend)
        value, grads = step(*args)  # the first backward: compared before any other call
        first[backend] = [np.asarray(value)] + [np.asarray(g) for g in jax.tree.leaves(grads)]
        text = step.lower(*args).compile().as_text()
        report = hlo_schedule.overlap_report(text)
        row = {"ms": 1e3 * median_seconds(lambda step=step, args=args: step(*args), s.repeats)}
        row["schedule"] = report
        row["verdicts"] = [hlo_schedule.verdict(c) for c in report["collectives"]]
        if hlo_path:
            with open(f"{hlo_path}_{backend}.txt", "w") as f:
                f.write(text)
        out[backend] = row
    if len(first) == 2:
        ragged, padded = first["ragged"], first["padded"]
        rel = [
            float(np.linalg.norm(a.astype(np.float32) - b.astype(np.float32)))
            / max(float(np.linalg.norm(b.astype(np.float32))), 1e-30)
            for a, b in zip(ragged, padded, strict=True)
        ]
        out["first_backward_ragged_vs_padded"] = {
            **compare_arrays(ragged, padded),
            "max_rel_diff": max(rel),
            "ok": max(rel) <= 1e-2 and all(np.all(np.isfinite(a)) for a in ragged),
        }
    return out


def run_variant(spec: dict) -> dict:
    """Everything one flag variant measures (in the child process that XLA_FLAGS configured)."""

    s = ExchangeSetup(**spec["setup"])
    dry = spec["dry"]
    devices = jax.devices("cpu")[:4] if dry else [d for d in jax.devices() if d.platform == "gpu"]
    mesh = exchange_mesh(devices)
    backends = ("padded",) if dry else ("ragged", "padded")
    out = {
        "variant": spec["variant"],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax": jax.__version__,
        "ranks": mesh.size,
        "device_kind": devices[0].device_kind,
        "setup": dataclasses.asdict(s),
    }
    if dry:
        out["ragged"] = SKIP_RAGGED
    parts = {
        "tokens": lambda: time_tokens(mesh, s, backends),
        "weights": lambda: time_weights(mesh, s, backends),
        "grad_check": lambda: check_gradients(mesh, s, dry),
        "replica_step": lambda: check_replica_step(mesh, s, backends, spec.get("hlo_path")),
    }
    for name, part in parts.items():
        try:
            out[name] = part()
        except Exception as e:  # noqa: BLE001 -- reported; the other parts still run
            traceback.print_exc()
            out[name] = {"error": repr(e)[:800]}
        print(f"  exchange[{spec['variant']}] {name}: done", flush=True)
        write_json(spec["out_json"], out)  # what is done so far, should a later part hang
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        run_variant(json.load(f))
