"""The portable planner's time per plan against the C++ core's, in the same run.

    python -m experiments.planner.portable_speed [--batch=64] [--repeats=5] [--calls=300]
        [--profile]

At EP32/E256/S2 and EP64/E256/S2 (rank-level Zipf loads at initial max/mean 2, top-8, 8192 tokens
per rank; the default balancer: F=1024, eps=0.01): the time per plan of `jit(vmap(plan))` over
``--batch`` load matrices, as the README's C++ figure is measured (median of ``--repeats``), and
of one jitted call on one matrix (median of ``--calls``, each waited for); each as a ratio to the
C++ core (`planner="native"`) timed the same way in this run. The plans are checked equal first.

One call is timed twice: as it is, and with both programs also summing the loads ("same
dispatch"). XLA:CPU's client runs a program in the caller's thread when its cost analysis counts
under 1,000 flops, else it hands it to a thread pool and waits: the native planner's custom call
counts none, the portable planner's work thousands, so alone they take different paths, and the
hand-off (tens of us on a loaded machine) is part of the portable planner's one call. With the
sum, both take the thread pool. (Inside a training step the planner is one op of a program that
takes it anyway; on TPU and GPU no such path exists.)

``--profile`` adds, per size, the one-call portable program's compile seconds, what its compiled
HLO holds (outside fusions: while loops, conditionals, copies, dynamic-update-slices, and the
thunks of the entry computation) and the replicas of the first matrix's plan (the attempt loop
runs once per replica where the first attempt succeeds: 20 and 41 at EP32 and EP64, counted once
at run time with a callback in each loop body; experiments/results/portable_speed.txt).
"""

from __future__ import annotations

import collections
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import ultraep_jax as uep
from experiments.lab.loads import workloads
from experiments.lab.walltime import median_seconds

BATCH = flags.DEFINE_integer("batch", 64, "load matrices per batched call")
REPEATS = flags.DEFINE_integer("repeats", 5, "timed batched calls per figure (median)")
CALLS = flags.DEFINE_integer("calls", 300, "timed single calls per figure (median)")
PROFILE = flags.DEFINE_bool("profile", False, "also profile the one-call portable program")
SIZES = ((32, 256, 2), (64, 256, 2))
PLANNERS = ("native", "portable")


def _planner(cfg: uep.BalancerConfig, planner: str, batched: bool, with_sum: bool = False):
    """The jitted planner: over a batch [N, R, E] (vmap) or one matrix [R, E]; ``with_sum``: the
    program also returns the loads' sum (see the module docstring)."""
    one = lambda loads: uep.plan(loads, cfg, planner=planner)  # noqa: E731
    fn = jax.vmap(one) if batched else one
    if with_sum:
        return jax.jit(lambda loads: (fn(loads), jnp.sum(loads)))
    return jax.jit(fn)


def _seconds(fn, loads, repeats: int) -> float:
    """Median seconds of ``fn(loads)``, each call waited for."""
    loads = jax.device_put(loads)
    return median_seconds(lambda: fn(loads), repeats)


def _cell(t: dict) -> str:
    return (
        f"{t['native'] * 1e6:9.1f} {t['portable'] * 1e6:9.1f} {t['portable'] / t['native']:5.1f}x"
    )


def _row(R: int, E: int, S: int, batch) -> str:
    """One size's figures, portable against native: batched, one call, one call same dispatch."""
    cfg = uep.BalancerConfig(E, R, S)
    got = {p: _planner(cfg, p, True)(batch) for p in PLANNERS}
    for name in ("slot_expert", "slot_quota", "master_quota", "rank_load"):
        np.testing.assert_array_equal(getattr(got["portable"], name), getattr(got["native"], name))
    runs = [(True, False, batch, REPEATS.value), (False, False, batch[0], CALLS.value)]
    runs.append((False, True, batch[0], CALLS.value))
    cells = []
    for batched, with_sum, loads, repeats in runs:
        per = len(batch) if batched else 1
        t = {
            p: _seconds(_planner(cfg, p, batched, with_sum), loads, repeats) / per for p in PLANNERS
        }
        cells.append(_cell(t))
    return f"EP{R}/E{E}/S{S}  " + " | ".join(cells)


def _hlo_counts(text: str) -> dict:
    """What a compiled module's text holds outside fusions: while loops, conditionals, copies,
    dynamic-update-slices, its thunks (instructions other than parameters, constants, tuples and
    their elements, bitcasts) in all and in the entry computation, and each while body's."""
    free = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}
    comps, name, entry = {}, None, None
    for line in text.splitlines():
        if line and not line.startswith((" ", "}")):  # a computation's header
            name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            entry = name if line.startswith("ENTRY") else entry
            comps[name] = []
        elif (m := re.search(r" = (?:\(.*?\)|\S+) ([\w-]+)\(", line)) and name:
            comps[name].append((m.group(1), line))
    comps = {k: v for k, v in comps.items() if "fused" not in k and "wrapped_" not in k}
    ops = collections.Counter(op for ins in comps.values() for op, _ in ins)
    thunks = {k: sum(op not in free for op, _ in ins) for k, ins in comps.items()}
    bodies = [
        thunks.get(m.group(1), 0)
        for ins in comps.values()
        for op, line in ins
        if op == "while" and (m := re.search(r"body=(%?[\w.-]+)", line))
    ]
    keys = ("while", "conditional", "copy", "dynamic-update-slice")
    out = {k: ops[k] for k in keys}
    return {**out, "thunks": sum(thunks.values()), "entry": thunks[entry], "bodies": bodies}


def _profile(R: int, E: int, S: int, loads) -> str:
    """The one-call portable program's compile seconds, HLO counts and loop iterations."""
    cfg = uep.BalancerConfig(E, R, S)
    fn = _planner(cfg, "portable", False)
    start = time.perf_counter()
    compiled = fn.lower(jax.ShapeDtypeStruct(loads.shape, loads.dtype)).compile()
    seconds = time.perf_counter() - start
    replicas = int(uep.plan(loads, cfg, planner="native").num_replicas)
    return (
        f"EP{R}/E{E}/S{S}  compile {seconds:.2f} s; HLO {_hlo_counts(compiled.as_text())}; "
        f"{replicas} replicas"
    )


def main(argv):
    del argv
    print(
        f"Time per plan (us) on {jax.devices()[0].device_kind}, median of {REPEATS.value} "
        f"batched calls, of {CALLS.value} single calls:"
    )
    print(
        f"{'':14s}jit(vmap) over {BATCH.value}: native portable ratio | one call: native "
        "portable ratio | one call, same dispatch: native portable ratio"
    )
    for R, E, S in SIZES:
        batch = np.stack(
            [workloads.rank_zipf_loads(R, E, 8192, 8, 2.0, s) for s in range(BATCH.value)]
        )
        print(_row(R, E, S, batch))
        if PROFILE.value:
            print(_profile(R, E, S, batch[0]))


if __name__ == "__main__":
    app.run(main)
