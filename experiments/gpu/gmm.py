"""The GPU check's grouped-matmul section: JAX's Mosaic GPU ragged-dot kernels, tokamax's ragged
dot (where it is installed: the A/B that decides whether "auto" takes it on Hopper),
``jax.lax.ragged_dot`` and a dense matmul, bf16, timed and checked against a float32 reference
(see `experiments.gpu.check`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lab.stepmodel.shapes import ANCHOR
from experiments.lab.walltime import median_seconds
from ultraep_jax import tools


def _adaptive_median_seconds(fn, repeats: int, inner: int) -> float:
    """`experiments.lab.walltime.median_seconds`, with fewer samples for calls slower than 20 ms."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    once = time.perf_counter() - start
    if once > 0.02:
        return median_seconds(fn, max(3, repeats // 4), 1)
    return median_seconds(fn, repeats, inner)


def _parse_mgpu(text: str) -> tools.MgpuTiles:
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)c(\d+)g(\d+)", text)
    if not m:
        raise ValueError(f"bad mgpu config {text!r}")
    return tools.MgpuTiles(*(int(v) for v in m.groups()))


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


def _impls(dry: bool, mgpu_configs) -> dict:
    impls = {"ragged_dot": jax.lax.ragged_dot}
    if importlib.util.find_spec("tokamax") is not None:
        platform = "cpu" if dry else "cuda"  # on CPU tokamax's XLA implementation
        impls["tokamax"] = lambda x, r, g: tools.grouped_matmul_tokamax(x, r, g, platform=platform)
    if not dry:
        for text in mgpu_configs:
            tiles = _parse_mgpu(text)
            impls[f"mgpu {text}"] = lambda x, r, g, tiles=tiles: tools.grouped_matmul_mgpu(
                x, r, g, tiles=tiles
            )
    return impls


def _gmm_case(device, M, K, N, G, skewed, impls, check_grads, timing, seed=0) -> list[dict]:
    """Rows of every ``impls`` (and a dense matmul) on one case, ``timing`` = (repeats, inner)."""
    rng = np.random.default_rng(seed)
    dt = jnp.bfloat16
    lhs = jax.device_put(jnp.asarray(rng.normal(size=(M, K)), dt), device)
    rhs = jax.device_put(jnp.asarray(rng.normal(size=(G, K, N)) / np.sqrt(K), dt), device)
    cot = jax.device_put(jnp.asarray(rng.normal(size=(M, N)), jnp.float32), device)
    gs = jax.device_put(jnp.asarray(group_sizes(M, G, skewed)), device)
    flops = 2.0 * M * K * N
    repeats, inner = timing
    label = f"M={M} G={G} {'skewed' if skewed else 'balanced'}"

    sizes = group_sizes(M, G, skewed)
    ref = _per_group_reference(sizes, False)(lhs, rhs, cot)
    ref_grads = _per_group_reference(sizes, True)(lhs, rhs, cot) if check_grads else None
    rows = []
    dense = jax.jit(lambda a, b: a @ b)
    rhs0, rhs1 = rhs[0], rhs[:1]  # sliced once, outside the timed calls
    t = median_seconds(lambda: dense(lhs, rhs0), repeats, inner)
    dense_b = _fwd_bwd(lambda a, b, g: a @ b[0])
    tb = median_seconds(lambda: dense_b(lhs, rhs1, gs, cot), repeats, inner)
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
            t = _adaptive_median_seconds(lambda fwd=fwd: fwd(lhs, rhs, gs), repeats, inner)
            row.update(fwd_ms=1e3 * t, fwd_tflops=flops / t / 1e12)
            bwd = _fwd_bwd(mm)
            _, grads = bwd(lhs, rhs, gs, cot)
            if ref_grads is not None:
                row["d_lhs_rel_err"] = _rel(grads[0], ref_grads[0])
                row["d_rhs_rel_err"] = _rel(grads[1], ref_grads[1])
            t = _adaptive_median_seconds(lambda bwd=bwd: bwd(lhs, rhs, gs, cot), repeats, inner)
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


@dataclasses.dataclass(frozen=True)
class GmmSweep:
    """What the grouped-matmul section times (the ``--gmm_*`` / ``--mgpu_configs`` flags).

    Attributes:
      rows: M of the kernel-settings sweep.
      mgpu_configs: Mosaic GPU settings, ``BMxBNxBK`` then
        ``c<max_concurrent_steps>g<grid_block_n>``.
      groups, sizes: G and M of the shape sweep.
      repeats, inner: timed samples, and back-to-back calls per sample.
    """

    rows: int
    mgpu_configs: tuple[str, ...]
    groups: tuple[int, ...]
    sizes: tuple[int, ...]
    repeats: int
    inner: int


#: The dry run's sweep: tiny shapes on CPU (ragged_dot, and tokamax's XLA implementation).
DRY_SWEEP = GmmSweep(64, (), (4,), (64,), repeats=2, inner=1)


def section_gmm(device, dry: bool, sweep: GmmSweep) -> dict:
    """(c) every kernel setting at M = ``sweep.rows``, G = 8, then the fastest of each kind over
    the shape sweep, balanced and skewed (``dry``: `DRY_SWEEP` at K = N = 32)."""
    # K = D and N = F of the anchor's expert (DeepSeek-V3's).
    K, N = (32, 32) if dry else (ANCHOR.shape.hidden, ANCHOR.shape.expert_ffn)
    sweep = DRY_SWEEP if dry else sweep
    G, timing = 4 if dry else 8, (sweep.repeats, sweep.inner)
    out = {"shape": {"K": K, "N": N, "dtype": "bfloat16"}, "sweep": [], "shapes": []}
    impls = _impls(dry, sweep.mgpu_configs)
    out["sweep"] = _gmm_case(device, sweep.rows, K, N, G, False, impls, True, timing)

    def best(prefix):
        ok = [r for r in out["sweep"] if r["impl"].startswith(prefix) and "fwd_bwd_tflops" in r]
        return max(ok, key=lambda r: r["fwd_bwd_tflops"])["impl"] if ok else None

    # The shape sweep times the fastest setting of each of our kernels (ragged_dot, several
    # times slower and slow to compile at large shapes, only in the settings sweep above).
    chosen = [b for b in (best("tokamax"), best("mgpu")) if b] or ["ragged_dot"]
    out["chosen"] = chosen
    impls = {k: impls[k] for k in chosen}
    for G in sweep.groups:
        for M in sweep.sizes:
            for skewed in (False, True):
                out["shapes"] += _gmm_case(device, M, K, N, G, skewed, impls, False, timing)
    return out


def gmm_lines(c: dict) -> list[str]:
    """The grouped-matmul section's results as table lines."""
    header = (
        f"      {'case':<26} {'impl':<26} {'fwd TF/s':>9} {'f+b TF/s':>9} {'fwd ms':>8} "
        f"{'f+b ms':>8} {'fwd err':>8}"
    )
    lines = [f"(c) grouped matmul {c['shape']}", header]
    for row in c["sweep"] + c["shapes"]:
        head = f"      {row['case']:<26} {row['impl']:<26}"
        if "error" in row:
            lines.append(f"{head} error: {row['error'][:70]}")
            continue
        lines.append(
            f"{head} {row.get('fwd_tflops', 0):>9.1f} {row.get('fwd_bwd_tflops', 0):>9.1f} "
            f"{row.get('fwd_ms', 0):>8.3f} {row.get('fwd_bwd_ms', 0):>8.3f} "
            f"{row.get('fwd_rel_err', 0):>8.1e}"
        )
    return lines
