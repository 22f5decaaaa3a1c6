"""MoE layer benchmark: the cost of balancing and its memory win, on 8 simulated CPU devices.

        python -m experiments.bench.moe                      # a few minutes on 2 cores
        python -m experiments.bench.moe --d_model=256 --d_ff=512 --num_experts=32 --top_k=4 \
            --tokens_per_device=1024 --json_out=moe.json

On mesh (8,) "expert" with a skewed router (a few hot experts take most tokens), four layers:
plain EP and balanced, each with dropless worst-case receive buffers (R x the pairs a rank routes)
and with buffers of ``--capacity_factor`` x those pairs. For each: compile time, forward+backward
step time (the gradient w.r.t. x and every parameter; the four compiled steps run interleaved,
``--repeats`` rounds, medians, so that a busy machine slows them alike), buffer rows, dropped
pairs, per-rank load before and after balancing, and the ratios between them.

Simulated CPU devices share the host's cores, so step times measure total work, not a real
interconnect.
"""

from __future__ import annotations

from experiments import common

common.force_cpu_devices(8, cpu_only=True)  # before JAX starts a backend

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep

_D = flags.DEFINE_integer("d_model", 64, "Token width D.")
_F = flags.DEFINE_integer("d_ff", 128, "Expert hidden width F.")
_E = flags.DEFINE_integer("num_experts", 16, "Experts E (divisible by the 8 EP ranks).")
_K = flags.DEFINE_integer("top_k", 2, "Experts per token.")
_BALANCER = common.define_balancer_flags(min_tokens_per_replica=16)
_TOKENS = flags.DEFINE_integer("tokens_per_device", 256, "Tokens on each device.")
_SEQ = flags.DEFINE_integer("seq_len", 64, "Sequence length (must divide tokens_per_device).")
_HOT = flags.DEFINE_integer("hot_experts", 2, "Experts the skewed router favours (at most 8).")
_SKEW = flags.DEFINE_float("skew", 2.0, "Router bias strength toward the hot experts.")
_CF = flags.DEFINE_float(
    "capacity_factor", 1.05, "Receive buffer of the capped layers, as a multiple of top_k * tokens."
)
_REPEATS = flags.DEFINE_integer("repeats", 15, "Timed rounds (medians are reported).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the inputs and parameters.")
_JSON = flags.DEFINE_string("json_out", None, "Also write the results to this JSON file.")

flags.register_validator("num_experts", lambda e: e > 0 and e % 8 == 0, "must be a multiple of 8")
flags.register_validator("hot_experts", lambda n: 0 <= n <= 8, "must lie in [0, 8] (one a rank)")
flags.register_multi_flags_validator(
    ["seq_len", "tokens_per_device"],
    lambda v: v["seq_len"] > 0 and v["tokens_per_device"] % v["seq_len"] == 0,
    "--seq_len must divide --tokens_per_device",
)


def _layer_shape() -> dict:
    """The flags' layer shape, as ``uep.MoE`` keyword arguments."""
    return {"d_model": _D.value, "d_ff": _F.value, "num_experts": _E.value, "top_k": _K.value}


def _skewed_inputs(mesh, rng):
    """x [batch, seq, D] (batch split over the mesh) and a router kernel [D, E] that sends most
    tokens to --hot_experts experts on different ranks (x shares a direction u their columns align
    with)."""
    D, E = _D.value, _E.value
    batch = mesh.size * _TOKENS.value // _SEQ.value
    u = rng.normal(size=D)
    u /= np.linalg.norm(u)
    x = rng.normal(size=(batch, _SEQ.value, D)) + 2.0 * u
    router = rng.normal(size=(D, E)) * (2.0 / math.sqrt(D))  # logits of std ~2
    hot = np.arange(_HOT.value) * (E // mesh.size)  # the first expert of the first ranks
    router[:, hot] += _SKEW.value * u[:, None]
    x = jax.device_put(x.astype(np.float32), NamedSharding(mesh, P(tuple(mesh.axis_names))))
    return x, router.astype(np.float32)


def _build(mesh, balancer, router, capacity_factor):
    """The layer with the skewed router written in."""
    layer = uep.MoE(
        **_layer_shape(),
        mesh=mesh,
        balancer=balancer,
        capacity_factor=capacity_factor,
        rngs=nnx.Rngs(_SEED.value),
    )
    old = layer.router_kernel[...]
    layer.router_kernel[...] = jax.device_put(jnp.asarray(router), old.sharding)
    return layer


def _train_step(layer):
    """(jitted step(params, rest, x) -> ((loss, stats), grads), params, rest)."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, rest, x):
        y, stats = nnx.merge(graphdef, params, rest)(x)
        return jnp.mean(jnp.square(y)), stats

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True))
    return step, params, rest


def _compile(layer, x) -> dict:
    """The layer's compiled training step, its compile time and the stats of one step."""
    step, params, rest = _train_step(layer)
    start = time.perf_counter()
    compiled = step.lower(params, rest, x).compile()
    compile_s = time.perf_counter() - start
    (_, stats), _ = jax.block_until_ready(compiled(params, rest, x))  # warm-up
    return {
        "run": lambda: compiled(params, rest, x),
        "compile_s": compile_s,
        "buffer_rows": layer.capacity(_TOKENS.value),
        "rank_load_before": np.asarray(stats.rank_load_before).tolist(),
        "rank_load_after": np.asarray(stats.rank_load_after).tolist(),
        "dropped": int(stats.dropped),
        "replicas": int(stats.replicas),
        "imbalance_before": float(stats.imbalance_before),
        "imbalance_after": float(stats.imbalance_after),
    }


def _time_interleaved(layers: dict, repeats: int) -> None:
    """Adds ``step_ms`` (median) and ``step_ms_min`` to each entry, timing one step of each layer
    per round."""
    times = {name: [] for name in layers}
    for _ in range(repeats):
        for name, r in layers.items():
            start = time.perf_counter()
            jax.block_until_ready(r["run"]())
            times[name].append(time.perf_counter() - start)
    for name, r in layers.items():
        r["step_ms"] = float(np.median(times[name])) * 1e3
        r["step_ms_min"] = float(np.min(times[name])) * 1e3


NAMES = {
    "plain_dropless": "plain EP, dropless",
    "plain_capped": "plain EP, capped",
    "balanced_capped": "balanced, capped",
    "balanced_dropless": "balanced, dropless",
}


def _print_report(res: dict) -> None:
    """The readable tables."""
    cfg, runs = res["config"], res["runs"]
    print(
        f"MoE layer on {cfg['devices']} x {cfg['device']}, mesh (8,) 'expert': D={cfg['d_model']} "
        f"F={cfg['d_ff']} E={cfg['num_experts']} top-{cfg['top_k']} S={cfg['slots_per_rank']} "
        f"tokens/device={cfg['tokens_per_device']}, capped = capacity factor "
        f"{cfg['capacity_factor']}, skewed router ({cfg['hot_experts']} hot experts, bias "
        f"{cfg['skew']}), {cfg['repeats']} interleaved rounds"
    )
    print(
        f"\n{'':>20} {'buffer rows':>11} {'dropped':>8} {'compile s':>10} {'step ms':>9} "
        f"{'(min)':>8}"
    )
    for key, name in NAMES.items():
        r = runs[key]
        print(
            f"{name:>20} {r['buffer_rows']:11d} {r['dropped']:8d} {r['compile_s']:10.2f} "
            f"{r['step_ms']:9.2f} {r['step_ms_min']:8.2f}"
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
        "the cost of balancing, same buffers, same work",
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
}


def main(argv):
    """Builds, compiles and times the four layers, prints the tables; ``--json_out`` also."""
    del argv
    # Auto axes: the layer splits the work with shard_map itself (and, at the time of writing,
    # differentiating w.r.t. an x placed on an Explicit mesh fails in the layer).
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(_SEED.value)
    x, router = _skewed_inputs(mesh, rng)
    balancer = uep.BalancerConfig(num_experts=_E.value, ep_size=8, **_BALANCER())
    layers = {
        "plain_dropless": _build(mesh, None, router, None),
        "plain_capped": _build(mesh, None, router, _CF.value),
        "balanced_capped": _build(mesh, balancer, router, _CF.value),
        "balanced_dropless": _build(mesh, balancer, router, None),
    }
    runs = {name: _compile(layer, x) for name, layer in layers.items()}
    _time_interleaved(runs, _REPEATS.value)
    for r in runs.values():
        del r["run"]
    res = {
        "config": {
            "device": str(jax.devices()[0].device_kind),
            "devices": jax.device_count(),
            **_layer_shape(),
            **_BALANCER(),
            "tokens_per_device": _TOKENS.value,
            "capacity_factor": _CF.value,
            "hot_experts": _HOT.value,
            "skew": _SKEW.value,
            "repeats": _REPEATS.value,
        },
        "runs": runs,
        "ratios": {
            key: runs[a]["step_ms"] / runs[b]["step_ms"] for key, (a, b, _) in RATIOS.items()
        },
    }
    _print_report(res)
    common.write_json(_JSON.value, res)


if __name__ == "__main__":
    common.run_main(main)
