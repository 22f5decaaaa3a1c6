"""Expert-load workloads for evaluating the planner (pure NumPy, host only).

Every generator here returns ``loads``: an int32 matrix of shape ``[R, E]`` where ``loads[r, e]``
is the number of (token, choice) pairs on source rank ``r`` that the router sent to expert ``e``.
``R`` is the EP size, ``E`` the number of logical experts, and expert ``e``'s master is on its
home rank (`experiments.lab.loads.ranks.home_ranks`). Each top-k choice counts once, so a source
rank that holds ``tokens_per_rank`` tokens contributes ``tokens_per_rank * top_k`` pairs and every
row of a generated matrix sums to exactly that.

Generated workloads:
  * :func:`rank_zipf_loads` -- UltraEP-style rank-level Zipf, with the exponent solved so the
    initial (master-only) max/mean rank load hits a target such as 1.5 / 2.0 / 3.0
    (:func:`rank_zipf_exponent` says which exponent).
  * `experiments.lab.loads.drift`: Zipf over experts with a given exponent (``expert_zipf_loads``)
    and a non-stationary stream of them (``drifting_stream``).

Measured workloads (the trace files are read, and every layer of a trace turned into ``loads``,
by `experiments.lab.loads.traces`):
  * :func:`loads_from_expert_counts` -- turns a per-expert count vector into ``loads[R, E]``.

Metrics: :func:`master_rank_loads`, :func:`initial_imbalance`. Checks and weights that
`experiments.lab.loads.drift` and `traces` share: :func:`check_layout`, :func:`pairs_per_rank`,
:func:`zipf_weights`.

None of this imports JAX; all randomness goes through ``numpy.random.Generator`` seeded from the
``seed`` argument, so the same arguments always give the same matrix.
"""

from __future__ import annotations

import numpy as np

from experiments.lab.loads import ranks
from ultraep_jax.tools import check_int

__all__ = [
    "check_layout",
    "initial_imbalance",
    "loads_from_expert_counts",
    "master_rank_loads",
    "pairs_per_rank",
    "rank_zipf_exponent",
    "rank_zipf_loads",
    "zipf_weights",
]

#: Default Dirichlet concentration for splitting a rank's share among its masters.
DEFAULT_DIRICHLET_ALPHA = 1.0


# --------------------------------------------------------------------------------------------
# Argument checks and metrics
# --------------------------------------------------------------------------------------------


def check_layout(ep_size, num_experts) -> tuple[int, int]:
    """``(ep_size, num_experts)`` checked: ints >= 1, ``num_experts`` divisible by ``ep_size``
    (ValueError otherwise)."""
    ep_size = check_int("ep_size", ep_size)
    num_experts = check_int("num_experts", num_experts)
    if num_experts % ep_size != 0:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
    return ep_size, num_experts


def pairs_per_rank(ep_size: int, tokens_per_rank, top_k) -> int:
    """Checked ``tokens_per_rank * top_k``, the pairs each of ``ep_size`` source ranks sends
    (their total must fit int32 loads)."""
    tokens_per_rank = check_int("tokens_per_rank", tokens_per_rank)
    top_k = check_int("top_k", top_k)
    n_pairs = tokens_per_rank * top_k
    if ep_size * n_pairs > np.iinfo(np.int32).max:
        raise ValueError("ep_size * tokens_per_rank * top_k overflows int32 loads")
    return n_pairs


def master_rank_loads(loads) -> np.ndarray:
    """Master-only rank loads of a load matrix.

    Args:
      loads: ``[R, E]`` (int) with ``E % R == 0``; ``loads[r, e]`` = pairs from source rank ``r``
        to expert ``e``.

    Returns:
      int64 ``[R]``: ``L_d`` = sum of ``load_e = sum_r loads[r, e]`` over the ``E // R`` masters of
      rank ``d``, i.e. the load each rank carries when nothing is replicated.
    """
    loads = np.asarray(loads)
    if loads.ndim != 2:
        raise ValueError(f"loads must be 2-D [R, E], got shape {loads.shape}")
    num_ranks, num_experts = loads.shape
    check_layout(num_ranks, num_experts)
    return ranks.home_rank_loads(loads.sum(axis=0, dtype=np.int64), num_ranks)


def initial_imbalance(loads) -> float:
    """Initial (master-only) imbalance ``max(L) / mean(L)`` of ``loads[R, E]``.

    ``L = master_rank_loads(loads)``; 1.0 is perfectly balanced and ``R`` is the worst case (every
    pair on one rank). Raises ValueError when the matrix holds no pairs.
    """
    rank_load = master_rank_loads(loads)
    if int(rank_load.sum()) <= 0:
        raise ValueError("loads holds no (token, choice) pairs; imbalance is undefined")
    return ranks.imbalance(rank_load)


# --------------------------------------------------------------------------------------------
# Generated workloads
# --------------------------------------------------------------------------------------------


def zipf_weights(n: int, exponent: float) -> np.ndarray:
    """Normalised Zipf weights ``i**-exponent / H`` for popularity positions ``i = 1..n``."""
    log_w = -float(exponent) * np.log(np.arange(1, n + 1, dtype=np.float64))
    w = np.exp(log_w - log_w.max())
    return w / w.sum()


#: Relative tolerance of the rank-Zipf bisection on the realised imbalance.
_ZIPF_RTOL = 1e-4


def _rank_zipf_args(ep_size: int, tokens_per_rank, top_k, target_imbalance) -> tuple[int, float]:
    """Checked ``(pairs per source rank, target imbalance)`` of a rank-Zipf workload."""
    n_pairs = pairs_per_rank(ep_size, tokens_per_rank, top_k)
    target = float(target_imbalance)
    if not (1.0 <= target < ep_size):
        raise ValueError(
            f"target_imbalance must lie in [1, ep_size={ep_size}), got {target_imbalance}"
        )
    return n_pairs, target


def _rank_zipf_seeds(seed) -> list:
    """The rank-Zipf seed streams: permutation, Dirichlet split, uniforms, expert split."""
    return np.random.SeedSequence(seed).spawn(4)


def _rank_level_counts(R: int, n_pairs: int, target: float, uniforms_seed) -> tuple:
    """The rank-level draw of :func:`rank_zipf_loads` (its steps 1, 3 and 4).

    Returns:
      ``(counts, s)``: int64 ``[R_src, R_pos]``, the pairs from each source rank to each
      popularity position, and the Zipf exponent ``s >= 0`` whose realised master-only imbalance
      is nearest ``target``.
    """
    # Common random numbers: source rank r's pairs are n_pairs sorted uniforms. The number of
    # them inside popularity position i's CDF interval is a multinomial draw of the rank-level
    # counts, and because the intervals are laid out hottest first, the hottest rank's count is
    # non-decreasing in the exponent for fixed uniforms, so bisection on the *realised*
    # imbalance is well behaved. Offsetting row r by r lets one searchsorted serve all rows.
    unif = np.random.default_rng(uniforms_seed).random((R, n_pairs))
    unif.sort(axis=1)
    unif += np.arange(R, dtype=np.float64)[:, None]
    flat = unif.ravel()
    row_start = np.arange(R, dtype=np.int64) * n_pairs

    def rank_counts(exponent: float) -> np.ndarray:
        """[R_src, R_pos] pairs from each source rank to each popularity position."""
        cdf = np.concatenate(([0.0], np.cumsum(zipf_weights(R, exponent))))
        cdf[-1] = 1.0
        edges = np.searchsorted(flat, cdf[None, :] + np.arange(R)[:, None], side="left")
        edges = edges - row_start[:, None]
        edges[:, 0] = 0
        edges[:, -1] = n_pairs
        return np.diff(edges, axis=1)

    def realised(exponent: float) -> tuple[float, np.ndarray]:
        counts = rank_counts(exponent)
        return ranks.imbalance(counts.sum(axis=0)), counts

    best_s, (best_f, best_counts) = 0.0, realised(0.0)
    if best_f < target:
        lo, hi = 0.0, 1.0
        f_hi, c_hi = realised(hi)
        while f_hi < target and hi < 1024.0:
            lo, hi = hi, hi * 2.0
            f_hi, c_hi = realised(hi)
        if abs(f_hi - target) < abs(best_f - target):
            best_s, best_f, best_counts = hi, f_hi, c_hi
        for _ in range(200):
            if abs(best_f - target) <= _ZIPF_RTOL * target or hi - lo <= 1e-12 * max(hi, 1.0):
                break
            mid = 0.5 * (lo + hi)
            f_mid, c_mid = realised(mid)
            if abs(f_mid - target) < abs(best_f - target):
                best_s, best_f, best_counts = mid, f_mid, c_mid
            if f_mid < target:
                lo = mid
            else:
                hi = mid
    # else: even uniform rank popularity overshoots the target (sampling noise / Dirichlet-free
    # rank level); exponent 0 is the closest this model gets.
    return best_counts, best_s


def rank_zipf_exponent(
    ep_size: int, tokens_per_rank: int, top_k: int, target_imbalance: float, seed: int
) -> float:
    """The Zipf exponent ``s`` that :func:`rank_zipf_loads` finds for these arguments (its
    ``num_experts`` and ``dirichlet_alpha`` do not change it)."""
    ep_size = check_int("ep_size", ep_size)
    n_pairs, target = _rank_zipf_args(ep_size, tokens_per_rank, top_k, target_imbalance)
    return _rank_level_counts(ep_size, n_pairs, target, _rank_zipf_seeds(seed)[2])[1]


def rank_zipf_loads(
    ep_size: int,
    num_experts: int,
    tokens_per_rank: int,
    top_k: int,
    target_imbalance: float,
    seed: int,
    *,
    dirichlet_alpha: float = DEFAULT_DIRICHLET_ALPHA,
) -> np.ndarray:
    """UltraEP-style rank-level Zipf workload with a prescribed initial imbalance.

    Model:
      1. A seeded random permutation orders the ``R`` ranks by popularity. The rank at popularity
         position ``i`` (``i = 1..R``) gets the share ``i**-s / sum_j j**-s`` of all pairs.
      2. A rank's share is split among its ``E // R`` masters by a seeded flat Dirichlet
         (concentration ``dirichlet_alpha``, default 1.0, i.e. uniform over the simplex). 1.0 is
         the parameter-free choice: it does not change the rank-level imbalance (which depends on
         rank shares only) and gives moderate skew inside a rank (with 4 masters the largest
         takes about 52 % of the rank's share on average), so a hot rank's excess usually sits on
         one or two hot experts that need several replicas, as in real MoE layers, without
         leaving most masters empty (small alpha) or making every expert of a rank equal (large
         alpha).
      3. Every source rank independently draws its ``tokens_per_rank * top_k`` (token, choice)
         pairs from the resulting expert distribution ``p_e = share(rank(e)) * split(e)`` with a
         seeded multinomial (each pair is one independent draw; a token may therefore pick one
         expert twice, which does not matter for load matrices). The draw is done in two exact
         stages, rank level then expert level within a rank.
      4. The exponent ``s >= 0`` is found by bisection on the *realised* master-only imbalance
         ``max_d L_d / mean_d L_d`` of the sampled matrix (the rank-level draw uses fixed sorted
         uniforms, so the draw varies smoothly with ``s``), stopping within ``1e-4`` relative of
         ``target_imbalance`` -- far inside the 0.5 % asked for; the result is within a few pairs
         of the target for the reference size. If even ``s = 0`` (uniform ranks, sampling noise
         only) is above the target, the ``s = 0`` matrix is returned.

    Reference setup (the UltraEP paper's): ``ep_size=64, num_experts=256,
    tokens_per_rank=8192, top_k=8``, targets 1.5 / 2.0 / 3.0.

    Memory: holds ``ep_size * tokens_per_rank * top_k`` float64 uniforms (32 MiB for the
    reference setup).

    Args:
      ep_size: ``R``, ranks on the EP axis.
      num_experts: ``E``, logical experts; must be divisible by ``R``.
      tokens_per_rank: tokens held by each source rank.
      top_k: router choices per token.
      target_imbalance: wanted ``max/mean`` of master-only rank loads, in ``[1, R)``.
      seed: integer seed (permutation, Dirichlet split, and both sampling stages derive from it).
      dirichlet_alpha: concentration of the within-rank split (keyword only).

    Returns:
      int32 ``[R, E]``; every row sums to ``tokens_per_rank * top_k``.
    """
    ep_size, num_experts = check_layout(ep_size, num_experts)
    n_pairs, target = _rank_zipf_args(ep_size, tokens_per_rank, top_k, target_imbalance)
    if not dirichlet_alpha > 0:
        raise ValueError(f"dirichlet_alpha must be positive, got {dirichlet_alpha}")
    R, E = ep_size, num_experts
    ss_perm, ss_dir, ss_unif, ss_split = _rank_zipf_seeds(seed)
    # order[i] = rank at popularity position i (position 0 is the hottest).
    order = np.random.default_rng(ss_perm).permutation(R)
    within = np.random.default_rng(ss_dir).dirichlet(np.full(E // R, float(dirichlet_alpha)), R)
    counts, _ = _rank_level_counts(R, n_pairs, target, ss_unif)
    # Place popularity positions on their ranks, then split each (source, destination rank)
    # count among the destination's masters: multinomial(count, within[d]). Composed with the
    # rank-level multinomial this is exactly a multinomial over experts with p_e = share * split.
    to_rank = np.empty((R, R), dtype=np.int64)
    to_rank[:, order] = counts
    per_expert = np.random.default_rng(ss_split).multinomial(to_rank, within)  # [R, R, e_m]
    return per_expert.reshape(R, E).astype(np.int32)


# --------------------------------------------------------------------------------------------
# Load matrices from measured traces (the files: experiments.lab.loads.traces)
# --------------------------------------------------------------------------------------------


def _scale_counts(counts: np.ndarray, total: int) -> np.ndarray:
    """Scale non-negative counts to sum exactly ``total`` (largest-remainder rounding)."""
    counts = np.asarray(counts, dtype=np.float64)
    exact = counts / counts.sum() * total
    scaled = np.floor(exact).astype(np.int64)
    short = int(total - scaled.sum())
    if short > 0:
        # Largest fractional part first; ties go to the lower expert index (stable sort).
        idx = np.argsort(-(exact - scaled), kind="stable")[:short]
        scaled[idx] += 1
    return scaled


def loads_from_expert_counts(
    counts, ep_size: int, tokens_per_rank: int, top_k: int, seed: int
) -> np.ndarray:
    """Turn one per-expert count vector (a trace layer) into a load matrix.

    The traces count tokens per expert only; they do not say which source rank sent them. This
    function (1) scales ``counts`` to a total of ``ep_size * tokens_per_rank * top_k`` pairs
    (largest-remainder rounding, so the total is exact and each expert keeps its share to within
    one pair; experts with 0 stay at 0), then (2) splits each expert's count across the ``R``
    source ranks at random, seeded: the pairs are dealt uniformly at random so that every source
    rank gets exactly ``tokens_per_rank * top_k`` of them (rank by rank, a seeded multivariate
    hypergeometric draw from the pairs not yet dealt). Each expert's split is thus a multinomial
    with equal source probabilities conditioned on the row totals, i.e. no source rank prefers
    any expert. Column sums are the scaled counts and row sums are exactly
    ``tokens_per_rank * top_k``.

    Args:
      counts: ``[E]`` non-negative counts (int or integral float), not all zero.
      ep_size: ``R``; ``E`` must be divisible by it (Qwen1.5-MoE's 60 experts work at EP
        1/2/3/4/5/6/10/12/15/20/30/60, Switch-Base-128 at powers of two up to 128, DeepSeek's
        256 at powers of two up to 256).
      tokens_per_rank, top_k: pairs per source rank are ``tokens_per_rank * top_k``.
      seed: integer seed.

    Returns:
      int32 ``[R, E]``.
    """
    counts = np.asarray(counts)
    if counts.ndim != 1:
        raise ValueError(f"counts must be 1-D [E], got shape {counts.shape}")
    num_experts = counts.shape[0]
    ep_size = check_int("ep_size", ep_size)
    if num_experts == 0 or num_experts % ep_size != 0:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
    n_pairs = pairs_per_rank(ep_size, tokens_per_rank, top_k)
    if np.any(counts < 0) or not np.all(np.isfinite(counts)):
        raise ValueError("counts must be finite and non-negative")
    if counts.sum() <= 0:
        raise ValueError("counts are all zero")

    remaining = _scale_counts(counts, ep_size * n_pairs)
    rng = np.random.default_rng(np.random.SeedSequence(seed))
    loads = np.empty((ep_size, num_experts), dtype=np.int64)
    for r in range(ep_size - 1):
        loads[r] = rng.multivariate_hypergeometric(remaining, n_pairs)
        remaining = remaining - loads[r]
    loads[ep_size - 1] = remaining
    return loads.astype(np.int32)
