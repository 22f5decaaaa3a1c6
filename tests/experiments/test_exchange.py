"""The GPU check's exchange section (`experiments.gpu.exchange`) on the 8 simulated CPU
devices: the layer's padded token exchange, values and vjp, against a NumPy rendering of ragged
all-to-all's contract on the sizes and offsets the section builds (the replica-weight exchange
has its NumPy check in test_pinned.py); and the schedule reader (`experiments.gpu.hlo_schedule`)
on a hand-written schedule."""

import dataclasses

import jax
import numpy as np

from experiments.gpu import exchange as gpu_exchange
from experiments.gpu import hlo_schedule

SETUP = dataclasses.replace(gpu_exchange.DRY, check_rows=40, d_model=8)


def _mesh():
    return gpu_exchange.exchange_mesh(jax.devices()[:8])


def numpy_exchange(operand, sizes, src, dst, send_rows, recv_rows):
    """ragged all-to-all by its definition: block (s, d) of ``sizes[s, d]`` rows goes from row
    ``src[s, d]`` of rank s's operand to row ``dst[s, d]`` of rank d's output; zeros elsewhere."""
    R = sizes.shape[0]
    out = np.zeros((R * recv_rows,) + operand.shape[1:], operand.dtype)
    for s in range(R):
        for d in range(R):
            n = sizes[s, d]
            a, b = s * send_rows + src[s, d], d * recv_rows + dst[s, d]
            out[b : b + n] = operand[a : a + n]
    return out


def numpy_exchange_vjp(cot, sizes, src, dst, send_rows, recv_rows):
    """The operand's gradient of sum(output * cot): each sent row gets its destination row's
    cotangent, unsent rows zero."""
    R = sizes.shape[0]
    grad = np.zeros((R * send_rows,) + cot.shape[1:], cot.dtype)
    for s in range(R):
        for d in range(R):
            n = sizes[s, d]
            a, b = s * send_rows + src[s, d], d * recv_rows + dst[s, d]
            grad[a : a + n] = cot[b : b + n]
    return grad


def test_padded_token_exchange_and_vjp_equal_numpy():
    out, grad, (operand, cot, sizes, recv) = gpu_exchange.token_values_and_vjp(
        _mesh(), SETUP, "padded"
    )
    # The sizes cover the cases that matter: empty blocks, unsent rows, unwritten output rows.
    assert (sizes == 0).any() and (sizes.sum(axis=1) < SETUP.check_rows).any()
    assert (sizes.sum(axis=0) < recv).all()
    src, dst = gpu_exchange.block_offsets(sizes)
    args = (sizes, src, dst, SETUP.check_rows, recv)
    np.testing.assert_array_equal(out, numpy_exchange(operand, *args))
    np.testing.assert_array_equal(grad, numpy_exchange_vjp(cot, *args))


def test_balanced_sizes_send_every_row():
    sizes = gpu_exchange.balanced_sizes(8, 65536)
    assert (sizes.sum(axis=1) == 65536).all() and (sizes == 8192).all()
    sizes = gpu_exchange.balanced_sizes(3, 10)
    assert (sizes.sum(axis=1) == 10).all() and sizes.max() - sizes.min() <= 1


SCHEDULE = """\
HloModule m

%region (p: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  ROOT %rs = f32[] reduce-scatter(%p), dimensions={0}
}

ENTRY %main (a: f32[8], w: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %w = f32[8]{0} parameter(1)
  %ra2a-start = (f32[8]{0}, f32[8]{0}) ragged-all-to-all-start(%w), metadata={op_name="cond"}
  %mm.1 = f32[8]{0} custom-call(%a), custom_call_target="mosaic_gpu_v2"
  %plan = s32[8]{0} custom-call(%a), custom_call_target="ultraep_plan"
  %mm.2 = f32[8]{0} custom-call(%mm.1), custom_call_target="mosaic_gpu_v2"
  %ra2a-done = f32[8]{0} ragged-all-to-all-done(%ra2a-start)
  %mm.3 = f32[8]{0} custom-call(%ra2a-done), custom_call_target="mosaic_gpu_v2"
  %mm.4 = f32[8]{0} custom-call(%a), custom_call_target="mosaic_gpu_v2"
  %ag = f32[8]{0} all-gather(%mm.3), dimensions={0}
  %cond = f32[8]{0} conditional(%ag), branch_computations={%region}
  ROOT %out = f32[8]{0} add(%cond, %mm.4)
}
"""


def test_overlap_report_counts_the_independent_matmuls_in_flight():
    report = hlo_schedule.overlap_report(SCHEDULE)
    assert report["matmuls"] == 4  # the planner's custom call is no matmul
    transfer, gather, inside = report["collectives"]
    # mm.1 and mm.2 run while the transfer is in flight; mm.4 is independent but after it; mm.3
    # depends on it.
    assert (transfer["kind"], transfer["mode"]) == ("ragged-all-to-all", "async")
    assert (transfer["independent_matmuls"], transfer["in_flight"]) == (3, 2)
    assert "2 of 3" in hlo_schedule.verdict(transfer)
    assert "partly overlapped" in hlo_schedule.verdict(transfer)
    assert (gather["mode"], gather["independent_matmuls"], gather["in_flight"]) == ("sync", 3, 0)
    assert (inside["kind"], inside["mode"]) == ("reduce-scatter", "inside conditional")
    assert "NOT overlapped" in hlo_schedule.verdict(inside)
