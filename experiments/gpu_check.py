"""The GPU check: correctness and timings of the GPU path, in one call, on one GPU.

        python -m experiments.gpu_check --out=runs/gpu            # on an H100 / H200
        python -m experiments.gpu_check --dry_run                 # anywhere: every section on CPU,
                                                                  # tiny shapes, kernel interpreted

Sections (a table is printed and everything is written to ``--out/gpu_results.json``):

(a) planner: the CUDA planner handler's plans equal the CPU handler's, bit for bit, on 200 random
    load matrices (EP8/E64/S2) and on the EP64/E256/S2 reference workloads
    (``workloads.rank_zipf_loads(64, 256, 8192, 8, target, seed)``, targets 1.5 / 2 / 3);
(b) planner time at EP64/E256/S2: per plan in a batched ``jit(vmap(plan))`` over --plan_batch
    matrices (median over --repeats, divided by the batch), and single-plan latency
    (``jit(plan)`` on one matrix, median over --repeats; includes the launch overhead);
(c) grouped matmul, bf16, a DeepSeek-V3-like expert shape: K = 7168 (d_model), N = 2048
    (expert d_ff), G = 8 local experts, M = --gmm_rows rows (default 32768 = 4096 tokens x 8
    choices per GPU, balanced: 4096 rows per expert), balanced vs skewed group sizes (Zipf 1.2
    over the 8 experts): TFLOP/s of our kernel (each of --gmm_configs, forward and forward +
    backward) vs ``jax.lax.ragged_dot`` vs a dense [M, K] @ [K, N] matmul (the same FLOPs);
(d) the MoE layer (uep.MoE) forward + backward on one GPU (EP = 1 mesh), balancer on vs off:
    median step ms. (The layer's experts use whatever `ultraep_jax.experts` selects.)

Without a GPU (and without --dry_run) it prints one line and exits with code 2.
"""

from __future__ import annotations

import os
import sys

if "--dry_run" in sys.argv or "--dry_run=true" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import ultraep_jax as uep  # noqa: E402
from experiments import workloads  # noqa: E402
from ultraep_jax import _native, gmm  # noqa: E402

_OUT = flags.DEFINE_string("out", None, "Folder for gpu_results.json (created).")
_DRY = flags.DEFINE_bool("dry_run", False, "Run every section on CPU with tiny shapes.")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed repeats (medians are reported).")
_PLAN_BATCH = flags.DEFINE_integer("plan_batch", 1024, "Matrices per batched planner call.")
_GMM_ROWS = flags.DEFINE_integer("gmm_rows", 32768, "M, rows of the grouped matmul.")
_GMM_CONFIGS = flags.DEFINE_list(
    "gmm_configs",
    ["128x128x64w4s3", "128x256x64w8s3", "64x128x64w4s4", "128x128x32w4s4", "256x128x64w8s3"],
    "Kernel settings to time: TMxTNxTK, then w<num_warps>s<num_stages>.",
)
_MOE_TOKENS = flags.DEFINE_integer("moe_tokens", 8192, "Tokens per MoE step (d).")

TARGETS = (1.5, 2.0, 3.0)


def _median_s(fn, repeats: int) -> float:
    """Median wall seconds of ``fn()`` (which must block), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _block(tree):
    return jax.block_until_ready(tree)


def _time_call(fn, args, repeats: int) -> float:
    """Median seconds of the blocking call ``fn(*args)``."""
    return _median_s(lambda: _block(fn(*args)), repeats)


def random_loads(rng, n: int, R: int, E: int) -> np.ndarray:
    """int32 [n, R, E]: skewed random load matrices (random Zipf-like popularity per matrix)."""
    out = np.empty((n, R, E), np.int32)
    for i in range(n):
        p = (rng.permutation(E) + 1.0) ** -rng.uniform(0.0, 2.0)
        out[i] = rng.multinomial(int(rng.integers(0, 4096)), p / p.sum(), size=R)
    return out


def reference_loads(R: int, E: int, tokens: int, n: int) -> np.ndarray:
    """int32 [n, R, E]: the rank-Zipf reference workloads (targets 1.5 / 2 / 3, seeds 0..)."""
    return np.stack(
        [workloads.rank_zipf_loads(R, E, tokens, 8, TARGETS[s % 3], s) for s in range(n)]
    )


def _plans_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))


def check_planner(device, dry: bool) -> dict:
    """(a): CUDA plans == CPU plans."""
    if not dry and not _native.has_cuda_handler():
        return {"status": "skipped: the CUDA planner handler is not built into this install"}
    out = {}
    rng = np.random.default_rng(0)
    cases = {
        "random_EP8_E64_S2": (
            uep.BalancerConfig(64, 8, 2, min_tokens_per_replica=16),
            random_loads(rng, 200, 8, 64),
        ),
    }
    R, E = (8, 32) if dry else (64, 256)
    cases[f"zipf_EP{R}_E{E}_S2"] = (uep.BalancerConfig(E, R, 2), reference_loads(R, E, 8192, 6))
    cpu = jax.devices("cpu")[0]
    for name, (cfg, loads) in cases.items():
        planner = jax.jit(jax.vmap(lambda l, cfg=cfg: uep.plan(l, cfg)))
        want = jax.tree.leaves(planner(jax.device_put(loads, cpu)))
        got = jax.tree.leaves(planner(jax.device_put(loads, device)))
        out[name] = {"matrices": int(loads.shape[0]), "equal": _plans_equal(want, got)}
    out["status"] = "ok" if all(v["equal"] for v in out.values()) else "MISMATCH"
    return out


def time_planner(device, dry: bool) -> dict:
    """(b): per-plan time, batched and single, at EP64/E256/S2."""
    if not dry and not _native.has_cuda_handler():
        return {"status": "skipped: the CUDA planner handler is not built into this install"}
    R, E = (8, 32) if dry else (64, 256)
    batch = 8 if dry else _PLAN_BATCH.value
    cfg = uep.BalancerConfig(E, R, 2)
    base = reference_loads(R, E, 8192, 6)
    loads = jax.device_put(base[np.arange(batch) % len(base)], device)
    batched = jax.jit(jax.vmap(lambda l: uep.plan(l, cfg)))
    single = jax.jit(lambda l: uep.plan(l, cfg))
    one = loads[0]
    t_batch = _median_s(lambda: _block(batched(loads)), _REPEATS.value)
    t_single = _median_s(lambda: _block(single(one)), _REPEATS.value)
    return {
        "status": "ok",
        "setup": f"EP{R}/E{E}/S2, rank_zipf_loads 8192 tokens x 8",
        "batch": batch,
        "batched_us_per_plan": 1e6 * t_batch / batch,
        "single_plan_latency_us": 1e6 * t_single,
    }


def _parse_config(text: str) -> dict:
    tiles, _, rest = text.partition("w")
    tm, tn, tk = (int(v) for v in tiles.split("x"))
    warps, _, stages = rest.partition("s")
    return dict(
        tile_m=tm,
        tile_n=tn,
        tile_k=tk,
        num_warps=int(warps) if warps else None,
        num_stages=int(stages) if stages else None,
    )


def group_sizes(M: int, G: int, skewed: bool) -> np.ndarray:
    """int32 [G] summing to M: equal, or Zipf 1.2 over the groups (largest first)."""
    p = np.ones(G) if not skewed else (np.arange(1, G + 1) ** -1.2)
    sizes = np.floor(M * p / p.sum()).astype(np.int64)
    sizes[0] += M - sizes.sum()
    return sizes.astype(np.int32)


def time_gmm(device, dry: bool) -> dict:
    """(c): TFLOP/s of the kernel vs ragged_dot vs dense, bf16."""
    M, K, N, G = (64, 32, 32, 4) if dry else (_GMM_ROWS.value, 7168, 2048, 8)
    configs = ["16x16x16"] if dry else _GMM_CONFIGS.value
    repeats = 2 if dry else _REPEATS.value
    rng = np.random.default_rng(0)
    dt = jnp.bfloat16
    lhs = jax.device_put(jnp.asarray(rng.normal(size=(M, K)), dt), device)
    rhs = jax.device_put(jnp.asarray(rng.normal(size=(G, K, N)) / np.sqrt(K), dt), device)
    dense_rhs = rhs[0]
    flops = 2.0 * M * K * N
    out = {"shape": dict(M=M, K=K, N=N, G=G, dtype="bfloat16"), "rows": []}

    def tflops(seconds, factor=1.0):
        return factor * flops / seconds / 1e12

    def fwd_bwd(mm):
        def loss(lhs, rhs, gs):
            return jnp.sum(mm(lhs, rhs, gs).astype(jnp.float32))

        return jax.jit(jax.grad(loss, argnums=(0, 1)))

    dense = jax.jit(lambda a, b: a @ b)
    t_dense = _median_s(lambda: _block(dense(lhs, dense_rhs)), repeats)
    out["dense_tflops"] = tflops(t_dense)
    for skewed in (False, True):
        gs = jax.device_put(jnp.asarray(group_sizes(M, G, skewed)), device)
        label = "skewed" if skewed else "balanced"
        ragged = jax.jit(jax.lax.ragged_dot)
        want = np.asarray(ragged(lhs, rhs, gs), np.float32)
        rows = [
            {
                "groups": label,
                "impl": "ragged_dot",
                "fwd_tflops": tflops(_time_call(ragged, (lhs, rhs, gs), repeats)),
                "fwd_bwd_tflops": tflops(
                    _time_call(fwd_bwd(jax.lax.ragged_dot), (lhs, rhs, gs), repeats), 3.0
                ),
                "max_abs_err": 0.0,
            }
        ]
        for text in configs:
            kw = _parse_config(text)

            def ours(lhs, rhs, gs, kw=kw):
                return gmm.grouped_matmul(lhs, rhs, gs, interpret=dry, **kw)

            fwd = jax.jit(ours)
            bwd = fwd_bwd(ours)
            try:
                got = np.asarray(fwd(lhs, rhs, gs), np.float32)
                rows.append(
                    {
                        "groups": label,
                        "impl": f"pallas {text}",
                        "fwd_tflops": tflops(_time_call(fwd, (lhs, rhs, gs), repeats)),
                        "fwd_bwd_tflops": tflops(_time_call(bwd, (lhs, rhs, gs), repeats), 3.0),
                        "max_abs_err": float(np.max(np.abs(got - want))),
                    }
                )
            except Exception as e:  # noqa: BLE001 -- a config Triton cannot compile (e.g. shared memory)
                rows.append({"groups": label, "impl": f"pallas {text}", "error": repr(e)[:300]})
        out["rows"] += rows
    return out


def time_moe(device, dry: bool) -> dict:
    """(d): MoE forward + backward on one device (EP = 1), balancer on vs off."""
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
        "setup": dict(
            d_model=D, d_ff=F, experts=E, top_k=k, tokens=tokens, dtype=jnp.dtype(dt).name
        )
    }
    for name, balancer in (
        ("off", None),
        ("on", uep.BalancerConfig(E, 1, 2, min_tokens_per_replica=16)),
    ):
        layer = uep.MoE(
            d_model=D,
            d_ff=F,
            num_experts=E,
            top_k=k,
            mesh=mesh,
            balancer=balancer,
            capacity_factor=None,
            param_dtype=dt,
            rngs=nnx.Rngs(0),
        )
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

        def loss(params, x, graphdef=graphdef, rest=rest):
            y, _ = nnx.merge(graphdef, params, rest)(x)
            return jnp.mean(jnp.square(y.astype(jnp.float32)))

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        value, _ = step(params, x)
        out[f"balancer_{name}_step_ms"] = 1e3 * _median_s(
            lambda step=step, params=params: _block(step(params, x)), repeats
        )
        out[f"balancer_{name}_loss_finite"] = bool(np.isfinite(float(value)))
    return out


def _table(results: dict) -> str:
    lines = [f"device: {results['device']}  jax {results['jax']}"]
    a = results["planner_check"]
    lines.append(f"(a) planner CUDA == CPU: {a.get('status')}")
    for key, val in a.items():
        if isinstance(val, dict):
            lines.append(f"      {key:<24} {val['matrices']:>4} matrices  equal={val['equal']}")
    b = results["planner_time"]
    if b.get("status") == "ok":
        lines.append(
            f"(b) planner {b['setup']}: {b['batched_us_per_plan']:.2f} us/plan batched "
            f"(batch {b['batch']}), {b['single_plan_latency_us']:.1f} us single-plan latency"
        )
    else:
        lines.append(f"(b) planner time: {b.get('status')}")
    c = results["gmm"]
    lines.append(f"(c) grouped matmul {c['shape']}; dense matmul {c['dense_tflops']:.1f} TFLOP/s")
    lines.append(
        f"      {'groups':<9} {'impl':<26} {'fwd TF/s':>9} {'fwd+bwd TF/s':>13} {'err':>9}"
    )
    for row in c["rows"]:
        if "error" in row:
            lines.append(f"      {row['groups']:<9} {row['impl']:<26} error: {row['error'][:60]}")
        else:
            lines.append(
                f"      {row['groups']:<9} {row['impl']:<26} {row['fwd_tflops']:>9.1f} "
                f"{row['fwd_bwd_tflops']:>13.1f} {row['max_abs_err']:>9.2e}"
            )
    d = results["moe"]
    lines.append(
        f"(d) MoE fwd+bwd, EP=1, {d['setup']}: balancer off {d['balancer_off_step_ms']:.2f} ms, "
        f"on {d['balancer_on_step_ms']:.2f} ms"
    )
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
    results = {
        "device": getattr(device, "device_kind", str(device)),
        "jax": jax.__version__,
        "dry_run": dry,
        "cuda_planner_handler": _native.has_cuda_handler(),
    }
    results["planner_check"] = check_planner(device, dry)
    results["planner_time"] = time_planner(device, dry)
    results["gmm"] = time_gmm(device, dry)
    results["moe"] = time_moe(device, dry)
    print(_table(results))
    if _OUT.value:
        os.makedirs(_OUT.value, exist_ok=True)
        path = os.path.join(_OUT.value, "gpu_results.json")
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
