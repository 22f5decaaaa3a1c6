"""The GPU check's MoE section: the layer's forward + backward on one device, balancer off and
on, with a device profile and where the replica-weight path sits in the optimized HLO's schedule
(`hlo_schedule`: each collective, and the matmuls scheduled while it is in flight; at EP=1 the
layer skips the balancer, so the exchange section's replica step is where the transfer shows; see
`experiments.gpu.check`)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import ultraep_jax as uep
from experiments.gpu import hlo_schedule
from experiments.lab.output_files import write_json
from experiments.lab.walltime import median_seconds

_INTERESTING = re.compile(
    r"^(custom-call|all-to-all|ragged-all-to-all|all-gather|all-reduce|collective-permute"
    r"|[a-z\-]+-start|[a-z\-]+-done)$"
)


def schedule_summary(hlo_text: str) -> list[str]:
    """The entry computation's instructions that are kernels we care about (custom calls,
    collectives, async starts/dones), in schedule order, one short line each."""
    lines, in_entry = [], False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY "):
            in_entry = True
            continue
        if in_entry and line.startswith("}"):
            break
        if not in_entry or " = " not in line:
            continue
        op = re.search(r"\s([a-z][a-z\-]*)\(", line.split(" = ", 1)[1])
        if not op or not _INTERESTING.search(op.group(1)):
            continue
        name = line.strip().split(" = ")[0]
        target = re.search(r'custom_call_target="([^"]+)"', line)
        kname = re.search(r'"name":"([^"]+)"|name=\\?"(ultraep_\w+)', line)
        lines.append(
            f"{name}: {op.group(1)}"
            + (f" {target.group(1)}" if target else "")
            + (f" [{next(g for g in kname.groups() if g)}]" if kname else "")
        )
    return lines


def device_profile(fn, calls: int, top: int = 25) -> list[str]:
    """Device time per kernel name over ``calls`` calls of ``fn`` (one warm-up first), from
    JAX's profiler (its Perfetto trace): the ``top`` names by total time, as text lines."""
    import glob
    import gzip
    import tempfile

    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            jax.block_until_ready([fn() for _ in range(calls)])
        paths = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)
        if not paths:
            return ["no perfetto trace written"]
        with gzip.open(paths[0], "rt") as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pname = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    totals: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        proc = pname.get(e.get("pid"), "")
        if "GPU" not in proc and "gpu" not in proc and "device" not in proc.lower():
            continue
        acc = totals.setdefault(e["name"][:90], [0.0, 0])
        acc[0] += float(e["dur"])
        acc[1] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
    total = sum(v[0] for v in totals.values())
    processes = sorted(set(pname.values()))[:6]
    lines = [f"device events total {total / 1e3 / calls:.2f} ms per call ({processes})"]
    lines += [f"{v[0] / 1e3 / calls:9.3f} ms/call {v[1] // calls:5d}x  {k}" for k, v in rows[:top]]
    return lines


@dataclasses.dataclass(frozen=True)
class MoeRows:
    """What the MoE section runs (the ``--moe_*``, ``--repeats``, ``--out``, ``--dump_hlo`` and
    ``--profile`` flags).

    Attributes:
      tokens: tokens per step.
      kernels: one row each: ``expert_kernel``, optionally with ``/comm_backend``.
      repeats: timed steps (the median is reported).
      out_dir: where the balanced step's HLO and the rows so far are written (None: nowhere).
      dump_hlo: summarise (and write) the first row's balanced step's optimized HLO.
      profile: profile the first row's steps (device time per kernel name).
    """

    tokens: int
    kernels: tuple[str, ...]
    repeats: int
    out_dir: str | None
    dump_hlo: bool
    profile: bool


def _layer_step(layer, x):
    """``(step, params)``: the jitted value and gradients of ``mean(layer(x)**2)`` w.r.t. the
    parameters and ``x``."""
    from flax import nnx

    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, x):
        y, _ = nnx.merge(graphdef, params, rest)(x)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params


def _kernel_row(spec: str, first: bool, make_layer, x, rows: MoeRows, out: dict) -> dict:
    """One row: the step balancer off and on with the expert kernel (and comm backend) ``spec``;
    the ``first`` row's profiles and balanced schedule go to ``out``."""
    kernel, _, comm = spec.partition("/")
    comm = comm or "auto"
    row = {"expert_kernel": kernel, "comm_backend": comm}
    for name in ("off", "on"):
        try:
            step, params = _layer_step(make_layer(name == "on", kernel, comm), x)
            value, _ = step(params, x)
            row[f"balancer_{name}_loss_finite"] = bool(np.isfinite(float(value)))
            row[f"balancer_{name}_step_ms"] = 1e3 * median_seconds(
                lambda step=step, params=params: step(params, x), rows.repeats
            )
            if first and rows.profile:
                out[f"profile_balancer_{name}"] = device_profile(
                    lambda step=step, params=params: step(params, x), 3
                )
            if first and name == "on" and rows.dump_hlo:
                text = step.lower(params, x).compile().as_text()
                out["balanced_schedule"] = schedule_summary(text)
                report = hlo_schedule.overlap_report(text)
                out["balanced_overlap"] = [hlo_schedule.verdict(c) for c in report["collectives"]]
                if rows.out_dir:
                    os.makedirs(rows.out_dir, exist_ok=True)
                    with open(os.path.join(rows.out_dir, "moe_balanced_hlo.txt"), "w") as f:
                        f.write(text)
        except Exception as e:  # noqa: BLE001 -- reported, and the other rows still run
            row[f"balancer_{name}_error"] = repr(e)[:600]
            traceback.print_exc()
    if "balancer_on_step_ms" in row and "balancer_off_step_ms" in row:
        row["on_over_off"] = row["balancer_on_step_ms"] / row["balancer_off_step_ms"]
    return row


def section_moe(device, dry: bool, rows: MoeRows) -> dict:
    """(d) the MoE layer's forward + backward on one device (EP = 1 mesh), balancer off and on,
    for each of ``rows.kernels``: median step ms and their ratio, the first row's device profile
    and where its balanced step's replica-weight path sits in the schedule. ``dry``: tiny float32
    shapes, ``auto`` only, no profile."""
    from flax import nnx
    from jax.sharding import Mesh

    if dry:
        rows = dataclasses.replace(rows, tokens=64, kernels=("auto",), repeats=2, profile=False)
    D, F, E, k = (16, 32, 4, 2) if dry else (2048, 1408, 16, 4)
    seq = 32 if dry else 1024
    dt = jnp.float32 if dry else jnp.bfloat16
    mesh = Mesh(np.array([device]), ("expert",))
    shape = (rows.tokens // seq, seq, D)
    x = jax.device_put(jax.random.normal(jax.random.key(0), shape, dt), device)
    layer_shape = {"d_model": D, "d_ff": F, "num_experts": E, "top_k": k}
    balancer = uep.BalancerConfig(E, 1, 2, min_tokens_per_replica=16, min_tokens_per_rank=0)

    def make_layer(balanced: bool, kernel: str, comm: str):
        return uep.MoE(
            **layer_shape,
            mesh=mesh,
            balancer=balancer if balanced else None,
            capacity_factor=None,
            param_dtype=dt,
            expert_kernel=kernel,
            comm_backend=comm,
            rngs=nnx.Rngs(0),
        )

    setup = {"d_model": D, "d_ff": F, "experts": E, "top_k": k, "tokens": rows.tokens}
    out = {"setup": {**setup, "dtype": jnp.dtype(dt).name}, "rows": []}
    for i, spec in enumerate(rows.kernels):
        row = _kernel_row(spec, i == 0, make_layer, x, rows, out)
        out["rows"].append(row)
        print(f"  moe {row}", flush=True)
        if rows.out_dir:  # rows so far, in case a later row runs past a time limit
            write_json(os.path.join(rows.out_dir, "moe_partial.json"), out)
    return out


def moe_lines(d: dict) -> list[str]:
    """The MoE section's results as table lines."""
    lines = [f"(d) MoE fwd+bwd, EP=1, {d['setup']}:"]
    lines += [f"      {row}" for row in d["rows"]]
    for key in ("profile_balancer_off", "profile_balancer_on"):
        if d.get(key):
            lines.append(f"      {key} (first row's kernel):")
            lines += [f"        {s}" for s in d[key]]
    if "balanced_overlap" in d:
        lines.append("      balanced step, each collective against the matmuls (hlo_schedule):")
        overlap = d["balanced_overlap"] or [
            "no collective in the schedule (at EP=1 the layer runs no balancer and exchanges "
            "nothing: the exchange section's replica step shows the transfer)"
        ]
        lines += [f"        {s}" for s in overlap]
    if d.get("balanced_schedule"):
        lines.append("      balanced step, scheduled entry computation (kernels, collectives):")
        lines += [f"        {s}" for s in d["balanced_schedule"][:80]]
    return lines
