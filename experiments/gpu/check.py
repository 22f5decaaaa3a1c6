"""The GPU check: correctness and timings of the GPU path, on one GPU.

        python -m experiments.gpu.check --out=runs/gpu            # on an H100 / H200
        python -m experiments.gpu.check --out=runs/gpu --sections=planner,gmm
        python -m experiments.gpu.check --dry_run    # anywhere: every section on CPU,
                                                           # tiny shapes, kernel interpreted

Sections (``--sections``; a table is printed, ``--out/gpu_results.json`` is rewritten after each):

env      the device, its compute capability, the versions of jax, jaxlib, the CUDA plugin, Triton.
planner  (a) the CUDA planner's plans equal the CPU handler's, bit for bit, on random load matrices
         of several configurations (chosen so that every branch of the threshold search is taken:
         fast path, coarse probes, refine probes, none) and on the anchor's reference workloads
         (`experiments.gpu.planner.reference_loads`: rank-level Zipf at the step model's
         ``ANCHOR``, stepmodel/shapes.toml); through JAX (``jit(vmap(plan))`` on the GPU vs
         on the CPU, and the same with ``parallel=True``) and through the CUDA library's
         benchmark hook, with each of its kernels (the core of planner.h on one thread; the
         parallel form of planner_parallel.h, a block of warps per plan).
         (b) time per plan at the anchor's setup: kernel time by CUDA events for each kernel
         (the hook: median over --repeats launches of one plan, and of a batch of --plan_batch
         plans divided by the batch), and through JAX (the default kernel): a chain of 64
         dependent plans in one
         jitted function (the difference to a chain of 8, per plan; includes one tiny fused add
         per plan), single-plan wall latency, batched ``jit(vmap(plan))``.
gmm      (c) grouped matmul, bf16, the anchor's expert shape (DeepSeek-V3's, stepmodel/shapes.toml):
         K = d_model, N = expert d_ff: TFLOP/s of JAX's Hopper Mosaic GPU ragged-dot kernels
         (each of --mgpu_configs), of tokamax's ragged dot (where installed), of
         ``jax.lax.ragged_dot``
         and of a dense [M, K] @ [K, N] matmul of the same FLOPs, forward and forward + backward,
         at M = --gmm_rows, G = 8, balanced; then the fastest of each kind over G in --gmm_groups,
         M in --gmm_sizes, balanced and skewed group sizes (Zipf 1.2 over the groups). Relative
         errors ||out - ref|| / ||ref|| against float32 ``ragged_dot`` of the same bf16 inputs.
exchange (e) the token exchange (the anchor's tokens x top-k of D bf16 per rank) and the
         replica-weight exchange (its slots of D / F experts per rank) over every GPU (EP = 1 on
         one), for
         the ragged and padded backends, in GB/s against a device copy of the same bytes; the
         ragged path's values and gradients against the padded path's; the replica step's
         compiled schedule (does the transfer run while the masters' matmuls do?); each under
         every --exchange_variants XLA flag setting, in a child process (a flag this jaxlib does
         not know is reported as such). `experiments.gpu.exchange`.
moe      (d) the MoE layer (uep.MoE) forward + backward on one GPU (EP = 1 mesh), balancer on vs
         off, for each --moe_kernels expert kernel: median step ms and the ratio; the optimized HLO
         of the balanced step (written to --out) and where its replica-weight path sits in the
         schedule relative to the masters' matmuls.

Timings are medians over --repeats samples; a sample times --inner back-to-back calls and
blocks once (so the host's dispatch overlaps the device's work), divided by --inner.
Without a GPU (and without --dry_run) it prints one line and exits with code 2. The sections
are in `experiments.gpu.planner`, `gpu_exchange`, `gpu_gmm` and `gpu_moe`.
"""

from __future__ import annotations

import dataclasses
import os
import sys

if "--dry_run" in sys.argv or "--dry_run=true" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts a backend

import traceback

import jax
from absl import flags

from experiments.gpu import exchange as gpu_exchange
from experiments.gpu import exchange_run
from experiments.gpu import gmm as gpu_gmm
from experiments.gpu import moe as gpu_moe
from experiments.gpu import planner as gpu_planner
from experiments.lab.output_files import write_json
from experiments.lab.program import run_main
from ultraep_jax import tools

_OUT = flags.DEFINE_string("out", None, "Folder for gpu_results.json and the HLO dump (created).")
_DRY = flags.DEFINE_bool("dry_run", False, "Run every section on CPU with tiny shapes.")
_SECTIONS = flags.DEFINE_list(
    "sections", ["env", "planner", "exchange", "gmm", "moe"], "Sections to run."
)
_REPEATS = flags.DEFINE_integer("repeats", 15, "Timed samples (medians are reported).")
_INNER = flags.DEFINE_integer("inner", 4, "Back-to-back calls per timed sample.")
_PLAN_BATCH = flags.DEFINE_integer("plan_batch", 1024, "Matrices per batched planner call.")
_GMM_ROWS = flags.DEFINE_integer("gmm_rows", 32768, "M of the kernel-settings sweep.")
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
    "MoE rows: expert kernels, each optionally with /<comm_backend> (e.g. auto/padded).",
)
_EXCHANGE_VARIANTS = flags.DEFINE_list(
    "exchange_variants",
    list(exchange_run.VARIANTS),
    f"XLA flag settings of the exchange section: names ({', '.join(exchange_run.VARIANTS)}) or "
    "flags (--xla_...=v, several joined by +).",
)
_EXCHANGE_TIMEOUT = flags.DEFINE_float(
    "exchange_timeout", 240.0, "Seconds each exchange variant's child process may take."
)
_EXCHANGE_ROWS = flags.DEFINE_integer(
    "exchange_rows", 65536, "Token rows per rank of the exchange section (tokens x top-k)."
)
_DUMP_HLO = flags.DEFINE_bool("dump_hlo", True, "Write the balanced MoE step's optimized HLO.")
_PROFILE = flags.DEFINE_bool(
    "profile", True, "Profile the first MoE row's steps (device time per kernel name)."
)


def section_env(device) -> dict:
    """The device, its compute capability, and the versions of the packages that matter."""
    import importlib.metadata as md

    out = {"device_kind": getattr(device, "device_kind", str(device))}
    out["compute_capability"] = str(getattr(device, "compute_capability", ""))
    out["core_count"] = getattr(device, "core_count", None)
    for pkg in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "triton", "flax"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    out["cuda_planner_handler"] = tools.has_cuda_handler()
    return out


def _env_lines(env: dict) -> list[str]:
    """The env section's results as table lines."""
    line = (
        f"device: {env.get('device_kind')} (cc {env.get('compute_capability')}, "
        f"{env.get('core_count')} SMs)  jax {env.get('jax')} jaxlib {env.get('jaxlib')} "
        f"plugin {env.get('jax-cuda13-plugin')} triton {env.get('triton')}"
    )
    return [line]


def _run_section(name: str, device, dry: bool) -> dict:
    """Runs the section ``name`` with the flags' settings."""
    if name == "env":
        return section_env(device)
    if name == "planner":
        return gpu_planner.section_planner(device, dry, _REPEATS.value, _PLAN_BATCH.value)
    if name == "gmm":
        sweep = gpu_gmm.GmmSweep(
            rows=_GMM_ROWS.value,
            mgpu_configs=tuple(_MGPU_CONFIGS.value),
            groups=tuple(int(g) for g in _GMM_GROUPS.value),
            sizes=tuple(int(m) for m in _GMM_SIZES.value),
            repeats=_REPEATS.value,
            inner=_INNER.value,
        )
        return gpu_gmm.section_gmm(device, dry, sweep)
    if name == "exchange":
        run = exchange_run.ExchangeRun(
            variants=exchange_run.parse_variants(_EXCHANGE_VARIANTS.value),
            setup=dataclasses.replace(
                gpu_exchange.DEEPSEEK_V3,
                rows=_EXCHANGE_ROWS.value,
                repeats=_REPEATS.value,
                inner=_INNER.value,
            ),
            timeout_s=_EXCHANGE_TIMEOUT.value,
            out_dir=os.path.join(_OUT.value, "variants") if _OUT.value else None,
        )
        return exchange_run.section_exchange(device, dry, run)
    rows = gpu_moe.MoeRows(
        tokens=_MOE_TOKENS.value,
        kernels=tuple(_MOE_KERNELS.value),
        repeats=_REPEATS.value,
        out_dir=_OUT.value,
        dump_hlo=_DUMP_HLO.value,
        profile=_PROFILE.value,
    )
    return gpu_moe.section_moe(device, dry, rows)


#: Each section's table lines, in table order.
_LINES = {
    "env": _env_lines,
    "planner": gpu_planner.planner_lines,
    "exchange": exchange_run.exchange_lines,
    "gmm": gpu_gmm.gmm_lines,
    "moe": gpu_moe.moe_lines,
}

flags.register_validator(
    "sections", lambda names: set(names) <= set(_LINES), f"each must be one of {', '.join(_LINES)}"
)


def main(argv):
    """Runs the ``--sections`` and prints their table; ``--out`` also gets the JSON."""
    del argv
    dry = _DRY.value
    if "exchange" in _SECTIONS.value and not dry:
        # Its child processes need GPU memory beside this one's: no preallocation here (read when
        # the backend starts, below).
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not dry and not gpus:
        print(
            "gpu_check: no GPU visible to JAX (devices: "
            f"{sorted({d.platform for d in jax.devices()})}); use --dry_run to check the script"
        )
        sys.exit(2)
    device = jax.devices("cpu")[0] if dry else gpus[0]
    results = {"dry_run": dry}
    failed = []
    for name in _SECTIONS.value:
        print(f"== {name}", flush=True)
        try:
            results[name] = _run_section(name, device, dry)
        except Exception as e:  # noqa: BLE001 -- one broken section must not hide the others
            traceback.print_exc()
            results[name] = {"error": repr(e)[:1000]}
            failed.append(name)
        if _OUT.value:
            write_json(os.path.join(_OUT.value, "gpu_results.json"), results)
    lines = []
    for name, to_lines in _LINES.items():
        if isinstance(results.get(name), dict) and "error" not in results[name]:
            lines += to_lines(results[name])
    print("\n".join(lines))
    if failed:
        print(f"gpu_check: sections failed: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    run_main(main)
