"""The report of `experiments.bench.memory`: its table, the balanced layer's temporaries over the
ideal's, and the temporaries one more receive-buffer row adds."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from experiments.bench.memory_config import MemoryConfig


def per_buffer_row(rows: list[dict], config: MemoryConfig) -> dict[int, float | None]:
    """{EP size: temporaries that one more receive-buffer row adds, in rows of D (x D x the
    dtype's bytes)}: the slope between plain dropless and plain at --plain_factor, two programs
    that differ in their buffer alone; None where either is missing."""
    out = {}
    for ep_size in sorted({r["ep_size"] for r in rows}):
        by_mode = {r["mode"]: r for r in rows if r["ep_size"] == ep_size}
        if {"dropless", "plain"} <= set(by_mode):
            big, small = by_mode["dropless"], by_mode["plain"]
            extra_rows = big["capacity_rows"] - small["capacity_rows"]
            row_bytes = config.d_model * config.itemsize
            slope = (big["temp_bytes"] - small["temp_bytes"]) / (extra_rows * row_bytes)
            out[ep_size] = slope if extra_rows > 0 else None
        else:
            out[ep_size] = None
    return out


def balanced_excess(rows: list[dict]) -> dict[int, tuple[int, int]]:
    """{EP size: (balanced temporaries - the ideal's, one replica block), bytes} where both
    layers were compiled."""
    out = {}
    for ep_size in sorted({r["ep_size"] for r in rows}):
        by_mode = {r["mode"]: r for r in rows if r["ep_size"] == ep_size}
        if {"balanced", "ideal"} <= set(by_mode):
            bal = by_mode["balanced"]
            excess = bal["temp_bytes"] - by_mode["ideal"]["temp_bytes"]
            out[ep_size] = (excess, bal["replica_block_bytes"])
    return out


MODE_NAMES = {
    "balanced": "balanced@{balanced_factor:g}",
    "balanced_dropless": "bal. dropless",
    "dropless": "plain dropless",
    "plain": "plain@{plain_factor:g}",
    "ideal": "ideal@{balanced_factor:g}",
}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def compiled_for(config: MemoryConfig) -> str:
    """What the figures were compiled for: simulated CPU devices, or compile-only GPUs."""
    if config.device_kind is None:
        return "compiled for simulated CPU devices"
    return f"compiled with XLA:GPU for compile-only {config.device_kind}s (nodes of 8)"


def _ratio(value: float | None) -> str:
    return f"{value:.3f}" if value else "-"


def table(rows: list[dict], config: MemoryConfig) -> list[str]:
    """The report's lines: a header naming the shape and the target, one line per (EP size,
    mode), and the temporaries per receive-buffer row."""
    c = config
    lines = [
        f"MoE layer training step (loss, d/dx, d/dparams), XLA's memory analysis per device, "
        f"{compiled_for(c)}, never run: D={c.d_model} F={c.d_ff} "
        f"E={c.num_experts} top-{c.top_k}, {c.tokens_per_rank} tokens/rank, {c.dtype}, "
        f"S={c.slots_per_rank} (balanced), expert_kernel={c.expert_kernel}",
        f"{'EP':>4} {'layer':>15} {'rows':>8} {'temp GiB':>9} {'/ideal':>7} {'peak GiB':>9} "
        f"{'/ideal':>7} {'args GiB':>9} {'out GiB':>8} {'code':>5} {'recv GiB':>9} "
        f"{'recv %':>7} {'a2a blk':>8} {'repl blk':>9}",
    ]
    for r in rows:
        name = MODE_NAMES[r["mode"]].format(**dataclasses.asdict(c))
        code = _gib(r["generated_code_bytes"]) if r["generated_code_bytes"] else "-"
        lines.append(
            f"{r['ep_size']:>4} {name:>15} {r['capacity_rows']:>8} {_gib(r['temp_bytes']):>9} "
            f"{_ratio(r['temp_vs_ideal']):>7} {_gib(r['peak_bytes']):>9} "
            f"{_ratio(r['peak_vs_ideal']):>7} {_gib(r['argument_bytes']):>9} "
            f"{_gib(r['output_bytes']):>8} {code:>5} {_gib(r['receive_buffer_bytes']):>9} "
            f"{r['receive_share']:>7.1%} {_gib(r['exchange_block_bytes']):>8} "
            f"{_gib(r['replica_block_bytes']):>9}"
        )
    excess = balanced_excess(rows)
    if excess:
        text = ", ".join(
            f"EP{r} {e / 2**30:+.2f} GiB ({e / block:+.1f} repl blk)"
            for r, (e, block) in excess.items()
        )
        lines.append(f"balanced temporaries over the ideal's: {text}")
    slopes = per_buffer_row(rows, c)
    known = {r: s for r, s in slopes.items() if s is not None}
    lines += [
        "rows: receive-buffer rows per rank (MoE.capacity); temp, peak: XLA's temporaries and "
        "peak memory (arguments included) per device, /ideal: over the ideal's; recv: rows x D "
        "x dtype bytes; recv %: of the temporaries; a2a blk: one block of the portable (CPU) "
        "token exchange, R x min(pairs, rows) x D x dtype bytes (a GPU's ragged all-to-all has "
        "none: 0); repl blk: one block of the replica weight transfer, R x S x 3 x D x F x dtype "
        "bytes; code: generated code (XLA:CPU reports 0: -); GiB = 2**30 bytes.",
    ]
    if known:
        text = ", ".join(f"EP{r} {s:.1f}" for r, s in known.items())
        lines.append(
            "temporaries per receive-buffer row (plain dropless against plain capped), in rows of "
            f"D x dtype bytes: {text}"
        )
    return lines
