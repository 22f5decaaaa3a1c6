"""The ragged path's values and gradients on CPU: programs traced with the real
`jax.lax.ragged_all_to_all`, every other equation, type and transpose as traced, run with that
one primitive lowered to an exact emulation (`helpers.ragged_emulation`; XLA:CPU cannot compile
the primitive, so elsewhere CPU tests run the ragged path's exchanges through the padded one,
`helpers.padded_exchange`, and never see the primitive's typing or transpose).

First the emulation itself against a NumPy model of the primitive's documented semantics, forward
and transposed; then the token exchange (`comm.exchange_by_backend`) and the replica transfer's
exchanged hops (relays) against NumPy, and the layer with comm_backend="ragged", balanced (its
replicas relayed) and plain, against the dense reference and against the same layer with the
padded exchange. Before the receive buffer was made varying before the call (jax <= 0.12.0 types
the result after it), every gradient through the exchange got the receivers' cotangents summed.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from tests.helpers import fetch_with_grads, layer_cases, make_mesh, place_batch
from tests.helpers.ragged_emulation import (  # the fixture: by name (usefixtures)
    emulated_ragged_all_to_all,
    ragged_emulation,  # noqa: F401
)
from tests.references.relay import reference_schedule
from ultraep_jax import comm
from ultraep_jax.config import resolve

# In test_moe's test process (pytest-xdist), whose cache of `layer_cases.run_case` (the dense
# reference and the layer with the padded exchange, which "auto" is on CPU) the layer cases read.
# Every case on each JAX line (conftest.py, --suite=quick): what it checks is what a JAX version
# compiles.
pytestmark = [pytest.mark.xdist_group("test_moe"), pytest.mark.every_case]

RAGGED_CALL = re.compile(r"custom_call\s*@ragged_all_to_all\b")


# -- the emulation against a NumPy model of ragged_all_to_all ---------------------------------


def numpy_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """The result [R, M, ...] of `jax.lax.ragged_all_to_all` on R ranks (every argument stacked
    over the ranks: operand [R, N, ...], output [R, M, ...], the others [R, K]), as its docstring
    defines it: slice i of rank s (``send_sizes[s, i]`` rows from ``input_offsets[s, i]``) goes to
    rank d = i // (K / R), which writes ``recv_sizes[d, j]`` rows (j: the slice's place among
    those d receives, by source, then slice) at ``output_offsets[s, i]``."""
    R, K = input_offsets.shape
    per = K // R
    result = np.array(output)
    for s in range(R):
        for i in range(K):
            d, j = i // per, s * per + i % per
            size = recv_sizes[d, j]
            assert size == send_sizes[s, i], "sizes outside the contract"
            start, at = input_offsets[s, i], output_offsets[s, i]
            result[d, at : at + size] = operand[s, start : start + size]
    return result


def numpy_operand_cotangent(cotangent, operand, input_offsets, send_sizes, output_offsets):
    """d sum(result * cotangent) / d operand [R, N, ...] of `numpy_ragged_all_to_all`: each sent
    row gets the cotangent of the row it was written to."""
    R, K = input_offsets.shape
    per = K // R
    grad = np.zeros_like(operand)
    for s in range(R):
        for i in range(K):
            d, size = i // per, send_sizes[s, i]
            start, at = input_offsets[s, i], output_offsets[s, i]
            grad[s, start : start + size] += cotangent[d, at : at + size]
    return grad


def _place(rng, sizes, rows):
    """Offsets [len(sizes)] of blocks of ``sizes`` laid in ``rows`` rows in a random order with
    random gaps; an empty block anywhere in [0, rows]."""
    offsets = np.zeros(len(sizes), np.int32)
    at = 0
    for b in rng.permutation(len(sizes)):
        if sizes[b] == 0:
            offsets[b] = rng.integers(0, rows + 1)
            continue
        at += int(rng.integers(0, 2))
        offsets[b] = at
        at += sizes[b]
    assert at <= rows
    return offsets


def random_ragged_args(rng, R, per, N, M):
    """Valid (input_offsets, send_sizes, output_offsets, recv_sizes), each int32 [R, K = R *
    per]: slices of 0 to 2 rows, laid out with gaps in random order on both sides."""
    K = R * per
    send = rng.integers(0, 3, size=(R, K)).astype(np.int32)
    input_offsets = np.stack([_place(rng, send[s], N) for s in range(R)])
    output_offsets = np.zeros((R, K), np.int32)
    recv = np.zeros((R, K), np.int32)
    for d in range(R):
        blocks = [(s, d * per + t) for s in range(R) for t in range(per)]  # j = s * per + t
        at = _place(rng, np.array([send[b] for b in blocks]), M)
        for j, b in enumerate(blocks):
            output_offsets[b] = at[j]
            recv[d, j] = send[b]
    return input_offsets, send, output_offsets, recv


def emulated_call(mesh, cotangent):
    """Jitted fn(operand, output, *offsets_and_sizes) -> (result, d sum(result * cotangent) /
    d operand) of `jax.lax.ragged_all_to_all` over "expert", every argument split over it."""

    def per_rank(operand, output, *args):
        return jax.lax.ragged_all_to_all(
            operand, output, *(a.reshape(-1) for a in args), axis_name="expert"
        )

    call = jax.shard_map(per_rank, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"))

    def loss(operand, output, *args):
        result = call(operand, output, *args)
        return jnp.sum(result * cotangent), result

    return jax.jit(jax.grad(loss, has_aux=True))


def _run(mesh, fn, operand, output, args):
    """``fn`` on the stacked [R, ...] arguments, flattened over the ranks and split; (result,
    gradient) reshaped to [R, ...]."""
    split = NamedSharding(mesh, P("expert"))

    def put(a):
        return jax.device_put(a.reshape((-1,) + a.shape[2:]), split)

    grad, result = fn(put(operand), put(output), *map(put, args))
    return np.asarray(result).reshape(output.shape), np.asarray(grad).reshape(operand.shape)


N_ROWS, M_ROWS, WIDTH = 48, 52, 3  # room for K = 16 slices of 2 rows and their gaps


@pytest.mark.parametrize("per", [1, 2], ids=["K=R", "K=2R"])
def test_emulation_equals_numpy_model(per, ep8_mesh):
    """Random sizes and layouts (gaps, any order, empty slices anywhere): the result, rows nobody
    writes keeping ``output``'s values, equals the model bit for bit, and so does the gradient
    w.r.t. the operand, which JAX computes by the primitive's transpose (another
    ragged_all_to_all)."""
    R = ep8_mesh.shape["expert"]
    rng = np.random.default_rng(per)
    cotangent = rng.normal(size=(R * M_ROWS, WIDTH)).astype(np.float32)
    with emulated_ragged_all_to_all():
        fn = emulated_call(ep8_mesh, cotangent)
        for _ in range(4):
            operand = rng.normal(size=(R, N_ROWS, WIDTH)).astype(np.float32)
            output = rng.normal(size=(R, M_ROWS, WIDTH)).astype(np.float32)
            args = random_ragged_args(rng, R, per, N_ROWS, M_ROWS)
            assert args[1].sum() > 0
            result, grad = _run(ep8_mesh, fn, operand, output, args)
            np.testing.assert_array_equal(result, numpy_ragged_all_to_all(operand, output, *args))
            want = numpy_operand_cotangent(cotangent.reshape(R, M_ROWS, WIDTH), operand, *args[:3])
            np.testing.assert_array_equal(grad, want)


@pytest.mark.usefixtures("ragged_emulation")
def test_emulation_is_nan_outside_the_contract(ep8_mesh):
    """Where XLA's result is undefined (recv_sizes unlike what is sent, a slice past the end of
    the receiver's output, two slices on one row), the receiver's result is NaN; the other ranks,
    which receive nothing here, keep ``output``."""
    R = ep8_mesh.shape["expert"]
    rng = np.random.default_rng(7)
    operand = rng.normal(size=(R, N_ROWS, WIDTH)).astype(np.float32)
    output = rng.normal(size=(R, M_ROWS, WIDTH)).astype(np.float32)
    # Valid: ranks 1 and 2 each send rank 5 two rows, written at rows 0 and 2 there.
    zeros = np.zeros((R, R), np.int32)
    input_offsets, send, output_offsets, recv = zeros.copy(), zeros.copy(), zeros.copy(), zeros
    send[1, 5] = send[2, 5] = recv[5, 1] = recv[5, 2] = 2
    output_offsets[2, 5] = 2
    valid = (input_offsets, send, output_offsets, recv)
    spoilt = {"sizes": (3, (5, 2), 1), "range": (2, (2, 5), M_ROWS - 1), "overlap": (2, (2, 5), 1)}
    fn = emulated_call(ep8_mesh, np.zeros((R * M_ROWS, WIDTH), np.float32))
    result, _ = _run(ep8_mesh, fn, operand, output, valid)
    np.testing.assert_array_equal(result, numpy_ragged_all_to_all(operand, output, *valid))
    for what, (arg, at, value) in spoilt.items():
        args = [a.copy() for a in valid]
        args[arg][at] = value
        result, _ = _run(ep8_mesh, fn, operand, output, args)
        assert np.isnan(result[5]).all(), what
        np.testing.assert_array_equal(np.delete(result, 5, 0), np.delete(output, 5, 0))


def test_emulation_holds_only_within_and_no_lowering_outlives_it(ep8_mesh):
    """One jitted function lowered before, within and after: the real custom call outside, the
    emulation (an all-to-all, no custom call) within, so that JAX's caches serve no lowering of
    one rule under the other; and "ragged" is refused on CPU devices again after."""
    fn = emulated_call(ep8_mesh, np.zeros((8 * M_ROWS, WIDTH), np.float32))
    split = NamedSharding(ep8_mesh, P("expert"))
    args = [
        jax.ShapeDtypeStruct((8 * rows, WIDTH), jnp.float32, sharding=split)
        for rows in (N_ROWS, M_ROWS)
    ] + [jax.ShapeDtypeStruct((8, 8), jnp.int32, sharding=split)] * 4

    def custom_calls():
        return len(RAGGED_CALL.findall(fn.lower(*args).as_text()))

    assert custom_calls() == 2  # forward and transposed
    with emulated_ragged_all_to_all():
        assert custom_calls() == 0
        assert resolve.resolve("comm_backend", "ragged", "cpu") == "ragged"
    assert custom_calls() == 2
    with pytest.raises(ValueError, match="cannot run on CPU devices"):
        resolve.resolve("comm_backend", "ragged", "cpu")


# -- the token exchange: `comm.exchange_by_backend` ---------------------------------------------


@pytest.mark.parametrize("mesh", ["ep8", "dp2ep4"], indirect=True)
def test_ragged_exchange_and_its_gradient_equal_numpy(mesh):
    """`comm.exchange_by_backend(backend="ragged")` of random sizes (the same in every data group,
    the operands and cotangents not): each receiver gets its senders' blocks, and each sender's
    gradient is the cotangent of the rows its blocks landed on, that receiver's alone (a psum of
    the receive buffer's cotangent over the EP axis gave every receiver's summed)."""
    G, R = layer_cases.mesh_groups(mesh)
    W = 3
    rng = np.random.default_rng(G)
    sizes = rng.integers(0, 3, size=(R, R)).astype(np.int32)
    src_start = (np.cumsum(sizes, axis=1) - sizes).astype(np.int32)
    dst_start = (np.cumsum(sizes, axis=0) - sizes).astype(np.int32)
    send_rows, recv_rows = int(sizes.sum(1).max()), int(sizes.sum(0).max())
    operand = rng.normal(size=(G, R, send_rows, W)).astype(np.float32)
    cotangent = rng.normal(size=(G, R, recv_rows, W)).astype(np.float32)

    def per_rank(x, cot, sizes, src_start, dst_start):
        exchange = comm.Exchange(
            sizes, src_start, dst_start, jax.lax.axis_index("expert"), send_rows, recv_rows, 2
        )

        def loss(x):
            got = comm.exchange_by_backend(x, exchange, axis_name="expert", backend="ragged")
            return jnp.sum(got * cot), got

        return jax.grad(loss, has_aux=True)(x)

    split = P(tuple(mesh.axis_names))
    fn = jax.jit(
        jax.shard_map(
            per_rank, mesh=mesh, in_specs=(split, split, P(), P(), P()), out_specs=(split, split)
        )
    )

    def put(a, spec):
        return jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))

    with emulated_ragged_all_to_all() as emulation:
        grad, got = fn(
            put(operand.reshape(-1, W), split),
            put(cotangent.reshape(-1, W), split),
            *(put(a, P()) for a in (sizes, src_start, dst_start)),
        )
    assert emulation.lowered > 0
    want = np.zeros((G, R, recv_rows, W), np.float32)
    want_grad = np.zeros_like(operand)
    for s, d in np.ndindex(R, R):
        theirs = slice(src_start[s, d], src_start[s, d] + sizes[s, d])
        ours = slice(dst_start[s, d], dst_start[s, d] + sizes[s, d])
        want[:, d, ours] = operand[:, s, theirs]
        want_grad[:, s, theirs] = cotangent[:, d, ours]
    np.testing.assert_array_equal(np.asarray(got).reshape(want.shape), want)
    np.testing.assert_array_equal(np.asarray(grad).reshape(want_grad.shape), want_grad)


# -- the replica transfer's exchanged hops ----------------------------------------------------


def test_relayed_fetch_and_its_gradient_equal_numpy(ep8_mesh):
    """The ragged transfer through relays (8 ranks, 2 masters each, 2 slots; expert 0 on 6 ranks,
    a tree of 2 hops at f = 2, the second in its conditional): every slot gets its expert bit for
    bit, and each master's gradient is the sum of the cotangents of the slots holding it, summed
    back through the relays by the transposed exchanges. (Every hop runs the same exchange: a
    deeper chain, f = 1, adds compile time, not code; test_relay runs it with the padded one.)"""
    R, em, S, f = 8, 2, 2, 2
    slot_expert = np.array(
        [[3, -1], [0, -1], [0, 3], [0, -1], [-1, -1], [0, -1], [0, 9], [0, -1]], np.int32
    )
    assert reference_schedule(slot_expert, em, f)["hop"].max() == 2
    rng = np.random.default_rng(f)
    masters = [
        rng.normal(size=(R * em, 3, 5)).astype(np.float32),
        rng.normal(size=(R * em, 4)).astype(np.float32),
    ]
    cot = [rng.normal(size=(R * S, *w.shape[1:])).astype(np.float32) for w in masters]
    with emulated_ragged_all_to_all():
        got, grads = fetch_with_grads(
            ep8_mesh, masters, slot_expert, cot, backend="ragged", max_fanout=f
        )
    flat = slot_expert.reshape(-1)
    for g, grad, c, w in zip(got, grads, cot, masters, strict=True):
        want = np.stack([w[e] if e >= 0 else np.zeros_like(w[0]) for e in flat])
        np.testing.assert_array_equal(np.asarray(g), want)
        want_grad = np.zeros_like(w)
        np.add.at(want_grad, flat[flat >= 0], c[flat >= 0])
        np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-6, atol=1e-6)


# -- the layer --------------------------------------------------------------------------------


def _relay_depth(res, case) -> int:
    """The deepest relay hop of any EP group's plan (FFI planner, reference schedule)."""
    balancer = res["balancer"]
    R = balancer.ep_size
    return max(
        int(
            reference_schedule(
                np.asarray(uep.plan(loads.astype(np.int32), balancer).slot_expert),
                case.num_experts // R,
                balancer.max_fanout,
            )["hop"].max()
        )
        for loads in res["loads"]
    )


# The skewed cases of test_moe (E=8, D=8, F=16, 8x8 and 8x12 tokens, 2 slots), whose balanced
# plans replicate the hot experts to most ranks, relayed (max_fanout=2, 2 hops); on dp2ep4 the two
# data groups' plans differ.
@pytest.mark.parametrize("case", layer_cases.SKEWED, ids=lambda c: c.id)
@pytest.mark.parametrize("which", ["balanced", "plain"])
def test_ragged_layer_equals_dense_reference_and_padded_layer(case, which):
    res = layer_cases.run_case(case)
    balancer = res["balancer"] if which == "balanced" else None
    if balancer is not None:
        assert _relay_depth(res, case) >= 2, "no replica was relayed"
    mesh = make_mesh(case.mesh)
    x = place_batch(mesh, res["x"])
    with emulated_ragged_all_to_all() as emulation:  # "ragged" is refused on CPU devices outside
        layer = layer_cases.build_layer(
            mesh, case.num_experts, case.top_k, balancer, None, res["params"], comm_backend="ragged"
        )
        y, stats, gx, gp = layer_cases.layer_value_and_grads(
            layer, x, jnp.asarray(res["cotangent"])
        )
    assert emulation.lowered > 0
    assert int(stats["dropped"]) == 0
    padded = (res[which][0], *res[which][2:])  # y, d/dx, d/dparams
    for (want_y, want_gx, want_gp), against in ((res["ref"], ""), (padded, " (padded)")):
        layer_cases.assert_close(y, want_y, "y" + against)
        layer_cases.assert_close(gx, want_gx, "d/dx" + against)
        for name in layer_cases.PARAM_NAMES:
            layer_cases.assert_close(gp[name], want_gp[name], f"d/d{name}{against}")
