"""The step model's rates, in one object (`Calibration`), and their fits from measurements:
the per-rank replay's timed ranks with its provenance (the calibration file, `ExpertCost`) and
this machine's pinned CPU ranks (`experiments.bench.rates`'s file, `PinnedFit`).

Every rate the model charges is a named field of `Calibration`, so that a fit to measurements
replaces it in one place: the experts' rate (a FLOP rate, or the replay's measured fixed,
per-row and per-group costs), the links' efficiency or measured rate per link class, the
planner's time per plan and a per-layer launch latency. A field left at None falls back to the
nominal figure it names (the cluster's datasheet times an efficiency, or a timing taken on this
machine).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys

import numpy as np

from experiments.lab.stepmodel.links import Links
from experiments.lab.stepmodel.shapes import Cluster

#: The grouped-matmul rate of a GPU when none is measured: JAX's Mosaic GPU kernel on an H100,
#: bf16, 549-566 TFLOP/s forward at DeepSeek-V3's expert shape (docs/gpu.md).
GPU_GMM_TFLOPS = 550.0
#: What `GPU_GMM_TFLOPS` describes.
GPU_GMM = "H100 SXM, JAX's Mosaic GPU grouped matmul, bf16"


@dataclasses.dataclass(frozen=True)
class ExpertCost:
    """One rank's expert compute (forward + backward) as measured by the per-rank replay
    (``python -m experiments.replay --calibration_out``): ``fixed + per_row * rows +
    per_group * groups`` seconds at the replay's shape, fitted over every rank it timed.

    Attributes:
      fixed_s, per_row_s, per_group_s: the fitted seconds (training mode).
      d_model, d_ff: the replay's D and F.
      pairs_per_rank: the mean rows per rank the replay ran (the buffer it allocated follows them).
      device: what the replay ran on.
      provenance: machine, commit, command and date of the replay.
      measured: the replay's own ultraep figures (one dict per workload, EP size and mode).
    """

    fixed_s: float
    per_row_s: float
    per_group_s: float
    d_model: int
    d_ff: int
    pairs_per_rank: int
    device: str
    provenance: dict
    measured: tuple

    @classmethod
    def read(cls, path) -> ExpertCost:
        """The training-mode costs of a replay calibration file (ValueError naming the file if it
        has none, or a negative cost: a cost model has no term that pays back time)."""
        with open(path) as f:
            data = json.load(f)
        if "train" not in data:
            raise ValueError(f"{path}: no training-mode costs (run the replay with --mode=train)")
        fit, shape = data["train"], data["shape"]
        for key in ("seconds_fixed", "seconds_per_row", "seconds_per_group"):
            if fit[key] < 0:
                raise ValueError(f"{path}: train {key}={fit[key]} is negative (refit it)")
        return cls(
            fixed_s=fit["seconds_fixed"],
            per_row_s=fit["seconds_per_row"],
            per_group_s=fit["seconds_per_group"],
            d_model=shape["d_model"],
            d_ff=shape["d_ff"],
            pairs_per_rank=fit["pairs_per_rank"],
            device=data["provenance"]["device"],
            provenance=data["provenance"],
            measured=tuple(data.get("measured", ())),
        )

    def seconds(self, rows, groups, hidden: int, ffn: int, mean_rows: int) -> np.ndarray:
        """Expert seconds of ranks with ``rows`` rows in ``groups`` non-empty groups (arrays) for
        experts of width ``hidden`` x ``ffn`` at ``mean_rows`` rows per rank on average: the
        per-row and per-group terms scaled by FLOPs per row (``hidden * ffn`` against the
        replay's), the fixed term (the replay's buffer work) by that and by the buffer's rows."""
        width = hidden * ffn / (self.d_model * self.d_ff)
        buffer = mean_rows / self.pairs_per_rank
        rows, groups = np.asarray(rows, np.float64), np.asarray(groups, np.float64)
        return width * (self.fixed_s * buffer + self.per_row_s * rows + self.per_group_s * groups)


@dataclasses.dataclass(frozen=True)
class Linear:
    """``seconds = sum(coef[i] * x[i])`` over named terms, fitted >= 0 (a cost model: no term
    pays back time)."""

    names: tuple[str, ...]
    coef: tuple[float, ...]

    def __post_init__(self):
        if len(self.names) != len(self.coef) or min(self.coef, default=0) < 0:
            raise ValueError(f"Linear: {self.names} with coefficients {self.coef}")

    @classmethod
    def fit(cls, names: tuple[str, ...], x, seconds) -> Linear:
        """The non-negative least-squares fit of ``seconds`` [m] on ``x`` [m, len(names)]."""
        coef = nonnegative_least_squares(np.asarray(x, np.float64), np.asarray(seconds))
        return cls(names, tuple(float(c) for c in coef))

    def __call__(self, *x: float) -> float:
        return float(np.dot(self.coef, x))


@dataclasses.dataclass(frozen=True)
class PinnedFit:
    """The layer terms measured on this machine's two pinned CPU ranks (`experiments.bench.rates`'s
    file, fitted by `experiments.lab.stepmodel.cpu_rates.read_calibration`), each a `Linear` fit.

    Attributes:
      d_model, top_k, ep, experts_per_rank, capacity_factor: the layer's shape.
      experts: per mode, the plain kernel's seconds of (1, C, rows, groups).
      stage: per mode and replicas (0, 1), the balanced program's expert stage's seconds of
        (1, C, rows, groups).
      other: per mode, the bookkeeping's seconds of (1, T, C).
      a2a: one token all-to-all's seconds of (1, bytes per rank).
      provenance: machine, commit, command and date of the rates.
    """

    d_model: int
    top_k: int
    ep: int
    experts_per_rank: int
    capacity_factor: float
    experts: dict
    stage: dict
    other: dict
    a2a: Linear
    provenance: dict

    def __post_init__(self):
        if not set(self.experts) == set(self.stage) == set(self.other):
            raise ValueError(f"PinnedFit: modes {sorted(self.experts)} vs {sorted(self.other)}")


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The step model's rates (the terms a fit to measurements sets).

    Attributes:
      gemm_efficiency: fraction of the BF16 dense peak the GEMMs reach.
      expert_tflops: the experts' grouped-matmul rate in TFLOP/s (None: the cluster's peak x
        gemm_efficiency).
      expert_cost: the replay's measured fixed, per-row and per-group expert costs (None: the
        experts follow their FLOPs at the rate above).
      link_efficiency: fraction of the nominal link bandwidth the transfers reach.
      nvlink_gbps: a measured NVLink rate per rank and direction, GB/s (None: nominal x
        link_efficiency).
      ib_gbps: a measured InfiniBand rate per rank and direction, GB/s (None: nominal x
        link_efficiency).
      planner_s: seconds per plan on the step's critical path (None: timed on this machine).
      launch_s: kernel-launch latency per MoE layer on the critical path, seconds.
      pinned: the layer's terms as fitted on this machine's pinned CPU ranks (`PinnedFit`; None:
        the FLOP and link terms above). With it, ``planner_s`` is the rates file's timed plan.
    """

    gemm_efficiency: float = 0.65
    expert_tflops: float | None = None
    expert_cost: ExpertCost | None = None
    link_efficiency: float = 0.8
    nvlink_gbps: float | None = None
    ib_gbps: float | None = None
    planner_s: float | None = None
    launch_s: float = 0.0
    pinned: PinnedFit | None = None

    def __post_init__(self):
        for field in ("gemm_efficiency", "link_efficiency"):
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"Calibration.{field}={getattr(self, field)} must be in (0, 1]")
        for field in ("expert_tflops", "nvlink_gbps", "ib_gbps"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"Calibration.{field}={value} must be > 0")
        for field in ("planner_s", "launch_s"):
            value = getattr(self, field)
            if value is not None and value < 0:
                raise ValueError(f"Calibration.{field}={value} must be >= 0")

    def gemm_tflops(self, cluster: Cluster) -> float:
        """The dense GEMMs' rate on ``cluster``: its peak x ``gemm_efficiency``."""
        return cluster.peak_bf16_tflops * self.gemm_efficiency

    def links(self, cluster: Cluster) -> Links:
        """``cluster``'s links at the measured rates, or nominal x ``link_efficiency``."""
        eff = self.link_efficiency

        def rate(measured, nominal):
            return 1e9 * (measured if measured is not None else nominal * eff)

        return Links(
            cluster.nvlink_domain,
            rate(self.nvlink_gbps, cluster.nvlink_gbps),
            rate(self.ib_gbps, cluster.ib_gbps),
        )


# -- the fit of the experts' costs from the replay's timed ranks -------------------------------


def nonnegative_least_squares(a: np.ndarray, t: np.ndarray) -> np.ndarray:
    """float [n]: the ``x >= 0`` that minimises ``||a @ x - t||`` for ``a`` [m, n], ``t`` [m], with
    few columns (n <= 12): the unconstrained fit on every subset of columns, keeping the best one
    whose coefficients are all >= 0 (the constrained optimum is the unconstrained fit on its own
    support, so this finds it)."""
    a, t = np.asarray(a, np.float64), np.asarray(t, np.float64)
    n = a.shape[1]
    if n > 12:
        raise ValueError(f"nonnegative_least_squares: {n} columns, at most 12")
    best, best_err = np.zeros(n), float(t @ t)
    for mask in range(1, 2**n):
        cols = [j for j in range(n) if mask >> j & 1]
        x = np.zeros(n)
        x[cols] = np.linalg.lstsq(a[:, cols], t, rcond=None)[0]
        err = float(np.sum((a @ x - t) ** 2))
        if np.all(x >= 0) and err < best_err:
            best, best_err = x, err
    return best


def fit_costs(points, capacity: int) -> dict:
    """``seconds = fixed[buffer] + per_row * rows + per_group * groups`` fitted by least squares
    over timed ranks ``(policy, rows, groups, buffer rows, seconds)`` with every cost >= 0 (a cost
    model: no term may pay back time), one fixed term per buffer size (the tiled kernel's buffer
    work), reported at the layer's ``capacity``; with R^2 and the median and worst relative
    error."""
    buffers = sorted({c for *_, c, _ in points})
    a = np.array([[float(c == b) for b in buffers] + [r, g] for _, r, g, c, _ in points])
    t = np.array([s for *_, s in points])
    coef = nonnegative_least_squares(a, t)
    pred = a @ coef
    rel = np.abs(pred - t) / t
    return {
        "seconds_fixed": float(coef[buffers.index(capacity)]),
        "seconds_per_row": float(coef[-2]),
        "seconds_per_group": float(coef[-1]),
        "buffer_rows": capacity,
        "r2": float(1 - np.sum((t - pred) ** 2) / np.sum((t - t.mean()) ** 2)),
        "median_rel_error": float(np.median(rel)),
        "max_rel_error": float(rel.max()),
        "samples": len(points),
    }


def provenance(program: str) -> dict:
    """Machine, device, commit, command (``python -m program`` and this process's arguments),
    date and JAX version of this run."""
    import jax

    root = pathlib.Path(__file__).resolve().parents[3]

    def git(*args) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
            return out.stdout.strip()
        except OSError:
            return ""

    cpu = ""
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {
        "machine": f"{platform.node()} ({cpu or platform.processor()}, {os.cpu_count()} cores)",
        "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
        "commit": git("rev-parse", "HEAD")
        + (
            " (uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
        ),
        "command": f"python -m {program} " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__,
    }


def calibration_file(fits: dict, shape: dict, clock: str, measured: list, program: str) -> dict:
    """The calibration file's content (what `ExpertCost.read` reads): its provenance, the
    replayed ``shape``, the ``clock``, per mode the fitted costs (``fits``: mode -> `fit_costs`
    with ``pairs_per_rank``), and the replay's ``measured`` figures."""
    return {
        "provenance": provenance(program),
        "shape": shape,
        "clock": clock,
        **fits,
        "measured": measured,
    }


# -- GPU-side terms of the anchor's estimate (experiments.stepmodel_programs.anchor), each a band

#: The grouped matmul's forward + backward rate on one H100, TFLOP/s (low, high), for groups of
#: 2048-8192 rows: `experiments/results/gpu_h100.txt` (c), run 3, JAX's Mosaic GPU kernel
#: 128x128x64c5g4, bf16, DeepSeek-V3's expert shape, G=8: 506 (M=16384 skewed) to 550
#: (M=65536); no trend with group size beyond that spread, and no measurement below 2048 rows a
#: group.
GPU_GMM_FWD_BWD_TFLOPS = (506.0, 550.0)
#: Rows of the kernel's tiles (the 128x128x64 configuration): a group's last tile is padded.
GPU_GMM_TILE_ROWS = 128
#: Our planner's time per plan on an H100, ms (low, high): the CUDA serial kernel (the only one
#: left), one plan, CUDA events, at the anchor's setup (`gpu_h100.txt` (b): 244-264 us).
GPU_PLAN_MS = (0.244, 0.264)
#: Latency of one kernel launch on the critical path, us (low, high): an estimate, the range
#: usually reported for back-to-back CUDA kernel launches (a few us each; NVIDIA's "Getting
#: Started with CUDA Graphs" blog measured about 3-4 us per short kernel without graphs).
LAUNCH_US = (2.0, 10.0)
#: Kernels the balanced layer adds to a training layer on a GPU (`gpu_h100.txt` (d), the
#: scheduled balanced step): the planner's custom call, the replica slots' 9 grouped-matmul
#: kernels (3 forward, 6 backward) and the weights' two exchanges (forward, gradients back).
EXTRA_KERNELS = 12
