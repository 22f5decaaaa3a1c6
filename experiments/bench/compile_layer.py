"""Compile time of one MoE layer's training step, by stage, against plain EP and a minimal EP.

    python -m experiments.bench.compile_layer                 # T=1024 D=128 F=64 E=8 top-2
    python -m experiments.bench.compile_layer --repeats=5 --variants=balanced,off

On 8 simulated CPU devices (EP8), jits ``value_and_grad`` of one layer call and times each stage
separately: trace (`jax.jit(...).trace`), lower (to StableHLO) and compile (XLA), fresh each
repeat (jax's compilation cache off), the variants alternating within each round. Variants:

  balanced   `uep.routed_experts` with the default `BalancerConfig` (2 slots, relay fan-out 2)
  off        `uep.routed_experts` without a balancer (same dispatch, no plan or replicas)
  minimal    a fixed-buffer EP of a few lines: per-expert capacity buffers, one `all_to_all`
             each way, a batched einsum (drops past capacity; no counts, offsets or stats)

Prints the median seconds per stage and each variant's total against "off".
"""

from __future__ import annotations

from experiments.lab import cli
from experiments.lab.devices import force_cpu_devices
from experiments.lab.output_files import write_json
from experiments.lab.program import run_main

force_cpu_devices(8, cpu_only=True)

import statistics
import time

import jax
import jax.numpy as jnp
from absl import flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from experiments.bench.minimal_ep import minimal_ep

_VARIANTS = flags.DEFINE_list("variants", ["minimal", "off", "balanced"], "Variants to time.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Fresh compilations per variant (median).")
_TOKENS = flags.DEFINE_integer("tokens", 1024, "Tokens in the batch (split over 8 devices).")
_JSON = cli.define_json_out()

D, F, E, K = 128, 64, 8, 2


def make_step(variant: str, mesh):
    """The jitted value_and_grad of sum(layer(x) * cot) for ``variant``."""
    if variant == "minimal":

        def layer(x, ids, w, params):
            return minimal_ep(x, ids, w, params, mesh, num_experts=E, top_k=K)
    else:
        # min_tokens_per_rank=0: the balanced program, although 128 tokens per rank is below
        # the default fallback threshold.
        balancer = uep.BalancerConfig(min_tokens_per_rank=0) if variant == "balanced" else None
        ep = uep.ExpertParallel(mesh, E, balancer, capacity_factor=1.25)

        def layer(x, ids, w, params):
            return uep.routed_experts(x, ids, w, params, ep)[0]

    def loss(x, w, params, ids, cot):
        return jnp.sum(layer(x, ids, w, params) * cot)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def stage_seconds(variant: str, mesh) -> dict[str, float]:
    """Seconds to trace, lower and compile one fresh step of ``variant``."""
    T = _TOKENS.value
    tok, exp = NamedSharding(mesh, P("expert")), NamedSharding(mesh, P("expert"))
    f32 = jnp.float32
    args = (
        jax.ShapeDtypeStruct((T, D), f32, sharding=tok),
        jax.ShapeDtypeStruct((T, K), f32, sharding=tok),
        tuple(jax.ShapeDtypeStruct(s, f32, sharding=exp) for s in ((E, D, F),) * 2 + ((E, F, D),)),
        jax.ShapeDtypeStruct((T, K), jnp.int32, sharding=tok),
        jax.ShapeDtypeStruct((T, D), f32, sharding=tok),
    )
    jax.clear_caches()  # the layer's inner `jax.jit` caches its trace across steps
    step = make_step(variant, mesh)
    t0 = time.perf_counter()
    traced = step.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    lowered.compile()
    t3 = time.perf_counter()
    return {"trace": t1 - t0, "lower": t2 - t1, "compile": t3 - t2}


def main(argv):
    del argv
    jax.config.update("jax_enable_compilation_cache", False)
    mesh = jax.make_mesh((8,), ("expert",))
    # Variants alternate within each round, so that load on a shared machine hits them alike.
    runs = {variant: [] for variant in _VARIANTS.value}
    for _ in range(_REPEATS.value):
        for variant in _VARIANTS.value:
            runs[variant].append(stage_seconds(variant, mesh))
    results = {
        variant: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        for variant, rs in runs.items()
    }
    base = sum(results["off"].values()) if "off" in results else None
    print(
        f"compile seconds by stage, T={_TOKENS.value} D={D} F={F} E={E} top-{K}, EP8 on CPU, "
        f"median of {_REPEATS.value}"
    )
    print(f"{'variant':>9} {'trace':>7} {'lower':>7} {'compile':>8} {'total':>7} {'/off':>6}")
    for variant, r in results.items():
        total = sum(r.values())
        ratio = f"{total / base:6.2f}" if base else "     -"
        print(
            f"{variant:>9} {r['trace']:7.2f} {r['lower']:7.2f} {r['compile']:8.2f} "
            f"{total:7.2f} {ratio}"
        )
    if _JSON.value:
        write_json(_JSON.value, dict(tokens=_TOKENS.value, results=results))


if __name__ == "__main__":
    run_main(main)
