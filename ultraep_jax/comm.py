"""One entry point for ragged row exchange over the EP axis, whatever the backend."""

from __future__ import annotations

import jax

from ultraep_jax import comm_portable, comm_ragged
from ultraep_jax._vma import vary, varying_axes

BACKENDS = ("auto", "portable", "ragged")


def ragged_exchange(
    operand,
    output,
    input_offsets,
    send_sizes,
    output_offsets,
    recv_sizes,
    *,
    axis_name: str,
    max_chunk: int,
    backend: str = "auto",
):
    """Sends ragged row blocks to every peer on ``axis_name`` (`jax.lax.ragged_all_to_all`
    semantics; see `comm_portable.ragged_exchange` for the arguments).

    ``backend``: "ragged" (only the needed bytes move; GPU/TPU), "portable" (fixed-size
    all-to-all; any platform), or "auto": portable on CPU, ragged elsewhere, chosen per platform
    at lowering time with `jax.lax.platform_dependent`.
    """
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    kw = dict(axis_name=axis_name, max_chunk=max_chunk)

    # The result varies over the exchange axis and whatever its inputs vary over; say so
    # explicitly (some transposes drop the type) so that both platform branches have one type.
    axes = tuple(sorted({axis_name} | varying_axes(operand) | varying_axes(output)))

    def portable(*a):
        return vary(comm_portable.ragged_exchange(*a, **kw), axes)

    def ragged(*a):
        return vary(comm_ragged.ragged_exchange(*a, **kw), axes)

    if backend == "portable":
        return portable(*args)
    if backend == "ragged":
        return ragged(*args)
    if backend != "auto":
        raise ValueError(f"unknown communication backend {backend!r}; expected one of {BACKENDS}")
    return jax.lax.platform_dependent(*args, cpu=portable, default=ragged)
