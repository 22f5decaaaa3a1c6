"""The GPU check's exchange section: the layer's token exchange (`comm.exchange_by_backend`) and its
replica-weight exchange (`transfer.fetch_replica_experts`), each timed against a plain device
copy of the same bytes, for the "ragged" (`jax.lax.ragged_all_to_all`) and "padded" backends,
under each XLA flag variant; the ragged path's values and gradients against the padded path's;
and where the replica transfer sits in the compiled schedule of the experts' forward + backward
(`hlo_schedule`). See `experiments.gpu.check`.

XLA reads ``XLA_FLAGS`` once, when its backend starts, and aborts on a flag it does not know, so
each variant runs in a child process (``python -m experiments.gpu.exchange_child SPEC.json``;
`experiments.gpu.exchange_run` starts the children and reads their results); a
child that dies naming an unknown flag is reported as "flag not known to this jaxlib". The ranks
are every GPU of the machine (EP = 1 on one GPU still runs the collective kernels); the dry run
uses 4 CPU devices, where XLA cannot compile ``ragged_all_to_all``: only the padded path runs.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.lab.stepmodel.shapes import ANCHOR
from experiments.lab.walltime import median_seconds
from ultraep_jax.tools import Exchange, exchange_by_backend, fetch_replica_experts

AXIS = "expert"
#: What the dry run (XLA:CPU) records in place of a ragged exchange's figures.
SKIP_RAGGED = "skipped: XLA:CPU cannot compile ragged_all_to_all (the dry run runs the padded path)"


@dataclasses.dataclass(frozen=True)
class ExchangeSetup:
    """Sizes of what the section exchanges, per rank.

    Attributes:
      rows: token rows each rank sends (tokens x top-k), balanced over the ranks.
      d_model, d_ff: D of a token row; D and F of an expert (w_gate, w_up [D, F], w_down [F, D]).
      masters: E_m, experts each rank masters.
      slots: S <= E_m replica slots per rank, every one filled (from the next rank's masters).
      capacity_factor: receive-buffer rows per rank, x ``rows`` (the layer's).
      dtype: of tokens and weights.
      check_rows: rows per rank of the gradient checks and of the replica step.
      kernel: the replica step's expert kernel (`ultraep_jax.config.execution.KERNELS`).
      repeats, inner: timed samples (medians), and back-to-back calls per sample.
    """

    rows: int
    d_model: int
    d_ff: int
    masters: int
    slots: int
    capacity_factor: float
    dtype: str
    check_rows: int
    kernel: str
    repeats: int
    inner: int

    def __post_init__(self):
        if not 1 <= self.slots <= self.masters:
            raise ValueError(f"ExchangeSetup: slots must be in [1, masters], got {self.slots}")

    @property
    def capacity(self) -> int:
        """C, receive-buffer rows per rank."""
        return math.ceil(self.capacity_factor * self.rows)


#: The anchor's setup (`experiments.lab.stepmodel.shapes.ANCHOR`: DeepSeek-V3 at EP64, 8192 tokens x
#: top-8 per rank, bf16, 256 / 64 = 4 experts per rank, 2 slots).
DEEPSEEK_V3 = ExchangeSetup(
    ANCHOR.pairs_per_rank,
    ANCHOR.shape.hidden,
    ANCHOR.shape.expert_ffn,
    ANCHOR.experts_per_rank,
    ANCHOR.slots_per_rank,
    1.05,
    "bfloat16",
    ANCHOR.tokens_per_rank,
    "auto",
    15,
    4,
)
#: The dry run's: tiny, float32 (XLA:CPU has no fast bf16 path), XLA's ragged_dot for the experts
#: so that the compiled step holds matmul instructions to find.
DRY = ExchangeSetup(48, 16, 8, 2, 2, 1.25, "float32", 40, "ragged_dot", 2, 1)


# -- the exchanges, as the layer runs them ---------------------------------------------------


def exchange_mesh(devices) -> Mesh:
    """The programs' mesh: ``devices`` on the one axis `AXIS` (of type Auto)."""
    return Mesh(np.array(devices), (AXIS,))


def balanced_sizes(R: int, rows: int) -> np.ndarray:
    """int32 [R(src), R(dst)]: every rank sends its ``rows`` evenly to every rank."""
    return np.tile(np.diff(np.linspace(0, rows, R + 1).astype(np.int64)), (R, 1)).astype(np.int32)


def random_sizes(rng, R: int, rows: int) -> np.ndarray:
    """int32 [R(src), R(dst)]: each rank sends up to ``rows`` (some unsent) to random peers in
    random amounts, some blocks empty."""
    out = np.zeros((R, R), np.int32)
    for s in range(R):
        p = rng.random(R) * (rng.random(R) < 0.75)
        p = p if p.sum() else np.ones(R)
        out[s] = rng.multinomial(int(rng.integers(rows // 2, rows + 1)), p / p.sum())
    return out


def block_offsets(sizes_RR: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(src_start_RR, dst_start_RR), int32: each sender lays its blocks out in destination order,
    each receiver its blocks in source order, both from row 0."""
    src = np.cumsum(sizes_RR, axis=1) - sizes_RR
    dst = np.cumsum(sizes_RR, axis=0) - sizes_RR
    return src.astype(np.int32), dst.astype(np.int32)


def token_exchange(mesh, send_rows: int, recv_rows: int, backend: str):
    """jit: (operand [R * send_rows, D] split over the ranks, sizes_RR, src_start_RR,
    dst_start_RR) -> [R * recv_rows, D]: `comm.exchange_by_backend` on every rank with the layer's
    ``max_chunk`` (``min(send_rows, recv_rows)``)."""

    def per_rank(operand, sizes, src, dst):
        rank = jax.lax.axis_index(AXIS)
        chunk = min(send_rows, recv_rows)
        ex = Exchange(sizes, src, dst, rank, send_rows, recv_rows, chunk)
        return exchange_by_backend(operand, ex, axis_name=AXIS, backend=backend)

    specs = (P(AXIS), P(), P(), P())
    return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=specs, out_specs=P(AXIS)))


def filled_slots(R: int, masters: int, slots: int) -> np.ndarray:
    """int32 [R, S]: slot s of rank r holds master s of rank r + 1 (mod R; on one rank, its
    own)."""
    return np.array(
        [[((r + 1) % R) * masters + s for s in range(slots)] for r in range(R)], np.int32
    )


def weight_exchange(mesh, backend: str):
    """jit: (slot_expert_RS, w_gate, w_up, w_down [R * E_m, ...] split over the ranks) -> the slots'
    weights [R * S, ...]: `transfer.fetch_replica_experts` on every rank, in one hop."""

    def per_rank(slots_RS, *masters):
        return fetch_replica_experts(masters, slots_RS, axis_name=AXIS, backend=backend)

    specs = (P(AXIS),) * 3
    return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), *specs), out_specs=specs))


def device_copy():
    """jit: (x, zero) -> x + zero, a runtime zero so that XLA keeps the pass: each device reads
    and writes its shard once, the bytes a local copy moves."""

    return jax.jit(lambda x, zero: x + zero)


def random_split(mesh, shape, dtype, seed: int):
    """A standard normal array of ``shape`` split over the ranks (``AXIS``) on its first axis,
    drawn there from ``seed``."""

    draw = jax.jit(
        lambda k: jax.random.normal(k, shape, dtype),
        out_shardings=NamedSharding(mesh, P(AXIS)),
    )
    return draw(jax.random.key(seed))


# -- the child: one XLA flag variant ----------------------------------------------------------


def _rate(payload: int, seconds: float, copy_seconds: float) -> dict:
    return {
        "ms": 1e3 * seconds,
        "gbps": payload / seconds / 1e9,
        "x_copy": copy_seconds / seconds,  # throughput relative to the copy of the same bytes
    }


def time_tokens(mesh, s: ExchangeSetup, backends) -> dict:
    """The token exchange of ``s.rows`` rows per rank, balanced over the ranks, per backend,
    against a device copy of the same bytes."""

    R = mesh.size
    sizes = balanced_sizes(R, s.rows)
    src, dst = block_offsets(sizes)
    operand = random_split(mesh, (R * s.rows, s.d_model), s.dtype, 0)
    payload = s.rows * s.d_model * jnp.dtype(s.dtype).itemsize
    zero = jnp.zeros((), s.dtype)
    copy = device_copy()
    t_copy = median_seconds(lambda: copy(operand, zero), s.repeats, s.inner)
    out = {
        "payload_bytes_per_rank": payload,
        "copy": _rate(payload, t_copy, t_copy),
        "padded_rows_moved_per_rank": R * min(s.rows, s.capacity),
    }
    for backend in backends:
        fn = token_exchange(mesh, s.rows, s.capacity, backend)
        seconds = median_seconds(lambda fn=fn: fn(operand, sizes, src, dst), s.repeats, s.inner)
        out[backend] = _rate(payload, seconds, t_copy)
    return out


def random_masters(mesh, s: ExchangeSetup, seed: int) -> tuple:
    """Random (w_gate, w_up [R * E_m, D, F], w_down [R * E_m, F, D]), split over the ranks."""
    R, D, F = mesh.size, s.d_model, s.d_ff
    shapes = [(R * s.masters, D, F), (R * s.masters, D, F), (R * s.masters, F, D)]
    return tuple(random_split(mesh, shape, s.dtype, seed + i) for i, shape in enumerate(shapes))


def time_weights(mesh, s: ExchangeSetup, backends) -> dict:
    """The replica-weight exchange filling ``s.slots`` slots per rank, per backend, against a
    device copy of the same bytes."""

    R = mesh.size
    masters = random_masters(mesh, s, 10)
    slots = filled_slots(R, s.masters, s.slots)
    expert = 3 * s.d_model * s.d_ff
    payload = s.slots * expert * jnp.dtype(s.dtype).itemsize
    same_bytes = random_split(mesh, (R * s.slots, expert), s.dtype, 20)
    zero = jnp.zeros((), s.dtype)
    copy = device_copy()
    t_copy = median_seconds(lambda: copy(same_bytes, zero), s.repeats, s.inner)
    out = {"payload_bytes_per_rank": payload, "copy": _rate(payload, t_copy, t_copy)}
    for backend in backends:
        fn = weight_exchange(mesh, backend)
        seconds = median_seconds(lambda fn=fn: fn(slots, *masters), s.repeats, s.inner)
        out[backend] = _rate(payload, seconds, t_copy)
    return out


def compare_arrays(got, want) -> dict:
    """``{"equal", "max_abs_diff", "finite"}`` of two lists of arrays ``got`` and ``want`` (same
    shapes, pairwise): bit equality, the largest absolute difference (as float32) and whether
    every value of ``got`` is finite."""
    got = [np.asarray(a, np.float32) for a in got]
    want = [np.asarray(a, np.float32) for a in want]
    return {
        "equal": all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)),
        "max_abs_diff": max(
            float(np.max(np.abs(a - b), initial=0.0)) for a, b in zip(got, want, strict=True)
        ),
        "finite": all(bool(np.all(np.isfinite(a))) for a in got),
    }


def token_values_and_vjp(mesh, s: ExchangeSetup, backend: str, seed: int = 1):
    """(output, gradient of sum(output * cotangent) w.r.t. the operand) of one token exchange
    of random sizes (``s.check_rows`` rows per rank), as NumPy, with the inputs: (out, grad,
    (operand, cotangent, sizes_RR, recv_rows))."""

    R = mesh.size
    rng = np.random.default_rng(seed)
    sizes = random_sizes(rng, R, s.check_rows)
    src, dst = block_offsets(sizes)
    recv = int(sizes.sum(axis=0).max()) + 3  # some rows nobody writes
    operand = random_split(mesh, (R * s.check_rows, s.d_model), s.dtype, seed)
    cot = random_split(mesh, (R * recv, s.d_model), s.dtype, seed + 1)
    fn = token_exchange(mesh, s.check_rows, recv, backend)

    @jax.jit
    def run(x, c):
        out, pullback = jax.vjp(lambda x: fn(x, sizes, src, dst), x)
        return out, pullback(c)[0]

    out, grad = run(operand, cot)
    return np.asarray(out), np.asarray(grad), (np.asarray(operand), np.asarray(cot), sizes, recv)


def weight_cotangents(mesh, s: ExchangeSetup, masters, seed: int) -> list:
    """Random cotangents of the slots' weights, [R * S, ...] each, split over the ranks."""
    return [
        random_split(mesh, (mesh.size * s.slots,) + w.shape[1:], s.dtype, seed + 5 + i)
        for i, w in enumerate(masters)
    ]


def weight_values_and_vjp(mesh, s: ExchangeSetup, backend: str, seed: int = 2):
    """(slots' weights, gradients of sum(weights * cotangents) w.r.t. the masters), as lists of
    NumPy arrays."""

    masters = random_masters(mesh, s, seed)
    slots = filled_slots(mesh.size, s.masters, s.slots)
    fn = weight_exchange(mesh, backend)
    cots = weight_cotangents(mesh, s, masters, seed)

    @jax.jit
    def run(masters, cots):
        out, pullback = jax.vjp(lambda *m: fn(slots, *m), *masters)
        return out, pullback(tuple(cots))

    out, grads = run(masters, cots)
    return [np.asarray(a) for a in out], [np.asarray(g) for g in grads]


def check_gradients(mesh, s: ExchangeSetup, dry: bool) -> dict:
    """The ragged path's values and vjp against the padded path's on the same inputs, for the
    token exchange (random sizes) and the weight exchange: both only move rows, so they must be
    bit-equal."""
    if dry:
        return {"status": SKIP_RAGGED}
    out = {}
    ragged = token_values_and_vjp(mesh, s, "ragged")
    padded = token_values_and_vjp(mesh, s, "padded")
    out["tokens_forward"] = compare_arrays([ragged[0]], [padded[0]])
    out["tokens_vjp"] = compare_arrays([ragged[1]], [padded[1]])
    ragged = weight_values_and_vjp(mesh, s, "ragged")
    padded = weight_values_and_vjp(mesh, s, "padded")
    out["weights_forward"] = compare_arrays(ragged[0], padded[0])
    out["weights_vjp"] = compare_arrays(ragged[1], padded[1])
    out["status"] = "ok" if all(v["equal"] and v["finite"] for v in out.values()) else "MISMATCH"
    return out
