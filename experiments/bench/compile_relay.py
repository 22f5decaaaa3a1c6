"""Compile time of the relay schedule (`ultraep_jax.tools.relay_schedule`) alone, batched and not.

    python -m experiments.bench.compile_relay                       # R = 8, 64; f = 1, 2
    python -m experiments.bench.compile_relay --ep_sizes=64 --ranks_per_domain=8

For each EP size R and fan-out f, lowers and compiles, fresh each repeat (jax's compilation cache
off), the schedule of one plan's slots [R, S] (``plain``), of a batch [N, R, S] under `jax.vmap`
(``vmap``, what `experiments.lab.batched.batched_schedule` compiles) and under `jax.lax.map`
(``lax.map``), the three alternating within each round. Prints the median seconds of lowering and
of compiling each.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments.lab import cli
from experiments.lab.output_files import write_json
from experiments.lab.program import run_main
from ultraep_jax import tools

_EP_SIZES = flags.DEFINE_list("ep_sizes", ["8", "64"], "EP sizes R.")
_FANOUTS = flags.DEFINE_list("fanouts", ["1", "2"], "Relay bounds f (max_fanout).")
_DOMAIN = flags.DEFINE_integer("ranks_per_domain", None, "Ranks per fast domain (None: one).")
_SLOTS = flags.DEFINE_integer("slots", 2, "Spare slots per rank S.")
_EXPERTS_PER_RANK = flags.DEFINE_integer("experts_per_rank", 2, "Masters per rank E_m.")
_BATCH = flags.DEFINE_integer("batch", 64, "Plans in the batch N (vmap, lax.map).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Fresh compilations per variant (median).")
_JSON = cli.define_json_out()


def lower_and_compile(fn, operand) -> tuple[float, float]:
    """(seconds to lower, seconds to compile) ``jax.jit(fn)`` for ``operand``."""
    start = time.perf_counter()
    lowered = jax.jit(fn).lower(operand)
    lowered_at = time.perf_counter()
    lowered.compile()
    return lowered_at - start, time.perf_counter() - lowered_at


def variants(ep_size: int, fanout: int) -> dict:
    """name -> (function, operand): the schedule of one plan, and of a batch by vmap and lax.map
    (new closures each call, so nothing is reused from an earlier compilation)."""
    em, d = _EXPERTS_PER_RANK.value, _DOMAIN.value
    rng = np.random.default_rng(0)
    batch = rng.integers(-1, ep_size * em, size=(_BATCH.value, ep_size, _SLOTS.value))
    batch = jnp.asarray(batch, jnp.int32)

    def one(slots_RS):
        return tools.relay_schedule(slots_RS, em, fanout, d)

    return {
        "plain": (one, batch[0]),
        "vmap": (jax.vmap(one), batch),
        "lax.map": (lambda b: jax.lax.map(one, b), batch),
    }


def main(argv) -> None:
    del argv
    jax.config.update("jax_enable_compilation_cache", False)
    rows = []
    for ep_size in map(int, _EP_SIZES.value):
        for fanout in map(int, _FANOUTS.value):
            times = {}
            for _ in range(_REPEATS.value):
                for name, (fn, operand) in variants(ep_size, fanout).items():
                    times.setdefault(name, []).append(lower_and_compile(fn, operand))
            for name, pairs in times.items():
                lower = statistics.median(p[0] for p in pairs)
                compile_ = statistics.median(p[1] for p in pairs)
                rows.append(dict(ep_size=ep_size, fanout=fanout, variant=name, lower_s=lower,
                                 compile_s=compile_))  # fmt: skip
                print(f"R={ep_size:4d} f={fanout} {name:8s} lower {lower:6.2f} s  "
                      f"compile {compile_:6.2f} s", flush=True)  # fmt: skip
    write_json(_JSON.value, {"devices": str(jax.devices()), "rows": rows})


if __name__ == "__main__":
    run_main(main)
