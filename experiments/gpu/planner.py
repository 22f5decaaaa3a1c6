"""The GPU check's planner section: the CUDA planner's plans (both kernels: the sequential core's
and the parallel form's) against the CPU handler's, bit for bit, and the time per plan (see
`experiments.gpu.check`)."""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np

import ultraep_jax as uep
from experiments.lab.batched import batched_planner
from experiments.lab.loads import workloads
from experiments.lab.stepmodel.shapes import ANCHOR
from experiments.lab.walltime import median_seconds, time_batched_plan
from ultraep_jax import tools


def random_loads(rng, n: int, R: int, E: int, tokens=4096, exponent=(0.0, 2.0)) -> np.ndarray:
    """int32 [n, R, E]: skewed random load matrices (random Zipf-like popularity per matrix)."""
    out = np.empty((n, R, E), np.int32)
    for i in range(n):
        p = (rng.permutation(E) + 1.0) ** -rng.uniform(*exponent)
        out[i] = rng.multinomial(int(rng.integers(0, tokens)), p / p.sum(), size=R)
    return out


def reference_loads(R: int, E: int, tokens: int, n: int) -> np.ndarray:
    """int32 [n, R, E]: the rank-Zipf reference workloads (the anchor's top-k and initial loads,
    `ANCHOR.zipf_targets` in turn, seeds 0..)."""
    targets, k = ANCHOR.zipf_targets, ANCHOR.shape.top_k
    return np.stack(
        [workloads.rank_zipf_loads(R, E, tokens, k, targets[s % len(targets)], s) for s in range(n)]
    )


def planner_cases(dry: bool) -> dict:
    """name -> (BalancerConfig, int32 [n, R, E]): configurations that between them take every
    branch of the threshold search (checked with tests/references/planner.py: the first is mostly
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
    R, E, S = ANCHOR.ep, ANCHOR.shape.num_experts, ANCHOR.slots_per_rank
    cases[f"zipf_EP{R}_E{E}_S{S}"] = (
        Cfg(E, R, S),
        reference_loads(R, E, ANCHOR.tokens_per_rank, 6),
    )
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
    planner = batched_planner(cfg)
    return _plan_arrays(planner(jax.device_put(loads, jax.devices("cpu")[0])))


def _parallel_plans(cfg, loads, device) -> list[np.ndarray]:
    """``jit(vmap(uep.plan(..., parallel=True)))`` on ``device`` (the parallel kernel on CUDA)."""
    planner = jax.jit(jax.vmap(lambda x: uep.plan(x, cfg, parallel=True)))
    return _plan_arrays(planner(jax.device_put(loads, device)))


#: The CUDA planner's benchmark library (ffi/plan_cuda_bench.cu), built and installed beside the
#: handlers' library when asked for (ULTRAEP_BUILD_CUDA_BENCH=ON; experiments/gpu/run_all.sh does).
BENCH_LIB = "libultraep_plan_cuda_bench.so"


def _bench_lib():
    path = tools.library_path(BENCH_LIB)
    if path is None:
        raise RuntimeError(
            f"{BENCH_LIB} was not built into this install (ULTRAEP_BUILD_CUDA=ON "
            'ULTRAEP_BUILD_CUDA_BENCH=ON pip install ".[train]" builds it)'
        )
    lib = ctypes.cdll.LoadLibrary(str(path))
    fn = lib.ultraep_plan_cuda_bench
    i64, i32p = ctypes.c_int64, ctypes.POINTER(ctypes.c_int32)
    fn.argtypes = [
        ctypes.c_int,  # parallel (0: the sequential core's kernel)
        i64,  # R
        i64,  # E
        i64,  # S
        i64,  # min_tokens_per_replica
        i64,  # master_keep_tokens
        ctypes.c_double,  # balance_eps
        i64,  # capacity (0: unbounded)
        i64,  # ranks_per_domain (R: one domain)
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


def cuda_bench(
    cfg, loads: np.ndarray, iters: int, capacity: int | None = None, parallel: bool = False
):
    """Runs the CUDA library's hook: (plans as 4 int32 arrays, per-launch ms of ``iters``
    launches of the whole batch). ``capacity`` and ``parallel`` (the kernel of the parallel
    form, else the sequential core's) as in ``uep.plan`` (None: unbounded), the fast domains
    ``cfg.ranks_per_domain`` (None: one)."""
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
        int(parallel),
        R,
        E,
        S,
        cfg.min_tokens_per_replica,
        cfg.master_keep_tokens,
        float(cfg.balance_eps),
        0 if capacity is None else int(capacity),
        R if cfg.ranks_per_domain is None else cfg.ranks_per_domain,
        n,
        p32(loads),
        iters,
        times.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
        *(p32(o) for o in outs),
    )
    if err:
        raise RuntimeError(f"ultraep_plan_cuda_bench: CUDA error {err}")
    return outs, times[:iters]


def _check_cases(device, dry: bool) -> dict:
    """(a) Each case's plans through JAX (plain and parallel form) and, on a GPU, through the
    CUDA hook (both kernels), each against the CPU handler's: {case: {check: equal}}."""
    check = {}
    for name, (cfg, loads) in planner_cases(dry).items():
        want = _cpu_plans(cfg, loads)
        got = _plan_arrays(batched_planner(cfg)(jax.device_put(loads, device)))
        row = {"matrices": int(loads.shape[0]), "jax_equal": all(map(np.array_equal, want, got))}
        got = _parallel_plans(cfg, loads, device)
        row["jax_parallel_equal"] = all(map(np.array_equal, want, got))
        if not dry:
            plans, _ = cuda_bench(cfg, loads, 0)
            row["hook_equal"] = all(map(np.array_equal, want, plans))
            plans, _ = cuda_bench(cfg, loads, 0, parallel=True)
            row["hook_parallel_equal"] = all(map(np.array_equal, want, plans))
        check[name] = row
        print(f"  planner {name}: {row}", flush=True)
    return check


def _check_negative_loads() -> dict:
    """Invalid input on the GPU: a negative load gives -1 everywhere (the CPU handler raises
    instead), with either kernel."""
    cfg = uep.BalancerConfig(64, 8, 2, min_tokens_per_replica=16)
    bad = random_loads(np.random.default_rng(5), 4, 8, 64)
    bad[1, 3, 7] = -5
    check = {}
    for parallel in (False, True):
        plans, _ = cuda_bench(cfg, bad, 0, parallel=parallel)
        neg = all(np.all(p[1] == -1) for p in plans)
        neg &= all(np.all(p[0] >= 0) for p in plans[3:])
        check[f"negative_load_gives_minus_one{'_parallel' * parallel}"] = neg
    return check


def _time_kernels(cfg, base, repeats: int, plan_batch: int, t: dict) -> None:
    """(b) Each CUDA kernel's time per plan (CUDA events): single plans of three targets and one
    batch of ``plan_batch``, into ``t``."""
    reps = max(repeats, 50)
    for kernel, parallel in (("core", False), ("parallel", True)):
        singles = []
        for s in range(3):
            _, ms = cuda_bench(cfg, base[s : s + 1], reps, parallel=parallel)
            singles.append(float(np.median(ms)) * 1e3)
        _, ms = cuda_bench(cfg, base[np.arange(plan_batch) % 6], 10, parallel=parallel)
        # key prefixes name the kernel (experiments.gpu.summary reads them so)
        t[f"{kernel}_event_us_single_by_target"] = singles
        t[f"{kernel}_event_us_per_plan_batched"] = float(np.median(ms)) * 1e3 / plan_batch
        print(
            f"  planner time ({kernel} kernel): {singles} us single, "
            f"{t[f'{kernel}_event_us_per_plan_batched']:.2f} us/plan batched",
            flush=True,
        )


def _plan_chain(cfg, n: int):
    """A jitted chain of ``n`` dependent plans of one matrix: the sum of their rank 0 loads."""

    def f(loads):
        def body(_, carry):
            x, acc = carry
            p = uep.plan(x, cfg)
            bump = (p.rank_load[0] < 0).astype(jnp.int32)  # always 0; XLA cannot know
            return x + bump, acc + p.rank_load[0]

        return jax.lax.fori_loop(0, n, body, (loads, jnp.int32(0)), unroll=True)[1]

    return jax.jit(f)


def _time_jax(cfg, base, device, repeats: int, plan_batch: int, t: dict) -> None:
    """(b) ``uep.plan``'s time through JAX: per plan in a chain (64 less 8 plans), one plan's
    wall time and per plan in a batch of ``plan_batch``, into ``t``."""
    one = jax.device_put(base[0], device)
    c64, c8 = _plan_chain(cfg, 64), _plan_chain(cfg, 8)
    t64 = median_seconds(lambda: c64(one), repeats)
    t8 = median_seconds(lambda: c8(one), repeats)
    t["jax_chain_us_per_plan"] = 1e6 * (t64 - t8) / 56
    single = jax.jit(lambda x: uep.plan(x, cfg))
    t["jax_single_plan_wall_us"] = 1e6 * median_seconds(lambda: single(one), repeats)
    loads = base[np.arange(plan_batch) % 6]
    seconds = time_batched_plan(loads, cfg, repeats, device)
    t["jax_batched_us_per_plan"] = 1e6 * seconds / plan_batch


def section_planner(device, dry: bool, repeats: int, plan_batch: int) -> dict:
    """(a) the CUDA planner's plans, with either kernel, equal the CPU handler's; (b) time per plan
    at the anchor's setup with either kernel (``repeats`` samples; batches of ``plan_batch`` plans).
    ``dry``: the checks on CPU only (the parallel form's host emulation against the core)."""
    if not tools.has_cuda_handler() and not dry:
        return {"status": "skipped: the CUDA planner handler is not built into this install"}
    out = {"check": _check_cases(device, dry), "time": {}}
    if not dry:
        out["check"] |= _check_negative_loads()
    ok = all(
        all(v for k, v in row.items() if k.endswith("_equal")) if isinstance(row, dict) else row
        for row in out["check"].values()
    )
    out["status"] = "ok" if ok else "MISMATCH"
    if dry:
        return out

    # (b) Time at the anchor's setup.
    R, E, S = ANCHOR.ep, ANCHOR.shape.num_experts, ANCHOR.slots_per_rank
    cfg = uep.BalancerConfig(E, R, S)
    base = reference_loads(R, E, ANCHOR.tokens_per_rank, 6)
    targets = "/".join(f"{x:g}" for x in ANCHOR.zipf_targets)
    out["time"]["setup"] = (
        f"EP{R}/E{E}/S{S}, rank_zipf_loads {ANCHOR.tokens_per_rank} tokens x "
        f"top-{ANCHOR.shape.top_k}, targets {targets}"
    )
    _time_kernels(cfg, base, repeats, plan_batch, out["time"])
    _time_jax(cfg, base, device, repeats, plan_batch, out["time"])
    return out


def planner_lines(p: dict) -> list[str]:
    """The planner section's results as table lines."""
    if "check" not in p:
        return [f"(a) planner: {p.get('status')}"]
    lines = [f"(a) planner CUDA == CPU: {p['status']}"]
    lines += [f"      {key:<34} {val}" for key, val in p["check"].items()]
    t = p.get("time", {})
    if t:
        lines.append(f"(b) planner time, {t['setup']}:")
        lines += [f"      {key:<42} {val}" for key, val in t.items() if key != "setup"]
    return lines
