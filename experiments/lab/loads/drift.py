"""Expert-level Zipf load matrices, alone and as a drifting stream (pure NumPy, host only): the
same ``loads [R, E]`` convention, checks and seeding as `experiments.lab.loads.workloads`.

  * :func:`expert_zipf_loads` -- Zipf over experts with a given exponent.
  * :func:`drifting_stream` -- a non-stationary stream ``[steps, R, E]``: expert popularity
    drifts (a random walk on the logits) and occasionally jumps (a random re-ranking).
"""

from __future__ import annotations

import numpy as np

from experiments.lab.loads.workloads import check_layout, pairs_per_rank, zipf_weights
from ultraep_jax.tools import check_int


def expert_zipf_loads(
    ep_size: int, num_experts: int, tokens_per_rank: int, top_k: int, exponent: float, seed: int
) -> np.ndarray:
    """Expert-level Zipf workload.

    Model: a seeded random permutation orders the ``E`` experts by popularity; the expert at
    popularity position ``i`` (``i = 1..E``) is chosen with probability ``i**-exponent / H``
    (``exponent = 0`` is uniform). Every source rank independently draws its
    ``tokens_per_rank * top_k`` (token, choice) pairs from that distribution with a seeded
    multinomial. Because the permutation scatters hot experts over ranks, the rank-level
    imbalance is much lower than the expert-level skew suggests; use :func:`initial_imbalance`
    to read it off.

    Args:
      ep_size: ``R``; num_experts: ``E`` (divisible by ``R``); tokens_per_rank, top_k: pairs per
      source rank are ``tokens_per_rank * top_k``; exponent: Zipf exponent ``>= 0``; seed: int.

    Returns:
      int32 ``[R, E]``; every row sums to ``tokens_per_rank * top_k``.
    """
    ep_size, num_experts = check_layout(ep_size, num_experts)
    n_pairs = pairs_per_rank(ep_size, tokens_per_rank, top_k)
    if not float(exponent) >= 0.0:
        raise ValueError(f"exponent must be >= 0, got {exponent}")
    ss_perm, ss_draw = np.random.SeedSequence(seed).spawn(2)
    order = np.random.default_rng(ss_perm).permutation(num_experts)
    p = np.empty(num_experts, dtype=np.float64)
    p[order] = zipf_weights(num_experts, exponent)
    loads = np.random.default_rng(ss_draw).multinomial(n_pairs, p, size=ep_size)
    return loads.astype(np.int32)


def drifting_stream(
    ep_size: int,
    num_experts: int,
    tokens_per_rank: int,
    top_k: int,
    steps: int,
    seed: int,
    *,
    exponent: float = 0.5,
    drift: float = 0.05,
    reversion: float = 0.02,
    jump_every: float = 50.0,
) -> np.ndarray:
    """A non-stationary stream of load matrices: expert popularity drifts and jumps.

    Model: expert logits start at Zipf logits ``-exponent * log(i)`` (``i = 1..E``) assigned to
    the experts by a seeded random permutation, the same popularity as :func:`expert_zipf_loads`.
    After every step the logits take a random-walk step ``drift * N(0, 1)`` per expert, with a weak
    pull of ``reversion`` times the distance back toward the current base logits (so the skew
    stays stationary instead of growing without bound). Each step, with probability
    ``1 / jump_every`` (a jump every ~``jump_every`` steps), popularity jumps: one random
    permutation re-assigns both the logits and the base logits to other experts, so different
    experts (usually on different ranks) become hot at once. At every step each source rank draws
    its ``tokens_per_rank * top_k`` (token, choice) pairs from ``softmax(logits)`` with a seeded
    multinomial.

    Args:
      ep_size: ``R``; num_experts: ``E`` (divisible by ``R``); tokens_per_rank, top_k: pairs per
        source rank and step are ``tokens_per_rank * top_k``; steps: ``T``; seed: int.
      exponent: Zipf exponent of the base popularity (``>= 0``; 0.5 gives an initial max/mean of
        about 2.8 at EP64 / 256 experts); drift: std of the per-step logit step (``>= 0``);
        reversion: pull toward the base logits per step, in ``[0, 1]``; jump_every: mean steps
        between jumps (``>= 1``; ``inf`` for none).

    Returns:
      int32 ``[T, R, E]``; every ``[R, E]`` row of every step sums to ``tokens_per_rank * top_k``.
    """
    ep_size, num_experts = check_layout(ep_size, num_experts)
    n_pairs = pairs_per_rank(ep_size, tokens_per_rank, top_k)
    steps = check_int("steps", steps)
    if not float(exponent) >= 0.0:
        raise ValueError(f"exponent must be >= 0, got {exponent}")
    if not float(drift) >= 0.0:
        raise ValueError(f"drift must be >= 0, got {drift}")
    if not 0.0 <= float(reversion) <= 1.0:
        raise ValueError(f"reversion must lie in [0, 1], got {reversion}")
    if not float(jump_every) >= 1.0:
        raise ValueError(f"jump_every must be >= 1, got {jump_every}")

    ss_perm, *rest = np.random.SeedSequence(seed).spawn(4)
    walk_rng, jump_rng, draw_rng = (np.random.default_rng(ss) for ss in rest)
    base = np.empty(num_experts, dtype=np.float64)
    base[np.random.default_rng(ss_perm).permutation(num_experts)] = -float(exponent) * np.log(
        np.arange(1, num_experts + 1, dtype=np.float64)
    )
    logits = base.copy()
    out = np.empty((steps, ep_size, num_experts), dtype=np.int32)
    for t in range(steps):
        p = np.exp(logits - logits.max())
        out[t] = draw_rng.multinomial(n_pairs, p / p.sum(), size=ep_size)
        logits = (
            logits
            + float(reversion) * (base - logits)
            + float(drift) * walk_rng.standard_normal(num_experts)
        )
        if jump_rng.random() < 1.0 / float(jump_every):
            perm = jump_rng.permutation(num_experts)
            logits, base = logits[perm], base[perm]
    return out
