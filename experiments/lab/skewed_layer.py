"""The MoE layer the layer benchmarks time (`experiments.bench.moe`, `bench.breakeven`,
`bench.rates`): a `uep.MoE` with a skewed router (a few hot experts take most tokens) written in,
its compiled step (train: forward+backward; prefill: forward), and steps timed interleaved.

Their flags are `experiments.lab.cli.define_layer_flags` (`SkewedLayer`'s fields, the balancer,
the buffer, the rounds, the ranks) and, for a sweep over tokens per rank and modes,
`cli.define_sweep_flags` (read by `sweep`).
"""

from __future__ import annotations

import dataclasses
import math
import resource
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from experiments.lab.loads import ranks

#: The layer's modes: train (forward+backward, the gradient w.r.t. x and every parameter) and
#: prefill (forward only).
MODES = ("train", "prefill")
#: The break-even's layer shape (`bench.breakeven`, whose rates `bench.rates` measures).
BREAKEVEN_SHAPE = {"d_model": 128, "d_ff": 512, "num_experts": 8}
#: ``--quick``: the smoke test's tokens per rank, router skews and timed rounds.
QUICK_TOKENS, QUICK_SKEWS, QUICK_REPEATS = (64, 256), (0.0, 3.0), 3


@dataclasses.dataclass(frozen=True)
class SkewedLayer:
    """The benchmarked layer's shape and its inputs (each field a flag of its own).

    Attributes:
      d_model: token width D.
      d_ff: expert hidden width F.
      num_experts: experts E (divisible by the EP size).
      top_k: experts per token.
      tokens_per_device: tokens on each device.
      seq_len: sequence length (must divide tokens_per_device).
      hot_experts: experts the skewed router favours.
      skew: router bias strength toward the hot experts.
      seed: seed of the inputs and parameters.
    """

    d_model: int = 64
    d_ff: int = 128
    num_experts: int = 16
    top_k: int = 2
    tokens_per_device: int = 256
    seq_len: int = 64
    hot_experts: int = 2
    skew: float = 2.0
    seed: int = 0

    @property
    def shape(self) -> dict:
        """The layer's shape as `uep.MoE` keyword arguments."""
        return {
            "d_model": self.d_model,
            "d_ff": self.d_ff,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
        }


def hot_experts(num_experts: int, ep_size: int, count: int, one_rank: bool) -> np.ndarray:
    """The experts the skewed router favours: the first ``count`` of rank 0 (``one_rank``), or
    the first expert of each of ranks 0..count-1."""
    if one_rank:
        return np.arange(count)
    return ranks.masters_of_ranks(num_experts, ep_size)[:count, 0]


def check_shape(layer: SkewedLayer, ep_size: int, one_rank: bool) -> None:
    """Raises ValueError (one line naming the flag) when E does not split over ``ep_size`` ranks
    or there are more hot experts than `hot_experts` can place (``one_rank``: the experts of rank
    0; else one per rank)."""
    if layer.num_experts % ep_size:
        raise ValueError(
            f"--num_experts={layer.num_experts} is not divisible by the EP size {ep_size}"
        )
    most = layer.num_experts // ep_size if one_rank else ep_size
    if layer.hot_experts > most:
        raise ValueError(
            f"--hot_experts={layer.hot_experts} exceeds {most} "
            f"({'experts on rank 0' if one_rank else 'one per rank'})"
        )


def skewed_inputs(mesh, layer: SkewedLayer, rng, one_rank: bool):
    """x [batch, seq, D] (batch split over the mesh) and a router kernel [D, E] that sends most
    tokens to the hot experts (x shares a direction u their columns align with)."""
    D, E = layer.d_model, layer.num_experts
    batch = mesh.size * layer.tokens_per_device // layer.seq_len
    u = rng.normal(size=D)
    u /= np.linalg.norm(u)
    x = rng.normal(size=(batch, layer.seq_len, D)) + 2.0 * u
    router = rng.normal(size=(D, E)) * (2.0 / math.sqrt(D))  # logits of std ~2
    hot = hot_experts(E, mesh.size, layer.hot_experts, one_rank)
    router[:, hot] += layer.skew * u[:, None]
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    x = x.astype(np.float32)
    # Every process makes the same x and places the rows of its own devices.
    x = jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return x, router.astype(np.float32)


def build(mesh, layer: SkewedLayer, balancer, router, capacity_factor, force_balanced=False):
    """The `uep.MoE` of ``layer``'s shape on ``mesh`` with the skewed ``router`` [D, E] written
    in."""
    moe = uep.MoE(
        **layer.shape,
        mesh=mesh,
        balancer=balancer,
        capacity_factor=capacity_factor,
        force_balanced=force_balanced,
        rngs=nnx.Rngs(layer.seed),
    )
    old = moe.router_kernel[...]
    moe.router_kernel[...] = jax.make_array_from_callback(
        router.shape, old.sharding, lambda index: router[index]
    )
    return moe


def _step(moe, mode: str):
    """(jitted step(params, rest, x), params, rest): forward+backward (``train``: the loss, the
    stats and the gradient w.r.t. the parameters and x) or forward only (``prefill``: y and the
    stats)."""
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)

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


def compile_step(moe, x, mode: str, tokens_per_device: int) -> dict:
    """The layer's compiled step (``run``: one call), its compile time, the block of temporaries
    XLA:CPU allocates per call, its buffer rows at ``tokens_per_device`` and the stats of one
    step."""
    step, params, rest = _step(moe, mode)
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
        "buffer_rows": moe.capacity(tokens_per_device),
        "rank_load_before": np.asarray(stats.rank_load_before).tolist(),
        "rank_load_after": np.asarray(stats.rank_load_after).tolist(),
        "dropped": int(stats.dropped),
        "replicas": int(stats.replicas),
        "imbalance_before": float(stats.imbalance_before),
        "imbalance_after": float(stats.imbalance_after),
    }


def time_interleaved(layers: dict, repeats: int) -> None:
    """Adds ``step_ms`` (median), ``step_ms_min`` and ``minor_faults`` (this process's minor page
    faults per step, mean; unlike the clock, other load on the machine does not change them) to
    each `compile_step` entry, timing one step of each layer per round."""
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


def sweep(
    tokens: Sequence[str], modes: Sequence[str], repeats: int, seq_len: int, quick: bool
) -> tuple[list[int], list[str], int]:
    """(tokens per rank, modes, timed rounds) of the sweep flags (``--tokens``, ``--modes``,
    ``--repeats``, ``--quick``: `QUICK_TOKENS` and `QUICK_REPEATS`).

    Raises:
      ValueError: one line naming a bad value.
    """
    if quick:
        return list(QUICK_TOKENS), list(modes), QUICK_REPEATS
    try:
        counts = [int(t) for t in tokens]
    except ValueError as err:
        raise ValueError(f"--tokens must be integers: {err}") from None
    for t in counts:
        if t < 1 or t % seq_len:
            raise ValueError(f"--tokens={t} must be a positive multiple of --seq_len={seq_len}")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"--modes: {m!r} is not train or prefill")
    return counts, list(modes), repeats
