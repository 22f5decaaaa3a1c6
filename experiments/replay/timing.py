"""The timed part of `experiments.replay`: one rank's own work, with the layer's code and
kernels, on one device, one rank at a time.

Three parts of a rank's work are timed separately:
  planner      `uep.plan` on the all-gathered load matrix, with the layer's capacity (every rank
               computes the same plan): per plan, inside one jitted `vmap` over copies
               (`experiments.lab.walltime.seconds_per_plan`, called by `replay.cell`)
  bookkeeping  the rank's dispatch arithmetic (`dispatch.plan_dispatch`) and its gathers: the send
               buffer, the received rows regrouped by local group and back, the weighted combine
               (forward; forward and backward in training)
  experts      `experts.local_experts` on the rank's rows per local group: its E_m masters, then
               its slot groups (forward; forward and backward in training)
One compiled program per shape (buffer rows, masters, slots) serves every rank: group sizes,
pairs and plans are runtime values. Nothing here crosses between ranks: the exchanges are
modelled (`experiments.lab.stepmodel.links`).

Clock: on a CPU, the CPU time of this process (pin it to one core: XLA:CPU then runs the work on
that core, and other processes sharing the core do not count); elsewhere, wall time.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lab.stepmodel import shapes
from experiments.replay.work import RankWork
from ultraep_jax import tools

MODES = ("train", "prefill")


@dataclasses.dataclass(frozen=True)
class Shape:
    """The layer's shape for the replay.

    Attributes:
      d_model, d_ff: D and F of every expert (SwiGLU).
      dtype: activations and weights ("float32" or "bfloat16").
      kernel: `config.execution.KERNELS` entry for the experts ("auto": tiled on CPU, the GPU
        kernels on CUDA).
    """

    d_model: int
    d_ff: int
    dtype: str
    kernel: str

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return jnp.dtype(self.dtype).itemsize

    @property
    def experts(self) -> shapes.ExpertShape:
        """One expert and its token rows at this shape (their bytes)."""
        return shapes.ExpertShape(self.d_model, self.d_ff, self.itemsize)


def clock() -> Callable[[], float]:
    """Process CPU time on a CPU backend, wall time elsewhere (see the module docstring)."""
    return time.process_time if jax.default_backend() == "cpu" else time.perf_counter


def _random(shape, dtype, seed: int) -> jax.Array:
    """A normal array of ``shape`` scaled to keep SwiGLU outputs of order one (drawn on the
    device: the real shapes' buffers are gigabytes)."""
    draw = jax.jit(jax.random.normal, static_argnums=(1, 2))
    return draw(jax.random.key(seed), tuple(shape), jnp.dtype(dtype)) / float(np.sqrt(shape[-1]))


@functools.cache
def _experts_fn(mode: str, kernel: str):
    """The jitted experts step of one rank: forward, or forward and backward (the gradients of
    rows, master and slot weights for a cotangent)."""

    def forward(rows, masters, replicas, sizes):
        return tools.local_experts(rows, masters, replicas, sizes, kernel)

    if mode == "prefill":
        return jax.jit(forward)

    def train(rows, masters, replicas, sizes, cotangent):
        out, pullback = jax.vjp(lambda r, m, s: forward(r, m, s, sizes), rows, masters, replicas)
        return out, pullback(cotangent)

    return jax.jit(train)


@functools.cache
def _expert_inputs(shape: Shape, capacity: int, masters: int, slots: int):
    """Rows [C, D], master and slot weights, and a cotangent [C, D] (random; values do not change
    the work)."""
    D, F, dt = shape.d_model, shape.d_ff, shape.dtype

    def weights(n, seed):
        if n == 0:
            return None
        return tuple(
            _random(s, dt, seed + i) for i, s in enumerate([(n, D, F), (n, D, F), (n, F, D)])
        )

    rows = _random((capacity, D), dt, 1)
    return rows, weights(masters, 10), weights(slots, 20), _random((capacity, D), dt, 2)


def experts_task(work: RankWork, rank: int, masters: int, shape: Shape, mode: str):
    """A call of ``rank``'s experts under ``work`` (blocks until done)."""
    G = work.group_rows_RG.shape[1]
    rows, m, s, cot = _expert_inputs(shape, work.capacity, masters, G - masters)
    sizes = jnp.asarray(work.group_rows_RG[rank], jnp.int32)
    fn = _experts_fn(mode, shape.kernel)
    args = (rows, m, s, sizes) if mode == "prefill" else (rows, m, s, sizes, cot)
    return lambda: jax.block_until_ready(fn(*args))


@functools.cache
def _bookkeeping_fn(mode: str, capacity: int, top_k: int):
    """The jitted dispatch bookkeeping and gathers of one rank (see the module docstring); the
    rows the exchanges would bring stand in as inputs."""

    def forward(tokens_TD, weights_TK, received_CD, done_CD, experts_N, loads_RE, plan, rank):
        moves = tools.plan_dispatch(experts_N, loads_RE, plan, rank, capacity)
        send_ND = tokens_TD[moves.send_order_N // top_k]
        rows_CD = tools.to_groups(received_CD, moves)
        back_CD = tools.from_groups(done_CD, moves)
        return send_ND, rows_CD, back_CD, tools.combine(send_ND, moves, weights_TK)

    if mode == "prefill":
        return jax.jit(forward)

    def train(tokens_TD, weights_TK, received_CD, done_CD, *rest):
        outs, pullback = jax.vjp(
            lambda *a: forward(*a, *rest), tokens_TD, weights_TK, received_CD, done_CD
        )
        return outs, pullback(outs)

    return jax.jit(train)


@functools.cache
def _bookkeeping_inputs(shape: Shape, tokens: int, top_k: int, capacity: int):
    D, dt = shape.d_model, shape.dtype
    return (
        _random((tokens, D), dt, 3),
        jnp.asarray(np.full((tokens, top_k), 1.0 / top_k, np.float32)),
        _random((capacity, D), dt, 4),
        _random((capacity, D), dt, 5),
    )


def rank_pairs(loads_RE: np.ndarray, rank: int, seed: int) -> np.ndarray:
    """int32 [N]: ``rank``'s (token, choice) pairs, token-major, in a seeded random order, with
    ``loads_RE[rank, e]`` of them routed to expert e."""
    experts = np.repeat(np.arange(loads_RE.shape[1], dtype=np.int32), loads_RE[rank])
    return np.random.default_rng([seed, rank]).permutation(experts)


def bookkeeping_task(work: RankWork, rank: int, top_k: int, shape: Shape, mode: str, seed: int):
    """A call of ``rank``'s dispatch bookkeeping and gathers under ``work`` (blocks)."""
    pairs = rank_pairs(work.loads_RE, rank, seed)
    tokens = pairs.size // top_k
    fn = _bookkeeping_fn(mode, work.capacity, top_k)
    args = (
        *_bookkeeping_inputs(shape, tokens, top_k, work.capacity),
        jnp.asarray(pairs),
        jnp.asarray(work.loads_RE),
        jax.tree.map(jnp.asarray, work.plan),
        jnp.int32(rank),
    )
    return lambda: jax.block_until_ready(fn(*args))


@functools.cache
def _flush_fn():
    """A jitted pass over 64 MiB on the default device (more than the caches of the CPUs and GPUs
    this runs on), and its input."""
    data = jnp.zeros((16 << 20,), jnp.float32)
    step = jax.jit(lambda a: a + 1.0)
    return lambda: jax.block_until_ready(step(data))


def sample_times(
    tasks: Mapping[object, Callable[[], object]], rounds: int, warm_up: bool = True
) -> list[dict]:
    """Seconds of every task in each of ``rounds`` rounds (one dict per round), after one call
    each that compiles (``warm_up``). Every round runs the tasks in their order, so tasks next to
    each other see the machine in the same state, and each timed call starts with cold caches (a
    pass over 64 MiB before it, not timed): a call right after another that swept the caches with
    larger buffers took up to 1.18x one after a call of its own size."""
    tick = clock()
    flush = _flush_fn()
    if warm_up:
        for run in tasks.values():
            run()
    out = []
    for _ in range(rounds):
        times = {}
        for key, run in tasks.items():
            flush()
            start = tick()
            run()
            times[key] = tick() - start
        out.append(times)
    return out


def time_ranks(works: dict, ep: int, masters: int, top_k: int, mode: str, settings):
    """Each rank's measured seconds under each policy of ``works`` (which holds ``"ideal"``);
    ``settings``: the replay's `experiments.replay.cell.Settings`.

    Experts: every rank of every policy, ``settings.repeats`` rounds; in each round rank r's
    tasks run back to back, the ideal's rank r first, and each is taken relative to it: other
    processes sharing the core slow both alike, so the ratio cancels what the machine's load did
    at that moment (the ideal's ranks all do the same work). A rank's cost is its median ratio
    times the ideal's time (the median over its ranks of each one's fastest round). Then each
    policy's ``settings.refine`` costliest ranks are timed again until they all have
    ``settings.refine_rounds`` rounds (the busiest rank is a maximum, which noise inflates). The
    ideal's tasks also run a second time as if they were a policy's: its busiest rank against the
    ideal is what noise alone costs a policy whose ranks all do the ideal's work. Bookkeeping: its
    shapes (pairs, buffer rows) are the same on every rank of a policy, so it is
    timed on the ``settings.bookkeeping_ranks`` ranks that receive the most rows (fastest round,
    slowest rank).

    Returns:
      (experts, bookkeeping, noise): {policy: [R] seconds}, {policy: seconds}, and the busiest
      rank of the ideal timed again, relative to the ideal (1: no noise).
    """
    shape = settings.shape
    again_ideal = "ideal, timed again"
    order = ["ideal", *(p for p in works if p != "ideal"), again_ideal]
    tasks = {
        (p, r): experts_task(works["ideal" if p == again_ideal else p], r, masters, shape, mode)
        for r in range(ep)
        for p in order
    }
    rounds = sample_times(tasks, settings.repeats)

    def cost(p, r):
        return statistics.median(
            t[(p, r)] / t[("ideal", r)] for t in rounds if (p, r) in t and ("ideal", r) in t
        )

    # Racing: re-time each policy's costliest ranks until the `refine` costliest all have
    # `refine_rounds` paired rounds (a maximum over noisy estimates picks the noisiest).
    for _ in range(4 * -(-settings.refine_rounds // settings.repeats)):
        again = {
            (p, r)
            for p in order[1:]
            for r in sorted(range(ep), key=lambda r, p=p: -cost(p, r))[: settings.refine]
            if sum((p, r) in t for t in rounds) < settings.refine_rounds
        }
        if not again:
            break
        again |= {("ideal", r) for _, r in again}
        more = [k for k in tasks if k in again]  # rank-major, the ideal first
        rounds += sample_times({k: tasks[k] for k in more}, settings.repeats, False)
    ideal = statistics.median(
        min(t[("ideal", r)] for t in rounds if ("ideal", r) in t) for r in range(ep)
    )
    book_tasks = {
        (p, int(r)): bookkeeping_task(w, int(r), top_k, shape, mode, settings.seed)
        for p, w in works.items()
        for r in np.argsort(-w.rows_R, kind="stable")[: settings.bookkeeping_ranks]
    }
    book = sample_times(book_tasks, settings.repeats)
    return (
        {p: [ideal * cost(p, r) for r in range(ep)] for p in works},
        {p: max(min(t[k] for t in book) for k in book_tasks if k[0] == p) for p in works},
        max(cost(again_ideal, r) for r in range(ep)),
    )
