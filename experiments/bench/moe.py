r"""MoE layer benchmark: the cost of balancing and its win, on CPU devices.

        python -m experiments.bench.moe                      # 8 simulated devices, one process
        python -m experiments.bench.moe --pinned_ranks=2     # EP=2 as two pinned processes
        python -m experiments.bench.moe --pinned_ranks=2 --d_model=128 --d_ff=512 \
            --num_experts=8 --tokens_per_device=2048 --mode=prefill --json_out=moe.json

On mesh (R,) "expert" with a skewed router (a few hot experts take most tokens), five layers:
plain EP and balanced, each with dropless worst-case receive buffers (R x the pairs a rank routes)
and with buffers of ``--capacity_factor`` x those pairs, and the force-balanced ideal in the
latter (the router's pairs spread evenly over the experts, no planner, no replicas: what a free,
perfect balancer would cost, so ideal / plain dropless is the floor of balanced / plain
dropless on this machine). For each: compile time, step time
(``--mode=train``: forward+backward, the gradient w.r.t. x and every parameter; ``prefill``:
forward only; the five compiled steps run interleaved, ``--repeats`` rounds, medians, so that a
busy machine slows them alike), buffer rows, dropped pairs, per-rank load before and after
balancing, and the ratios between them.

Two ways to run the ranks. By default 8 simulated devices in one process share the host's cores,
so step times measure the total work of all ranks, not the busiest one. ``--pinned_ranks=N``
starts N processes (one command), one CPU device each, each pinned to a core of its own and
joined by gloo collectives: there the wall clock is the busiest rank's, as on real hardware, and
a calibration line (the ranks with equal work at once / one rank alone) says how close it is.
The hot experts sit on ranks 0, 1, ... (one each) with simulated devices, and all on rank 0 with
pinned ranks (two ranks with one hot expert each would be balanced already).
"""

from __future__ import annotations

from experiments.lab.concurrency import concurrency_check, concurrency_line
from experiments.lab.devices import force_cpu_devices
from experiments.lab.output_files import write_json
from experiments.lab.pinned_ranks import keep_freed_memory, launch_pinned_ranks, start_distributed
from experiments.lab.program import fail, run_main

force_cpu_devices(8, cpu_only=True)  # before JAX starts a backend (pinned ranks: 1 each)

import math
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from experiments.lab import cli
from experiments.lab.loads import ranks

_D = flags.DEFINE_integer("d_model", 64, "Token width D.")
_F = flags.DEFINE_integer("d_ff", 128, "Expert hidden width F.")
_E = flags.DEFINE_integer("num_experts", 16, "Experts E (divisible by the EP size).")
_K = flags.DEFINE_integer("top_k", 2, "Experts per token.")
_BALANCER = cli.define_balancer_flags(min_tokens_per_replica=16)
_TOKENS = flags.DEFINE_integer("tokens_per_device", 256, "Tokens on each device.")
_SEQ = flags.DEFINE_integer("seq_len", 64, "Sequence length (must divide tokens_per_device).")
_HOT = flags.DEFINE_integer("hot_experts", 2, "Experts the skewed router favours.")
_SKEW = flags.DEFINE_float("skew", 2.0, "Router bias strength toward the hot experts.")
_CF = cli.define_capped_capacity_factor(
    1.05, "Receive buffer of the capped layers, as a multiple of the pairs a rank routes."
)
_MODE = flags.DEFINE_enum(
    "mode", "train", ["train", "prefill"], "train: forward+backward; prefill: forward only."
)
_REPEATS = flags.DEFINE_integer("repeats", 15, "Timed rounds (medians are reported).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the inputs and parameters.")
_JSON = cli.define_json_out()
_PINNED = flags.DEFINE_integer(
    "pinned_ranks",
    0,
    "EP ranks as this many processes, each pinned to its own core with one CPU device and at "
    "real-time priority where the system allows it (the wall clock is then the busiest rank's); "
    "0: 8 simulated devices in this process.",
)
_VERBOSE_RANKS = cli.define_verbose_ranks()
_MALLOC = flags.DEFINE_enum(
    "malloc",
    "auto",
    ["auto", "keep", "system"],
    "keep: glibc keeps freed memory (keep_freed_memory) so that XLA:CPU's per-call "
    "buffers do not page-fault in again on every call; system: glibc's defaults; auto: keep in "
    "pinned rank processes, system otherwise.",
)
_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID = cli.define_rank_flags()

flags.register_validator("num_experts", lambda e: e > 0, "must be > 0")
flags.register_validator("hot_experts", lambda n: n >= 0, "must be >= 0")
flags.register_multi_flags_validator(
    ["seq_len", "tokens_per_device"],
    lambda v: v["seq_len"] > 0 and v["tokens_per_device"] % v["seq_len"] == 0,
    "--seq_len must divide --tokens_per_device",
)


def _layer_shape() -> dict:
    """The flags' layer shape, as ``uep.MoE`` keyword arguments."""
    return {"d_model": _D.value, "d_ff": _F.value, "num_experts": _E.value, "top_k": _K.value}


def hot_experts(num_experts: int, ep_size: int, count: int, one_rank: bool) -> np.ndarray:
    """The experts the skewed router favours: the first ``count`` of rank 0 (``one_rank``), or
    the first expert of each of ranks 0..count-1."""
    if one_rank:
        return np.arange(count)
    return ranks.masters_of_ranks(num_experts, ep_size)[:count, 0]


def _skewed_inputs(mesh, rng, one_rank: bool):
    """x [batch, seq, D] (batch split over the mesh) and a router kernel [D, E] that sends most
    tokens to the hot experts (x shares a direction u their columns align with)."""
    D, E = _D.value, _E.value
    batch = mesh.size * _TOKENS.value // _SEQ.value
    u = rng.normal(size=D)
    u /= np.linalg.norm(u)
    x = rng.normal(size=(batch, _SEQ.value, D)) + 2.0 * u
    router = rng.normal(size=(D, E)) * (2.0 / math.sqrt(D))  # logits of std ~2
    hot = hot_experts(E, mesh.size, _HOT.value, one_rank)
    router[:, hot] += _SKEW.value * u[:, None]
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    x = x.astype(np.float32)
    # Every process makes the same x and places the rows of its own devices.
    x = jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return x, router.astype(np.float32)


def _build(mesh, balancer, router, capacity_factor, force_balanced=False):
    """The layer with the skewed router written in."""
    layer = uep.MoE(
        **_layer_shape(),
        mesh=mesh,
        balancer=balancer,
        capacity_factor=capacity_factor,
        force_balanced=force_balanced,
        rngs=nnx.Rngs(_SEED.value),
    )
    old = layer.router_kernel[...]
    layer.router_kernel[...] = jax.make_array_from_callback(
        router.shape, old.sharding, lambda index: router[index]
    )
    return layer


def _step(layer, mode: str):
    """(jitted step(params, rest, x), params, rest): forward+backward (``train``: the loss, the
    stats and the gradient w.r.t. the parameters and x) or forward only (``prefill``: y and the
    stats)."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, rest, x):
        y, stats = nnx.merge(graphdef, params, rest)(x)
        return jnp.mean(jnp.square(y)), stats

    def forward(params, rest, x):
        y, stats = nnx.merge(graphdef, params, rest)(x)
        return y, stats

    if mode == "train":
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True)), params, rest
    return jax.jit(forward), params, rest


def _stats_of(out, mode: str):
    return out[0][1] if mode == "train" else out[1]


def _compile(layer, x, mode: str) -> dict:
    """The layer's compiled step, its compile time and the stats of one step."""
    step, params, rest = _step(layer, mode)
    start = time.perf_counter()
    compiled = step.lower(params, rest, x).compile()
    compile_s = time.perf_counter() - start
    stats = _stats_of(jax.block_until_ready(compiled(params, rest, x)), mode)  # warm-up
    memory = compiled.memory_analysis()
    return {
        "run": lambda: compiled(params, rest, x),
        "compile_s": compile_s,
        # XLA:CPU allocates this block afresh on every call (one per device's program).
        "temp_mib": memory.temp_size_in_bytes / 2**20 if memory is not None else None,
        "buffer_rows": layer.capacity(_TOKENS.value),
        "rank_load_before": np.asarray(stats.rank_load_before).tolist(),
        "rank_load_after": np.asarray(stats.rank_load_after).tolist(),
        "dropped": int(stats.dropped),
        "replicas": int(stats.replicas),
        "imbalance_before": float(stats.imbalance_before),
        "imbalance_after": float(stats.imbalance_after),
    }


def _time_interleaved(layers: dict, repeats: int) -> None:
    """Adds ``step_ms`` (median), ``step_ms_min`` and ``minor_faults`` (this process's minor page
    faults per step, mean; unlike the clock, other load on the machine does not change them) to
    each entry, timing one step of each layer per round."""
    times = {name: [] for name in layers}
    faults = dict.fromkeys(layers, 0)
    for _ in range(repeats):
        for name, r in layers.items():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            jax.block_until_ready(r["run"]())
            times[name].append(time.perf_counter() - start)
            faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    for name, r in layers.items():
        r["step_ms"] = float(np.median(times[name])) * 1e3
        r["step_ms_min"] = float(np.min(times[name])) * 1e3
        r["minor_faults"] = faults[name] / repeats


NAMES = {
    "plain_dropless": "plain EP, dropless",
    "plain_capped": "plain EP, capped",
    "balanced_capped": "balanced, capped",
    "balanced_dropless": "balanced, dropless",
    "ideal_capped": "ideal, capped",
}


def _print_report(res: dict) -> None:
    """The readable tables."""
    cfg, runs = res["config"], res["runs"]
    ranks = (
        f"{cfg['ep_size']} pinned processes x 1 {cfg['device']}"
        if cfg["pinned_ranks"]
        else f"{cfg['devices']} simulated {cfg['device']} devices in one process"
    )
    print(
        f"MoE layer, {cfg['mode']}, EP={cfg['ep_size']} on {ranks}: D={cfg['d_model']} "
        f"F={cfg['d_ff']} E={cfg['num_experts']} top-{cfg['top_k']} S={cfg['slots_per_rank']} "
        f"tokens/device={cfg['tokens_per_device']}, capped = capacity factor "
        f"{cfg['capacity_factor']}, skewed router ({cfg['hot_experts']} hot experts, bias "
        f"{cfg['skew']}), {cfg['repeats']} interleaved rounds"
    )
    if "calibration" in res:
        print(concurrency_line(res["calibration"]))
    print(
        f"\n{'':>20} {'buffer rows':>11} {'dropped':>8} {'compile s':>10} {'step ms':>9} "
        f"{'(min)':>8} {'temp MiB':>9} {'faults/step':>12}"
    )
    for key, name in NAMES.items():
        r = runs[key]
        temp = "n/a" if r["temp_mib"] is None else f"{r['temp_mib']:.2f}"
        print(
            f"{name:>20} {r['buffer_rows']:11d} {r['dropped']:8d} {r['compile_s']:10.2f} "
            f"{r['step_ms']:9.2f} {r['step_ms_min']:8.2f} {temp:>9} {r['minor_faults']:12.0f}"
        )
    print(
        f"(temp MiB: XLA:CPU's block of temporaries, allocated on every call; faults/step: minor "
        f"page faults of this process per step; glibc malloc: {cfg['malloc']})"
    )
    print("\nStep-time ratios (medians of the same run):")
    for key, (a, b, what) in RATIOS.items():
        print(f"  {NAMES[a]:>20} / {NAMES[b]:<20} {res['ratios'][key]:6.3f}   {what}")
    bal = runs["balanced_dropless"]
    R = len(bal["rank_load_before"])
    print(f"\nPer-rank load ((token, choice) pairs), skewed router:\n{'rank':>8}", end="")
    print("".join(f"{r:>6}" for r in range(R)) + f"{'max/mean':>10}")
    print(f"{'before':>8}" + "".join(f"{v:6d}" for v in bal["rank_load_before"]), end="")
    print(f"{bal['imbalance_before']:10.3f}")
    print(f"{'after':>8}" + "".join(f"{v:6d}" for v in bal["rank_load_after"]), end="")
    print(f"{bal['imbalance_after']:10.3f}   ({bal['replicas']} replicas)")


RATIOS = {
    "overhead_dropless": (
        "balanced_dropless",
        "plain_dropless",
        "same buffers and total work (pinned ranks: the busiest rank differs)",
    ),
    "capped_vs_plain_dropless": (
        "balanced_capped",
        "plain_dropless",
        "balanced in a small buffer vs plain EP that drops nothing",
    ),
    "capped_vs_plain_capped": (
        "balanced_capped",
        "plain_capped",
        "same buffer; plain EP drops pairs (less work)",
    ),
    "capped_vs_ideal": (
        "balanced_capped",
        "ideal_capped",
        "same buffer; the ideal's even routing, no planner or replicas",
    ),
    "ideal_vs_plain_dropless": (
        "ideal_capped",
        "plain_dropless",
        "the floor of balanced / plain dropless: a free, perfect balancer",
    ),
}


def _check_shape(ep_size: int) -> None:
    if _E.value % ep_size:
        raise ValueError(f"--num_experts={_E.value} is not divisible by the EP size {ep_size}")
    one_rank = bool(_PINNED.value)
    most = _E.value // ep_size if one_rank else ep_size
    if _HOT.value > most:
        raise ValueError(
            f"--hot_experts={_HOT.value} exceeds {most} "
            f"({'experts on rank 0' if one_rank else 'one per rank'})"
        )


def run(pinned: bool) -> dict:
    """Builds, compiles and times the five layers on every device of this run; the results."""
    # Auto axes: the layer splits the work with shard_map itself.
    mesh = jax.make_mesh((jax.device_count(),), ("expert",), axis_types=(AxisType.Auto,))
    R = mesh.size
    _check_shape(R)
    calibration = None
    if pinned:
        rows = _K.value * _TOKENS.value
        calibration = concurrency_check(rows, _D.value, _F.value)
    x, router = _skewed_inputs(mesh, np.random.default_rng(_SEED.value), one_rank=pinned)
    # Always balance (no fallback below the default threshold): this measures balancing.
    balancer = uep.BalancerConfig(
        num_experts=_E.value, ep_size=R, min_tokens_per_rank=0, **_BALANCER()
    )
    layers = {
        "plain_dropless": _build(mesh, None, router, None),
        "plain_capped": _build(mesh, None, router, _CF.value),
        "balanced_capped": _build(mesh, balancer, router, _CF.value),
        "balanced_dropless": _build(mesh, balancer, router, None),
        # The force-balanced ideal: the router's pairs spread evenly, no balancing cost.
        "ideal_capped": _build(mesh, None, router, _CF.value, force_balanced=True),
    }
    runs = {name: _compile(layer, x, _MODE.value) for name, layer in layers.items()}
    _time_interleaved(runs, _REPEATS.value)
    for r in runs.values():
        del r["run"]
    res = {
        "config": {
            "device": str(jax.devices()[0].device_kind),
            "devices": jax.device_count(),
            "ep_size": R,
            "pinned_ranks": _PINNED.value,
            "mode": _MODE.value,
            **_layer_shape(),
            **_BALANCER(),
            "tokens_per_device": _TOKENS.value,
            "capacity_factor": _CF.value,
            "hot_experts": _HOT.value,
            "skew": _SKEW.value,
            "repeats": _REPEATS.value,
            "malloc": _malloc_mode(),
        },
        "runs": runs,
        "ratios": {
            key: runs[a]["step_ms"] / runs[b]["step_ms"] for key, (a, b, _) in RATIOS.items()
        },
    }
    if calibration is not None:
        res["calibration"] = calibration
    return res


def _malloc_mode() -> str:
    """How glibc's malloc was set up in this process: "keep" or "system"."""
    keep = _MALLOC.value == "keep" or (_MALLOC.value == "auto" and _NUM_PROCESSES.value > 1)
    return "keep" if keep else "system"


def main(argv):
    """Starts the pinned rank processes (``--pinned_ranks``), or runs the benchmark in this
    process (one of them) and, on the first, prints the tables and writes ``--json_out``."""
    if _PINNED.value and _NUM_PROCESSES.value == 1:
        try:
            code = launch_pinned_ranks(
                _PINNED.value, "experiments.bench.moe", sys.argv[1:], _VERBOSE_RANKS.value
            )
        except ValueError as err:
            fail(err)
        sys.exit(code)
    if _MALLOC.value == "keep" or (_MALLOC.value == "auto" and _NUM_PROCESSES.value > 1):
        keep_freed_memory()  # time the kernels, not the page faults
    try:
        start_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
        if _PINNED.value and jax.device_count() != _PINNED.value:
            raise ValueError(f"--pinned_ranks={_PINNED.value} found {jax.device_count()} devices")
        res = run(pinned=bool(_PINNED.value))
    except ValueError as err:
        fail(err)
    if jax.process_index() == 0:
        _print_report(res)
        write_json(_JSON.value, res)


if __name__ == "__main__":
    run_main(main)
