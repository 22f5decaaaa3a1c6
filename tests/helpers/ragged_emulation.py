"""`jax.lax.ragged_all_to_all` run on CPU: its primitive lowered, for CPU, to an exact emulation
of its semantics (a fixed-size `all_to_all` of padded chunks and a scatter), so that a program
traced with the real primitive, every other equation, type and transpose as traced, runs on the
8 simulated devices (XLA:CPU cannot compile the primitive; DESIGN.md section 13).

Use::

    with emulated_ragged_all_to_all() as emulation:
        ...  # trace, compile and run; "ragged" is accepted on CPU devices here
    assert emulation.lowered  # ragged_all_to_all equations were lowered to the emulation

or the fixture `ragged_emulation` (import it into the test module). The emulation is a lowering
rule, so the transpose JAX differentiates the primitive with (another ragged_all_to_all) is
emulated too.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax._src.interpreters import mlir as _mlir  # the registry of per-platform lowering rules
from jax._src.lax import parallel as _parallel

from ultraep_jax.config import resolve

#: The primitive `jax.lax.ragged_all_to_all` binds (jax 0.10 to 0.12 keep it here).
RAGGED_ALL_TO_ALL_P = _parallel.ragged_all_to_all_p


def emulate_ragged_all_to_all(
    operand,
    output,
    input_offsets,
    send_sizes,
    output_offsets,
    recv_sizes,
    *,
    axis_name,
    axis_index_groups=None,
):
    """`jax.lax.ragged_all_to_all`'s result [M, ...] from a fixed-size all-to-all, inside a
    mapped context (shard_map) over ``axis_name``.

    Slice i of ``operand`` [N, ...] (``send_sizes[i]`` rows from ``input_offsets[i]``) goes to
    rank ``i // (K / R)`` (K = len(input_offsets), R ranks), which writes it at the offset this
    rank gave in ``output_offsets[i]``; there, the rows of the i-th received slice number
    ``recv_sizes[i]``. Rows of ``output`` nobody writes keep their value. Each rank sends K
    chunks of N rows (zero-padded), so a chunk holds any slice.

    Arguments outside the primitive's contract (a slice out of range on either side, a
    ``recv_sizes`` that differs from what the sender sends, two slices writing one row), on which
    XLA's result is undefined, make a floating result NaN on the rank that sees them, so that a
    test fails instead of reading one undefined outcome.
    """

    def all_to_all(x):
        return jax.lax.all_to_all(
            x, axis_name, 0, 0, tiled=True, axis_index_groups=axis_index_groups
        )

    N, M = operand.shape[0], output.shape[0]
    trailing = (1,) * (operand.ndim - 1)
    step = jnp.arange(N, dtype=input_offsets.dtype)
    # Sender: slice i padded to N rows, zeros past its size.
    sending = step[None, :] < send_sizes[:, None]  # [K, N]
    rows = jnp.clip(input_offsets[:, None] + step[None, :], 0, N - 1)
    chunks = jnp.where(sending.reshape(sending.shape + trailing), operand[rows], 0)
    # Receiver: chunk i is the i-th slice addressed here (by source rank, then slice), written at
    # the offset its sender gave, ``recv_sizes[i]`` rows.
    received = all_to_all(chunks)  # [K, N, ...]
    offsets = all_to_all(output_offsets)
    sent_sizes = all_to_all(send_sizes)
    writing = step[None, :] < recv_sizes[:, None]
    dest = jnp.where(writing, offsets[:, None] + step[None, :], M).reshape(-1)  # M: dropped
    result = output.at[dest].set(received.reshape((-1,) + operand.shape[1:]), mode="drop")
    if not jnp.issubdtype(output.dtype, jnp.inexact):
        return result
    writes = jnp.zeros((M,), jnp.int32).at[dest].add(1, mode="drop")
    valid = (
        jnp.all(send_sizes >= 0)
        & jnp.all(input_offsets >= 0)
        & jnp.all(input_offsets + send_sizes <= N)
        & jnp.all(recv_sizes == sent_sizes)
        & jnp.all(recv_sizes <= N)
        & jnp.all(offsets >= 0)
        & jnp.all(offsets + recv_sizes <= M)
        & jnp.all(writes <= 1)
    )
    return jnp.where(valid, result, jnp.nan)


def _cpu_rules() -> dict:
    """The CPU lowering rules by primitive (a platform's rule wins over the common one)."""
    return _mlir._platform_specific_lowerings["cpu"]


def _runs_anywhere(candidate):
    """``candidate`` supported on every platform and compiled by XLA:CPU (where the resolver's
    `Candidate` has that field)."""
    changes = {"supported": lambda platform, facts: True}
    if "cpu_compiles" in {f.name for f in dataclasses.fields(candidate)}:
        changes["cpu_compiles"] = True
    return dataclasses.replace(candidate, **changes)


@dataclasses.dataclass
class Emulation:
    """What `emulated_ragged_all_to_all` yields: ``lowered`` counts the lowerings of
    ragged_all_to_all to the emulation so far (a test's proof that it ran the ragged path; JAX
    may lower equations of one signature once, so not a count of equations)."""

    lowered: int = 0


@contextlib.contextmanager
def emulated_ragged_all_to_all():
    """Within: `RAGGED_ALL_TO_ALL_P` lowers for CPU to `emulate_ragged_all_to_all`, and the
    resolver accepts comm_backend="ragged" on CPU devices (its refusal, and its exclusion from
    exports beside CPU, lifted). Yields an `Emulation`. JAX's in-memory caches are cleared on
    entry and on exit, so that no lowering made with one rule is served under the other (the
    persistent compilation cache keys by the program, which differs). Restores the previous rule
    and candidates on exit."""
    rules = _cpu_rules()
    previous_rule = rules.get(RAGGED_ALL_TO_ALL_P)
    previous_candidates = resolve.CANDIDATES["comm_backend"]
    anywhere = tuple(_runs_anywhere(c) if c.name == "ragged" else c for c in previous_candidates)
    emulation = Emulation()
    emulated = jax.interpreters.mlir.lower_fun(emulate_ragged_all_to_all, multiple_results=False)

    def rule(ctx, *args, **params):
        emulation.lowered += 1
        return emulated(ctx, *args, **params)

    jax.clear_caches()
    jax.interpreters.mlir.register_lowering(RAGGED_ALL_TO_ALL_P, rule, platform="cpu")
    resolve.CANDIDATES["comm_backend"] = anywhere
    try:
        yield emulation
    finally:
        resolve.CANDIDATES["comm_backend"] = previous_candidates
        if previous_rule is None:
            rules.pop(RAGGED_ALL_TO_ALL_P, None)
        else:
            rules[RAGGED_ALL_TO_ALL_P] = previous_rule
        jax.clear_caches()


@pytest.fixture
def ragged_emulation():
    """`emulated_ragged_all_to_all` around a test, its `Emulation` as the value (import this
    fixture into the test module)."""
    with emulated_ragged_all_to_all() as emulation:
        yield emulation
