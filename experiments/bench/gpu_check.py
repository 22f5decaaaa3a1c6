"""The GPU check: correctness and timings of the GPU path, on one GPU.

        python -m experiments.bench.gpu_check --out=runs/gpu            # on an H100 / H200
        python -m experiments.bench.gpu_check --out=runs/gpu --sections=planner,gmm
        python -m experiments.bench.gpu_check --dry_run                 # anywhere: every section on CPU,
                                                                  # tiny shapes, kernel interpreted

Sections (``--sections``; a table is printed, ``--out/gpu_results.json`` is rewritten after each):

env      the device, its compute capability, the versions of jax, jaxlib, the CUDA plugin, Triton.
planner  (a) the CUDA planner's plans equal the CPU handler's, bit for bit, on random load matrices
         of several configurations (chosen so that every branch of the threshold search is taken:
         fast path, coarse probes, refine probes, none) and on the EP64/E256/S2 reference
         workloads (``workloads.rank_zipf_loads(64, 256, 8192, 8, target, seed)``, targets
         1.5 / 2 / 3); through JAX (``jit(vmap(plan))`` on the GPU vs on the CPU) and through the
         CUDA library's benchmark hook (its one kernel: the core of planner.h on one thread).
         (b) time per plan at EP64/E256/S2: kernel time by CUDA events (the hook: median over
         --repeats launches of one plan, and of a batch of --plan_batch plans divided by the
         batch), and through JAX: a chain of 64 dependent plans in one jitted function (the
         difference to a chain of 8, per plan; includes one tiny fused add per plan), single-plan
         wall latency, batched ``jit(vmap(plan))``.
gmm      (c) grouped matmul, bf16, DeepSeek-V3's expert shape: K = 7168 (d_model), N = 2048
         (expert d_ff): TFLOP/s of our Pallas (Triton) kernel (each of --gmm_configs), of JAX's
         Hopper Mosaic GPU ragged-dot kernels (each of --mgpu_configs), of ``jax.lax.ragged_dot``
         and of a dense [M, K] @ [K, N] matmul of the same FLOPs, forward and forward + backward,
         at M = --gmm_rows, G = 8, balanced; then the fastest of each kind over G in --gmm_groups,
         M in --gmm_sizes, balanced and skewed group sizes (Zipf 1.2 over the groups). Relative
         errors ||out - ref|| / ||ref|| against float32 ``ragged_dot`` of the same bf16 inputs.
moe      (d) the MoE layer (uep.MoE) forward + backward on one GPU (EP = 1 mesh), balancer on vs
         off, for each --moe_kernels expert kernel: median step ms and the ratio; the optimized HLO
         of the balanced step (written to --out) and where its replica-weight path sits in the
         schedule relative to the masters' matmuls.

Timings are medians over --repeats samples; a sample times --inner back-to-back calls and
blocks once (so the host's dispatch overlaps the device's work), divided by --inner.
Without a GPU (and without --dry_run) it prints one line and exits with code 2.
"""

from __future__ import annotations

import os
import sys

if "--dry_run" in sys.argv or "--dry_run=true" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import ctypes
import json
import re
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import ultraep_jax as uep
from experiments import common
from experiments.loads import workloads
from ultraep_jax import _native, gmm

_OUT = flags.DEFINE_string("out", None, "Folder for gpu_results.json and the HLO dump (created).")
_DRY = flags.DEFINE_bool("dry_run", False, "Run every section on CPU with tiny shapes.")
_SECTIONS = flags.DEFINE_list("sections", ["env", "planner", "gmm", "moe"], "Sections to run.")
_REPEATS = flags.DEFINE_integer("repeats", 15, "Timed samples (medians are reported).")
_INNER = flags.DEFINE_integer("inner", 4, "Back-to-back calls per timed sample.")
_PLAN_BATCH = flags.DEFINE_integer("plan_batch", 1024, "Matrices per batched planner call.")
_GMM_ROWS = flags.DEFINE_integer("gmm_rows", 32768, "M of the kernel-settings sweep.")
_GMM_CONFIGS = flags.DEFINE_list(
    "gmm_configs",
    ["128x128x64w4s3", "128x256x64w8s3", "64x128x64w4s4", "128x128x32w4s4", "256x128x64w8s3"],
    "Triton kernel settings to time: TMxTNxTK, then w<num_warps>s<num_stages>.",
)
_MGPU_CONFIGS = flags.DEFINE_list(
    "mgpu_configs",
    ["128x128x64c4g1", "128x128x64c4g4", "128x192x64c4g4", "128x128x64c6g8", "64x128x64c6g4"],
    "Mosaic GPU ragged-dot settings: BMxBNxBK, then c<max_concurrent_steps>g<grid_block_n>.",
)
_GMM_GROUPS = flags.DEFINE_list("gmm_groups", ["8", "32"], "G of the shape sweep.")
_GMM_SIZES = flags.DEFINE_list("gmm_sizes", ["16384", "65536"], "M of the shape sweep.")
_MOE_TOKENS = flags.DEFINE_integer("moe_tokens", 8192, "Tokens per MoE step (d).")
_MOE_KERNELS = flags.DEFINE_list(
    "moe_kernels",
    ["auto"],
    "MoE rows: expert kernels, each optionally with /<comm_backend> (e.g. auto/portable).",
)
_DUMP_HLO = flags.DEFINE_bool("dump_hlo", True, "Write the balanced MoE step's optimized HLO.")
_PROFILE = flags.DEFINE_bool(
    "profile", True, "Profile the first MoE row's steps (device time per kernel name)."
)

TARGETS = (1.5, 2.0, 3.0)


# -- timing ------------------------------------------------------------------------------------


def _block(tree):
    return jax.block_until_ready(tree)


def _median_s(fn, repeats: int, inner: int = 1) -> float:
    """Median seconds per call of ``fn()`` over ``repeats`` samples of ``inner`` back-to-back
    calls (blocking once per sample), after one warm-up call."""
    _block(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = [fn() for _ in range(inner)]
        _block(outs)
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def _adaptive_median_s(fn, repeats: int, inner: int) -> float:
    """`_median_s`, with fewer samples for calls slower than 20 ms."""
    start = time.perf_counter()
    _block(fn())
    once = time.perf_counter() - start
    if once > 0.02:
        return _median_s(fn, max(3, repeats // 4), 1)
    return _median_s(fn, repeats, inner)


# -- env ---------------------------------------------------------------------------------------


def section_env(device, dry: bool) -> dict:
    import importlib.metadata as md

    out = {"device_kind": getattr(device, "device_kind", str(device))}
    out["compute_capability"] = str(getattr(device, "compute_capability", ""))
    out["core_count"] = getattr(device, "core_count", None)
    for pkg in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "triton", "flax"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    out["cuda_planner_handler"] = _native.has_cuda_handler()
    return out


# -- planner -----------------------------------------------------------------------------------


def random_loads(rng, n: int, R: int, E: int, tokens=4096, exponent=(0.0, 2.0)) -> np.ndarray:
    """int32 [n, R, E]: skewed random load matrices (random Zipf-like popularity per matrix)."""
    out = np.empty((n, R, E), np.int32)
    for i in range(n):
        p = (rng.permutation(E) + 1.0) ** -rng.uniform(*exponent)
        out[i] = rng.multinomial(int(rng.integers(0, tokens)), p / p.sum(), size=R)
    return out


def reference_loads(R: int, E: int, tokens: int, n: int) -> np.ndarray:
    """int32 [n, R, E]: the rank-Zipf reference workloads (targets 1.5 / 2 / 3, seeds 0..)."""
    return np.stack(
        [workloads.rank_zipf_loads(R, E, tokens, 8, TARGETS[s % 3], s) for s in range(n)]
    )


def planner_cases(dry: bool) -> dict:
    """name -> (BalancerConfig, int32 [n, R, E]): configurations that between them take every
    branch of the threshold search (checked with tests/reference_planner.py: the first is mostly
    fast-path, the second mostly coarse + refine probes, the third has searches that find
    nothing), the reference workloads, large R and S, and the no-search cases."""
    rng = np.random.default_rng(0)
    Cfg = uep.BalancerConfig
    cases = {
        "random_EP8_E64_S2_F16": (
            Cfg(64, 8, 2, min_tokens_per_replica=16),
            random_loads(rng, 200, 8, 64),
        ),
        "random_EP16_E32_S1_F256_eps0": (
            Cfg(32, 16, 1, min_tokens_per_replica=256, balance_eps=0.0),
            random_loads(rng, 100, 16, 32, 8192, (1.0, 3.0)),
        ),
        "random_EP8_E16_S1_F64_K200": (
            Cfg(16, 8, 1, min_tokens_per_replica=64, balance_eps=0.05, master_keep_tokens=200),
            random_loads(rng, 100, 8, 16, 4096, (0.5, 3.0)),
        ),
        "random_EP32_E64_S3_F1_K0_eps0": (
            Cfg(64, 32, 3, min_tokens_per_replica=1, balance_eps=0.0, master_keep_tokens=0),
            random_loads(rng, 100, 32, 64, 2048, (0.0, 2.5)),
        ),
        "random_EP4_E8_S0": (Cfg(8, 4, 0), random_loads(rng, 10, 4, 8)),
        "random_EP1_E8_S2": (Cfg(8, 1, 2, min_tokens_per_replica=16), random_loads(rng, 10, 1, 8)),
    }
    if dry:
        cases["zipf_EP8_E32_S2"] = (Cfg(32, 8, 2), reference_loads(8, 32, 8192, 6))
        return {k: (c, v[:8]) for k, (c, v) in cases.items()}
    cases["zipf_EP64_E256_S2"] = (Cfg(256, 64, 2), reference_loads(64, 256, 8192, 6))
    cases["random_EP128_E512_S2_F64"] = (
        Cfg(512, 128, 2, min_tokens_per_replica=64),
        random_loads(rng, 20, 128, 512, 16384),
    )
    cases["random_EP256_E256_S4_F16"] = (
        Cfg(256, 256, 4, min_tokens_per_replica=16),
        random_loads(rng, 10, 256, 256, 4096),
    )
    return cases


def _plan_arrays(plan) -> list[np.ndarray]:
    return [
        np.asarray(a)
        for a in (plan.slot_expert, plan.slot_quota, plan.master_quota, plan.rank_load)
    ]


def _cpu_plans(cfg, loads) -> list[np.ndarray]:
    planner = common.batched_planner(cfg)
    return _plan_arrays(planner(jax.device_put(loads, jax.devices("cpu")[0])))


def _bench_lib():
    path = _native._find(_native._CUDA_LIB)
    lib = ctypes.cdll.LoadLibrary(str(path))
    fn = lib.ultraep_plan_cuda_bench
    i64, i32p = ctypes.c_int64, ctypes.POINTER(ctypes.c_int32)
    fn.argtypes = [
        i64,  # R
        i64,  # E
        i64,  # S
        i64,  # min_tokens_per_replica
        i64,  # master_keep_tokens
        ctypes.c_double,  # balance_eps
        i64,  # capacity (0: unbounded)
        i64,  # count
        i32p,  # loads [count, R, E]
        ctypes.c_int,  # iters
        ctypes.POINTER(ctypes.c_float),  # times_ms [iters]
        i32p,  # slot_expert [count, R, S]
        i32p,  # slot_quota [count, R, S]
        i32p,  # master_quota [count, E]
        i32p,  # rank_load [count, R]
    ]
    fn.restype = ctypes.c_int
    return fn


def cuda_bench(cfg, loads: np.ndarray, iters: int, capacity: int | None = None):
    """Runs the CUDA library's hook: (plans as 4 int32 arrays, per-launch ms of ``iters``
    launches of the whole batch). ``capacity`` as in ``uep.plan`` (None: unbounded)."""
    fn = _bench_lib()
    loads = np.ascontiguousarray(loads, np.int32)
    n, R, E = loads.shape
    S = cfg.slots_per_rank
    outs = [
        np.zeros((n, R, S), np.int32),
        np.zeros((n, R, S), np.int32),
        np.zeros((n, E), np.int32),
        np.zeros((n, R), np.int32),
    ]
    times = np.zeros(max(iters, 1), np.float32)

    def p32(a):
        return a.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))

    err = fn(
        R,
        E,
        S,
        cfg.min_tokens_per_replica,
        cfg.master_keep_tokens,
        float(cfg.balance_eps),
        0 if capacity is None else int(capacity),
        n,
        p32(loads),
        iters,
        times.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
        *(p32(o) for o in outs),
    )
    if err:
        raise RuntimeError(f"ultraep_plan_cuda_bench: CUDA error {err}")
    return outs, times[:iters]


def section_planner(device, dry: bool) -> dict:
    if not _native.has_cuda_handler() and not dry:
        return {"status": "skipped: the CUDA planner handler is not built into this install"}
    out = {"check": {}, "time": {}}
    ok = True
    for name, (cfg, loads) in planner_cases(dry).items():
        want = _cpu_plans(cfg, loads)
        got = _plan_arrays(common.batched_planner(cfg)(jax.device_put(loads, device)))
        row = {"matrices": int(loads.shape[0]), "jax_equal": all(map(np.array_equal, want, got))}
        if not dry:
            plans, _ = cuda_bench(cfg, loads, 0)
            row["hook_equal"] = all(map(np.array_equal, want, plans))
        ok &= all(v for k, v in row.items() if k.endswith("_equal"))
        out["check"][name] = row
        print(f"  planner {name}: {row}", flush=True)
    if not dry:
        # Invalid input: a negative load gives -1 everywhere (the CPU handler raises instead).
        cfg = uep.BalancerConfig(64, 8, 2, min_tokens_per_replica=16)
        bad = random_loads(np.random.default_rng(5), 4, 8, 64)
        bad[1, 3, 7] = -5
        plans, _ = cuda_bench(cfg, bad, 0)
        neg = all(np.all(p[1] == -1) for p in plans) and all(np.all(p[0] >= 0) for p in plans[3:])
        out["check"]["negative_load_gives_minus_one"] = neg
        ok &= bool(neg)
    out["status"] = "ok" if ok else "MISMATCH"
    if dry:
        return out

    # (b) Time at EP64/E256/S2.
    R, E = 64, 256
    cfg = uep.BalancerConfig(E, R, 2)
    base = reference_loads(R, E, 8192, 6)
    t = out["time"]
    t["setup"] = "EP64/E256/S2, rank_zipf_loads 8192 tokens x top-8, targets 1.5/2/3"
    reps = max(_REPEATS.value, 50)
    singles = []
    for s in range(3):
        _, ms = cuda_bench(cfg, base[s : s + 1], reps)
        singles.append(float(np.median(ms)) * 1e3)
    _, ms = cuda_bench(cfg, base[np.arange(_PLAN_BATCH.value) % 6], 10)
    t["event_us_single_by_target"] = singles
    t["event_us_per_plan_batched"] = float(np.median(ms)) * 1e3 / _PLAN_BATCH.value
    print(
        f"  planner time: {singles} us single, "
        f"{t['event_us_per_plan_batched']:.2f} us/plan batched",
        flush=True,
    )

    one = jax.device_put(base[0], device)

    def chain(n):
        def f(loads):
            def body(_, carry):
                x, acc = carry
                p = uep.plan(x, cfg)
                bump = (p.rank_load[0] < 0).astype(jnp.int32)  # always 0; XLA cannot know
                return x + bump, acc + p.rank_load[0]

            return jax.lax.fori_loop(0, n, body, (loads, jnp.int32(0)), unroll=True)[1]

        return jax.jit(f)

    c64, c8 = chain(64), chain(8)
    t64 = _median_s(lambda: c64(one), _REPEATS.value)
    t8 = _median_s(lambda: c8(one), _REPEATS.value)
    t["jax_chain_us_per_plan"] = 1e6 * (t64 - t8) / 56
    single = jax.jit(lambda x: uep.plan(x, cfg))
    t["jax_single_plan_wall_us"] = 1e6 * _median_s(lambda: single(one), _REPEATS.value)
    loads = base[np.arange(_PLAN_BATCH.value) % 6]
    seconds = common.time_batched_plan(loads, cfg, _REPEATS.value, device)
    t["jax_batched_us_per_plan"] = 1e6 * seconds / _PLAN_BATCH.value
    return out


# -- grouped matmul ----------------------------------------------------------------------------


def _parse_config(text: str) -> dict:
    tiles, _, rest = text.partition("w")
    tm, tn, tk = (int(v) for v in tiles.split("x"))
    warps, _, stages = rest.partition("s")
    return {
        "tile_m": tm,
        "tile_n": tn,
        "tile_k": tk,
        "num_warps": int(warps) if warps else None,
        "num_stages": int(stages) if stages else None,
    }


def _parse_mgpu(text: str) -> gmm.MgpuTiles:
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)c(\d+)g(\d+)", text)
    if not m:
        raise ValueError(f"bad mgpu config {text!r}")
    return gmm.MgpuTiles(*(int(v) for v in m.groups()))


def group_sizes(M: int, G: int, skewed: bool) -> np.ndarray:
    """int32 [G] summing to M: equal, or Zipf 1.2 over the groups (largest first)."""
    p = np.ones(G) if not skewed else (np.arange(1, G + 1) ** -1.2)
    sizes = np.floor(M * p / p.sum()).astype(np.int64)
    sizes[0] += M - sizes.sum()
    return sizes.astype(np.int32)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _per_group_reference(sizes: np.ndarray, grads: bool):
    """float32 (full precision) reference from one dense product per group (static slices):
    the forward [M, N], or the gradients (d_lhs, d_rhs) of sum(out * cot)."""
    bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    hi = jax.lax.Precision.HIGHEST

    def f(lhs, rhs, cot):
        lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
        parts = []
        for g in range(len(sizes)):
            s, e = bounds[g], bounds[g + 1]
            if not grads:
                parts.append(jnp.dot(lhs[s:e], rhs[g], precision=hi))
            else:
                parts.append(
                    (
                        jnp.dot(cot[s:e], rhs[g].T, precision=hi),
                        jnp.dot(lhs[s:e].T, cot[s:e], precision=hi),
                    )
                )
        if not grads:
            return jnp.concatenate(parts)
        return jnp.concatenate([p[0] for p in parts]), jnp.stack([p[1] for p in parts])

    return jax.jit(f)


def _fwd_bwd(mm):
    """Forward and backward: the loss value too, so that the forward product is not dead code
    (the loss is linear in it: without the value, jax.grad would need only the two backward
    products)."""

    def loss(lhs, rhs, gs, cot):
        return jnp.sum(mm(lhs, rhs, gs).astype(jnp.float32) * cot)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _impls(dry: bool, configs, mgpu_configs) -> dict:
    impls = {"ragged_dot": jax.lax.ragged_dot}
    for text in configs:
        kw = _parse_config(text)
        impls[f"pallas {text}"] = lambda x, r, g, kw=kw: gmm.grouped_matmul(
            x, r, g, interpret=dry, **kw
        )
    if not dry:
        for text in mgpu_configs:
            tiles = _parse_mgpu(text)
            impls[f"mgpu {text}"] = lambda x, r, g, tiles=tiles: gmm.grouped_matmul_mgpu(
                x, r, g, tiles=tiles
            )
    return impls


def _gmm_case(device, dry, M, K, N, G, skewed, impls, check_grads, seed=0) -> list[dict]:
    rng = np.random.default_rng(seed)
    dt = jnp.bfloat16
    lhs = jax.device_put(jnp.asarray(rng.normal(size=(M, K)), dt), device)
    rhs = jax.device_put(jnp.asarray(rng.normal(size=(G, K, N)) / np.sqrt(K), dt), device)
    cot = jax.device_put(jnp.asarray(rng.normal(size=(M, N)), jnp.float32), device)
    gs = jax.device_put(jnp.asarray(group_sizes(M, G, skewed)), device)
    flops = 2.0 * M * K * N
    repeats = 2 if dry else _REPEATS.value
    inner = 1 if dry else _INNER.value
    label = f"M={M} G={G} {'skewed' if skewed else 'balanced'}"

    sizes = group_sizes(M, G, skewed)
    ref = _per_group_reference(sizes, False)(lhs, rhs, cot)
    ref_grads = _per_group_reference(sizes, True)(lhs, rhs, cot) if check_grads else None
    rows = []
    dense = jax.jit(lambda a, b: a @ b)
    rhs0, rhs1 = rhs[0], rhs[:1]  # sliced once, outside the timed calls
    t = _median_s(lambda: dense(lhs, rhs0), repeats, inner)
    dense_b = _fwd_bwd(lambda a, b, g: a @ b[0])
    tb = _median_s(lambda: dense_b(lhs, rhs1, gs, cot), repeats, inner)
    rows.append(
        {
            "case": label,
            "impl": "dense",
            "fwd_ms": 1e3 * t,
            "fwd_bwd_ms": 1e3 * tb,
            "fwd_tflops": flops / t / 1e12,
            "fwd_bwd_tflops": 3 * flops / tb / 1e12,
        }
    )
    print(f"  gmm {label} dense: {rows[0]}", flush=True)
    for name, mm in impls.items():
        row = {"case": label, "impl": name}
        try:
            fwd = jax.jit(mm)
            got = fwd(lhs, rhs, gs)
            row["fwd_rel_err"] = _rel(got, ref)
            t = _adaptive_median_s(lambda fwd=fwd: fwd(lhs, rhs, gs), repeats, inner)
            row.update(fwd_ms=1e3 * t, fwd_tflops=flops / t / 1e12)
            bwd = _fwd_bwd(mm)
            _, grads = bwd(lhs, rhs, gs, cot)
            if ref_grads is not None:
                row["d_lhs_rel_err"] = _rel(grads[0], ref_grads[0])
                row["d_rhs_rel_err"] = _rel(grads[1], ref_grads[1])
            t = _adaptive_median_s(lambda bwd=bwd: bwd(lhs, rhs, gs, cot), repeats, inner)
            row.update(fwd_bwd_ms=1e3 * t, fwd_bwd_tflops=3 * flops / t / 1e12)
        except Exception as e:  # noqa: BLE001 -- a setting that cannot compile is reported
            row["error"] = repr(e)[:400]
        rows.append(row)
        print(
            f"  gmm {label} {name}: "
            + ", ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in row.items()
                if k not in ("case", "impl")
            ),
            flush=True,
        )
    return rows


def section_gmm(device, dry: bool) -> dict:
    K, N = (32, 32) if dry else (7168, 2048)
    M, G = (64, 4) if dry else (_GMM_ROWS.value, 8)
    configs = ["16x16x16"] if dry else _GMM_CONFIGS.value
    out = {"shape": {"K": K, "N": N, "dtype": "bfloat16"}, "sweep": [], "shapes": []}
    out["sweep"] = _gmm_case(
        device, dry, M, K, N, G, False, _impls(dry, configs, _MGPU_CONFIGS.value), True
    )

    def best(prefix):
        ok = [r for r in out["sweep"] if r["impl"].startswith(prefix) and "fwd_bwd_tflops" in r]
        return max(ok, key=lambda r: r["fwd_bwd_tflops"])["impl"] if ok else None

    # The shape sweep times the fastest setting of each of our kernels (ragged_dot, several
    # times slower and slow to compile at large shapes, only in the settings sweep above).
    chosen = [b for b in (best("pallas"), best("mgpu")) if b] or ["ragged_dot"]
    out["chosen"] = chosen
    impls = _impls(dry, configs, _MGPU_CONFIGS.value)
    impls = {k: impls[k] for k in chosen}
    groups = [4] if dry else [int(g) for g in _GMM_GROUPS.value]
    sizes = [64] if dry else [int(m) for m in _GMM_SIZES.value]
    for G in groups:
        for M in sizes:
            for skewed in (False, True):
                out["shapes"] += _gmm_case(device, dry, M, K, N, G, skewed, impls, False)
    return out


# -- the MoE layer -----------------------------------------------------------------------------


_INTERESTING = re.compile(
    r"^(custom-call|all-to-all|ragged-all-to-all|all-gather|all-reduce|collective-permute"
    r"|[a-z\-]+-start|[a-z\-]+-done)$"
)


def schedule_summary(hlo_text: str) -> list[str]:
    """The entry computation's instructions that are kernels we care about (custom calls,
    collectives, async starts/dones), in schedule order, one short line each."""
    lines, in_entry = [], False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY "):
            in_entry = True
            continue
        if in_entry and line.startswith("}"):
            break
        if not in_entry or " = " not in line:
            continue
        op = re.search(r"\s([a-z][a-z\-]*)\(", line.split(" = ", 1)[1])
        if not op or not _INTERESTING.search(op.group(1)):
            continue
        name = line.strip().split(" = ")[0]
        target = re.search(r'custom_call_target="([^"]+)"', line)
        kname = re.search(r'"name":"([^"]+)"|name=\\?"(ultraep_\w+)', line)
        lines.append(
            f"{name}: {op.group(1)}"
            + (f" {target.group(1)}" if target else "")
            + (f" [{next(g for g in kname.groups() if g)}]" if kname else "")
        )
    return lines


def device_profile(fn, calls: int, top: int = 25) -> list[str]:
    """Device time per kernel name over ``calls`` calls of ``fn`` (one warm-up first), from
    JAX's profiler (its Perfetto trace): the ``top`` names by total time, as text lines."""
    import glob
    import gzip
    import tempfile

    _block(fn())
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            _block([fn() for _ in range(calls)])
        paths = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)
        if not paths:
            return ["no perfetto trace written"]
        with gzip.open(paths[0], "rt") as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pname = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    totals: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        proc = pname.get(e.get("pid"), "")
        if "GPU" not in proc and "gpu" not in proc and "device" not in proc.lower():
            continue
        acc = totals.setdefault(e["name"][:90], [0.0, 0])
        acc[0] += float(e["dur"])
        acc[1] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
    total = sum(v[0] for v in totals.values())
    lines = [
        f"device events total {total / 1e3 / calls:.2f} ms per call "
        f"({sorted(set(pname.values()))[:6]})"
    ]
    lines += [f"{v[0] / 1e3 / calls:9.3f} ms/call {v[1] // calls:5d}x  {k}" for k, v in rows[:top]]
    return lines


def section_moe(device, dry: bool) -> dict:
    from flax import nnx
    from jax.sharding import Mesh

    D, F, E, k = (16, 32, 4, 2) if dry else (2048, 1408, 16, 4)
    tokens = 64 if dry else _MOE_TOKENS.value
    seq = 32 if dry else 1024
    repeats = 2 if dry else _REPEATS.value
    dt = jnp.float32 if dry else jnp.bfloat16
    mesh = Mesh(np.array([device]), ("expert",))
    x = jax.device_put(jax.random.normal(jax.random.key(0), (tokens // seq, seq, D), dt), device)
    out = {
        "setup": {
            "d_model": D,
            "d_ff": F,
            "experts": E,
            "top_k": k,
            "tokens": tokens,
            "dtype": jnp.dtype(dt).name,
        },
        "rows": [],
    }
    kernels = ["auto"] if dry else _MOE_KERNELS.value
    for spec in kernels:
        kernel, _, comm = spec.partition("/")
        comm = comm or "auto"
        row = {"expert_kernel": kernel, "comm_backend": comm}
        for name, balancer in (
            ("off", None),
            ("on", uep.BalancerConfig(E, 1, 2, min_tokens_per_replica=16)),
        ):
            try:
                layer = uep.MoE(
                    d_model=D,
                    d_ff=F,
                    num_experts=E,
                    top_k=k,
                    mesh=mesh,
                    balancer=balancer,
                    capacity_factor=None,
                    param_dtype=dt,
                    expert_kernel=kernel,
                    comm_backend=comm,
                    rngs=nnx.Rngs(0),
                )
                graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

                def loss(params, x, graphdef=graphdef, rest=rest):
                    y, _ = nnx.merge(graphdef, params, rest)(x)
                    return jnp.mean(jnp.square(y.astype(jnp.float32)))

                step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
                value, _ = step(params, x)
                row[f"balancer_{name}_loss_finite"] = bool(np.isfinite(float(value)))
                row[f"balancer_{name}_step_ms"] = 1e3 * _median_s(
                    lambda step=step, params=params: step(params, x), repeats
                )
                if spec == kernels[0] and _PROFILE.value and not dry:
                    out[f"profile_balancer_{name}"] = device_profile(
                        lambda step=step, params=params: step(params, x), 3
                    )
                if name == "on" and spec == kernels[0] and _DUMP_HLO.value:
                    text = step.lower(params, x).compile().as_text()
                    out["balanced_schedule"] = schedule_summary(text)
                    if _OUT.value:
                        os.makedirs(_OUT.value, exist_ok=True)
                        with open(os.path.join(_OUT.value, "moe_balanced_hlo.txt"), "w") as f:
                            f.write(text)
            except Exception as e:  # noqa: BLE001 -- reported, and the other rows still run
                row[f"balancer_{name}_error"] = repr(e)[:600]
                traceback.print_exc()
        if "balancer_on_step_ms" in row and "balancer_off_step_ms" in row:
            row["on_over_off"] = row["balancer_on_step_ms"] / row["balancer_off_step_ms"]
        out["rows"].append(row)
        print(f"  moe {row}", flush=True)
        if _OUT.value:  # rows so far, in case a later row runs past a time limit
            os.makedirs(_OUT.value, exist_ok=True)
            with open(os.path.join(_OUT.value, "moe_partial.json"), "w") as f:
                json.dump(out, f, indent=2)
    return out


# -- main --------------------------------------------------------------------------------------


def _table(results: dict) -> str:
    lines = []
    env = results.get("env", {})
    if env:
        lines.append(
            f"device: {env.get('device_kind')} (cc {env.get('compute_capability')}, "
            f"{env.get('core_count')} SMs)  jax {env.get('jax')} jaxlib {env.get('jaxlib')} "
            f"plugin {env.get('jax-cuda13-plugin')} triton {env.get('triton')}"
        )
    p = results.get("planner")
    if p:
        if "check" not in p:
            lines.append(f"(a) planner: {p.get('status')}")
        else:
            lines.append(f"(a) planner CUDA == CPU: {p['status']}")
            for key, val in p["check"].items():
                lines.append(f"      {key:<34} {val}")
            t = p.get("time", {})
            if t:
                lines.append(f"(b) planner time, {t['setup']}:")
                for key, val in t.items():
                    if key != "setup":
                        lines.append(f"      {key:<42} {val}")
    c = results.get("gmm")
    if c:
        lines.append(f"(c) grouped matmul {c['shape']}")
        lines.append(
            f"      {'case':<26} {'impl':<26} {'fwd TF/s':>9} {'f+b TF/s':>9} {'fwd ms':>8} "
            f"{'f+b ms':>8} {'fwd err':>8}"
        )
        for row in c["sweep"] + c["shapes"]:
            if "error" in row:
                lines.append(
                    f"      {row['case']:<26} {row['impl']:<26} error: {row['error'][:70]}"
                )
                continue
            lines.append(
                f"      {row['case']:<26} {row['impl']:<26} {row.get('fwd_tflops', 0):>9.1f} "
                f"{row.get('fwd_bwd_tflops', 0):>9.1f} {row.get('fwd_ms', 0):>8.3f} "
                f"{row.get('fwd_bwd_ms', 0):>8.3f} {row.get('fwd_rel_err', 0):>8.1e}"
            )
    d = results.get("moe")
    if d:
        lines.append(f"(d) MoE fwd+bwd, EP=1, {d['setup']}:")
        for row in d["rows"]:
            lines.append(f"      {row}")
        for key in ("profile_balancer_off", "profile_balancer_on"):
            if d.get(key):
                lines.append(f"      {key} (first row's kernel):")
                lines += [f"        {s}" for s in d[key]]
        if d.get("balanced_schedule"):
            lines.append("      balanced step, scheduled entry computation (kernels, collectives):")
            lines += [f"        {s}" for s in d["balanced_schedule"][:80]]
    return "\n".join(lines)


def main(argv):
    del argv
    dry = _DRY.value
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not dry and not gpus:
        print(
            "gpu_check: no GPU visible to JAX (devices: "
            f"{sorted({d.platform for d in jax.devices()})}); use --dry_run to check the script"
        )
        sys.exit(2)
    device = jax.devices("cpu")[0] if dry else gpus[0]
    results = {"dry_run": dry}
    sections = {
        "env": section_env,
        "planner": section_planner,
        "gmm": section_gmm,
        "moe": section_moe,
    }
    failed = []
    for name in _SECTIONS.value:
        print(f"== {name}", flush=True)
        try:
            results[name] = sections[name](device, dry)
        except Exception as e:  # noqa: BLE001 -- one broken section must not hide the others
            traceback.print_exc()
            results[name] = {"error": repr(e)[:1000]}
            failed.append(name)
        if _OUT.value:
            os.makedirs(_OUT.value, exist_ok=True)
            with open(os.path.join(_OUT.value, "gpu_results.json"), "w") as f:
                json.dump(results, f, indent=2)
    print(_table({k: v for k, v in results.items() if isinstance(v, dict) and "error" not in v}))
    if failed:
        print(f"gpu_check: sections failed: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
