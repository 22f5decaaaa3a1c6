"""Compile time of the training step against depth: scanned vs unrolled blocks.

    python -m experiments.bench.compile                      # 2 and 8 layers, scan and unrolled
    python -m experiments.bench.compile --layers=2,4,8 --repeats=3 --preset=deepseek_v3

Lowers and compiles the jitted forward+backward of `models.moe_lm.MoELM` (balanced MoE layers:
the FFI planner sits inside every layer, so inside the scan body) on 8 simulated CPU devices,
``--repeats`` times per configuration (fresh each time: jax's compilation cache is off here),
and prints the median seconds and each depth's ratio to the shallowest.
"""

from __future__ import annotations

from experiments.lab import cli
from experiments.lab.devices import force_cpu_devices
from experiments.lab.output_files import write_json
from experiments.lab.program import run_main

force_cpu_devices(8, cpu_only=True)

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
from absl import flags
from flax import nnx

import ultraep_jax as uep
from models.moe_lm import MoELM, MoESettings, next_token_loss
from models.presets import PRESETS, preset

_LAYERS = flags.DEFINE_list("layers", ["2", "8"], "Depths to compile.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Compilations per configuration (median).")
_PRESET = flags.DEFINE_enum("preset", "tiny", sorted(PRESETS), "Model preset.")
_JSON = cli.define_json_out()


def compile_seconds(cfg, mesh) -> float:
    """Seconds to lower and compile one balanced training step (loss and gradients)."""
    balancer = uep.BalancerConfig(
        cfg.num_experts,
        mesh.shape["expert"],
        slots_per_rank=2,
        min_tokens_per_replica=8,
        min_tokens_per_rank=0,  # compile the balanced program whatever the batch
    )
    model = MoELM(cfg, mesh, MoESettings(balancer, 1.05), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    batch = jax.ShapeDtypeStruct((16, 129), jnp.int32)

    def step(state, batch):
        def loss(state):
            return next_token_loss(nnx.merge(graphdef, state), batch)

        return jax.value_and_grad(loss, has_aux=True)(state)

    start = time.perf_counter()
    jax.jit(step).lower(state, batch).compile()
    return time.perf_counter() - start


def main(argv):
    del argv
    jax.config.update("jax_enable_compilation_cache", False)
    mesh = jax.make_mesh((8,), ("expert",))
    depths = [int(d) for d in _LAYERS.value]
    results = {}
    for scan in (True, False):
        for depth in depths:
            cfg = dataclasses.replace(
                preset(_PRESET.value).model, num_layers=depth, scan_layers=scan, max_seq_len=128
            )
            times = [compile_seconds(cfg, mesh) for _ in range(_REPEATS.value)]
            results[(scan, depth)] = statistics.median(times)
    print(f"compile seconds, preset {_PRESET.value}, median of {_REPEATS.value}")
    print(f"{'layers':>6} {'scan':>8} {'unrolled':>9} {'scan/shallowest':>16}")
    rows = []
    for depth in depths:
        scan_s, unrolled_s = results[(True, depth)], results[(False, depth)]
        ratio = scan_s / results[(True, depths[0])]
        print(f"{depth:>6} {scan_s:>8.2f} {unrolled_s:>9.2f} {ratio:>16.2f}")
        rows.append(dict(layers=depth, scan_s=scan_s, unrolled_s=unrolled_s, scan_ratio=ratio))
    if _JSON.value:
        write_json(_JSON.value, dict(preset=_PRESET.value, rows=rows))


if __name__ == "__main__":
    run_main(main)
