"""MoE layer benchmark: the cost of balancing and its memory win, on 8 simulated CPU devices.

        python -m experiments.bench_moe                      # about a minute on 2 cores
        python -m experiments.bench_moe --tokens_per_device=512 --repeats=20 --json_out=moe.json

On mesh (8,) "expert" with a skewed router (a few hot experts take most tokens), for
``balancer=None`` (plain EP) and for the balancer:

- compile time (lower + compile) and steady step time (forward + backward under `jax.jit`, the
  gradient w.r.t. x and every parameter; median over --repeats) and their ratio;
- per-rank load before and after balancing (from `MoEStats`);
- receive-buffer rows per rank needed for zero drops: max over ranks of ``rank_load_before``
  (plain EP) or ``rank_load_after`` (balanced), also as a multiple of ``tokens_per_device *
  top_k`` (the capacity factor that would be needed).

Simulated CPU devices share the host's cores, so step times measure work, not a real
interconnect; the compile time and the buffer rows are the transferable figures.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ultraep_jax as uep  # noqa: E402

_D = flags.DEFINE_integer("d_model", 64, "Token width D.")
_F = flags.DEFINE_integer("d_ff", 128, "Expert hidden width F.")
_E = flags.DEFINE_integer("num_experts", 16, "Experts E (divisible by the 8 EP ranks).")
_K = flags.DEFINE_integer("top_k", 2, "Experts per token.")
_S = flags.DEFINE_integer("slots_per_rank", 2, "Spare slots per rank.")
_TOKENS = flags.DEFINE_integer("tokens_per_device", 256, "Tokens on each device.")
_SEQ = flags.DEFINE_integer("seq_len", 64, "Sequence length (must divide tokens_per_device).")
_HOT = flags.DEFINE_integer("hot_experts", 2, "Experts the skewed router favours.")
_SKEW = flags.DEFINE_float("skew", 2.0, "Router bias strength toward the hot experts.")
_CF = flags.DEFINE_string(
    "capacity_factor", "none", "Receive buffer as a multiple of top_k * tokens; 'none' = dropless."
)
_MIN_TOKENS = flags.DEFINE_integer("min_tokens_per_replica", 16, "Least tokens per replica.")
_EPS = flags.DEFINE_float("balance_eps", 0.01, "Balance tolerance above the mean.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed steps (the median is reported).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the inputs and parameters.")
_JSON = flags.DEFINE_string("json_out", None, "Also write the results to this JSON file.")


def _capacity_factor() -> float | None:
    """The --capacity_factor flag as a float, or None for dropless buffers."""
    value = _CF.value.strip().lower()
    return None if value in ("none", "") else float(value)


def _skewed_inputs(mesh, rng):
    """x [batch, seq, D] (batch split over the mesh) and a router kernel [D, E] that sends most
    tokens to --hot_experts experts on different ranks (x shares a direction u their columns align
    with)."""
    D, E = _D.value, _E.value
    if _TOKENS.value % _SEQ.value:
        raise ValueError(f"--seq_len={_SEQ.value} must divide --tokens_per_device={_TOKENS.value}")
    batch = mesh.size * _TOKENS.value // _SEQ.value
    u = rng.normal(size=D)
    u /= np.linalg.norm(u)
    x = rng.normal(size=(batch, _SEQ.value, D)) + 2.0 * u
    router = rng.normal(size=(D, E)) * (2.0 / math.sqrt(D))  # logits of std ~2
    hot = np.arange(_HOT.value) * (E // mesh.size)  # the first expert of the first ranks
    router[:, hot] += _SKEW.value * u[:, None]
    x = jax.device_put(x.astype(np.float32), NamedSharding(mesh, P(tuple(mesh.axis_names))))
    return x, router.astype(np.float32)


def _build(mesh, balancer, router):
    """The layer with the skewed router written in."""
    layer = uep.MoE(
        d_model=_D.value,
        d_ff=_F.value,
        num_experts=_E.value,
        top_k=_K.value,
        mesh=mesh,
        balancer=balancer,
        capacity_factor=_capacity_factor(),
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


def _measure(layer, x) -> dict:
    """Compile time, median step time and the stats of one layer."""
    step, params, rest = _train_step(layer)
    start = time.perf_counter()
    compiled = step.lower(params, rest, x).compile()
    compile_s = time.perf_counter() - start
    (_, stats), grads = jax.block_until_ready(compiled(params, rest, x))  # warm-up
    times = []
    for _ in range(_REPEATS.value):
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, rest, x))
        times.append(time.perf_counter() - start)
    del grads
    return {
        "compile_s": compile_s,
        "step_ms": float(np.median(times)) * 1e3,
        "step_ms_min": float(np.min(times)) * 1e3,
        "rank_load_before": np.asarray(stats.rank_load_before).tolist(),
        "rank_load_after": np.asarray(stats.rank_load_after).tolist(),
        "dropped": int(stats.dropped),
        "replicas": int(stats.replicas),
        "imbalance_before": float(stats.imbalance_before),
        "imbalance_after": float(stats.imbalance_after),
    }


def _print_report(res: dict) -> None:
    """The readable table."""
    cfg = res["config"]
    plain, bal = res["plain"], res["balanced"]
    print(
        f"MoE layer on {cfg['devices']} x {cfg['device']}, mesh (8,) 'expert': D={cfg['d_model']} "
        f"F={cfg['d_ff']} E={cfg['num_experts']} top-{cfg['top_k']} S={cfg['slots_per_rank']} "
        f"tokens/device={cfg['tokens_per_device']} capacity_factor={cfg['capacity_factor']} "
        f"skewed router ({cfg['hot_experts']} hot experts, bias {cfg['skew']})"
    )
    print(f"\n{'':>10} {'compile s':>10} {'step ms (median)':>17} {'step ms (min)':>14}")
    for name, r in (("plain EP", plain), ("balanced", bal)):
        print(f"{name:>10} {r['compile_s']:10.2f} {r['step_ms']:17.2f} {r['step_ms_min']:14.2f}")
    print(
        f"{'ratio':>10} {bal['compile_s'] / plain['compile_s']:10.2f} "
        f"{bal['step_ms'] / plain['step_ms']:17.2f}   (balanced / plain: the overhead of balancing)"
    )
    R = len(bal["rank_load_before"])
    print(f"\nPer-rank load ((token, choice) pairs), skewed router:\n{'rank':>8}", end="")
    print("".join(f"{r:>6}" for r in range(R)) + f"{'max/mean':>10}")
    print(f"{'before':>8}" + "".join(f"{v:6d}" for v in bal["rank_load_before"]), end="")
    print(f"{bal['imbalance_before']:10.3f}")
    print(f"{'after':>8}" + "".join(f"{v:6d}" for v in bal["rank_load_after"]), end="")
    print(f"{bal['imbalance_after']:10.3f}   ({bal['replicas']} replicas)")
    print(f"\nDropped pairs: plain {plain['dropped']}, balanced {bal['dropped']}")
    rows = res["buffer_rows"]
    print(
        f"\nReceive-buffer rows per rank for zero drops (multiple of tokens/device x top-k = "
        f"{rows['pairs_per_device']}):"
    )
    print(f"  plain EP  {rows['plain']:6d}  ({rows['plain_factor']:.3f}x)")
    print(f"  balanced  {rows['balanced']:6d}  ({rows['balanced_factor']:.3f}x)")
    print(f"  saving    {1 - rows['balanced'] / rows['plain']:.1%} of the buffer")


def main(argv):
    del argv
    # Auto axes: the layer splits the work with shard_map itself (and, at the time of writing,
    # differentiating w.r.t. an x placed on an Explicit mesh fails in the layer).
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(_SEED.value)
    x, router = _skewed_inputs(mesh, rng)
    balancer = uep.BalancerConfig(
        num_experts=_E.value,
        ep_size=8,
        slots_per_rank=_S.value,
        min_tokens_per_replica=_MIN_TOKENS.value,
        balance_eps=_EPS.value,
    )
    res = {
        "config": {
            "device": str(jax.devices()[0].device_kind),
            "devices": jax.device_count(),
            "d_model": _D.value,
            "d_ff": _F.value,
            "num_experts": _E.value,
            "top_k": _K.value,
            "slots_per_rank": _S.value,
            "tokens_per_device": _TOKENS.value,
            "capacity_factor": _capacity_factor(),
            "hot_experts": _HOT.value,
            "skew": _SKEW.value,
            "min_tokens_per_replica": _MIN_TOKENS.value,
            "balance_eps": _EPS.value,
            "repeats": _REPEATS.value,
        },
        "plain": _measure(_build(mesh, None, router), x),
        "balanced": _measure(_build(mesh, balancer, router), x),
    }
    pairs = _TOKENS.value * _K.value
    need_plain = max(res["balanced"]["rank_load_before"])
    need_bal = max(res["balanced"]["rank_load_after"])
    res["buffer_rows"] = {
        "pairs_per_device": pairs,
        "plain": need_plain,
        "balanced": need_bal,
        "plain_factor": need_plain / pairs,
        "balanced_factor": need_bal / pairs,
    }
    res["step_time_ratio"] = res["balanced"]["step_ms"] / res["plain"]["step_ms"]
    res["compile_time_ratio"] = res["balanced"]["compile_s"] / res["plain"]["compile_s"]
    _print_report(res)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    app.run(main)
