"""The two rules every experiment applies to rank loads, stated once: where an expert's master
lives (its home rank, `base.layout.Layout.master_rank`) and the imbalance of per-rank
loads (max / mean); and what follows from the first: the instances a layout holds off their
home rank (the weight copies a layer moves). NumPy, host only."""

from __future__ import annotations

import numpy as np

from ultraep_jax.tools import Layout


def home_ranks(num_experts: int, num_ranks: int) -> np.ndarray:
    """int64 ``[E]``: the rank of each expert's master (E divisible by R)."""
    return np.asarray(Layout(num_experts, num_ranks).master_rank(np.arange(num_experts)))


def masters_of_ranks(num_experts: int, num_ranks: int) -> np.ndarray:
    """int32 ``[R, E/R]``: the experts each rank masters, in expert order."""
    home = home_ranks(num_experts, num_ranks)
    order = np.argsort(home, kind="stable")
    return order.astype(np.int32).reshape(num_ranks, num_experts // num_ranks)


def home_rank_loads(expert_load, num_ranks: int) -> np.ndarray:
    """``[R]``: each rank's load when every expert's load ``expert_load [E]`` stays on its
    master (float input gives float64, integer input int64)."""
    expert_load = np.asarray(expert_load)
    dtype = np.float64 if np.issubdtype(expert_load.dtype, np.floating) else np.int64
    out = np.zeros(num_ranks, dtype)
    np.add.at(out, home_ranks(expert_load.size, num_ranks), expert_load)
    return out


def imbalance(rank_load) -> float:
    """max / mean of the per-rank loads ``rank_load [R]``; 1.0 where they hold nothing."""
    rank_load = np.asarray(rank_load)
    total = rank_load.sum()
    return float(rank_load.max() * rank_load.size / total) if total > 0 else 1.0


def held_off_home(layouts, num_experts: int) -> np.ndarray:
    """int32 ``[N, R, C]``: the instances of layouts ``[N, R, C]`` that sit off their expert's
    home rank (each a weight copy; a second instance of an expert on one rank needs no second
    copy), -1 elsewhere: the held matrix the relay schedule (`ultraep_jax.replicas.relay`) moves."""
    layouts = np.asarray(layouts)
    ranks, cols = layouts.shape[1:]
    home = np.arange(ranks)[None, :, None]
    earlier = np.tril(np.ones((cols, cols), bool), k=-1)  # [c, c'] with c' < c
    repeat = np.any((layouts[..., :, None] == layouts[..., None, :]) & earlier, axis=-1)
    off = (layouts >= 0) & (Layout(num_experts, ranks).master_rank(layouts) != home) & ~repeat
    return np.where(off, layouts, -1).astype(np.int32)
