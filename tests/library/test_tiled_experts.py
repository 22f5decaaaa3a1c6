"""The tiled SwiGLU expert kernel against a per-row NumPy reference: values, gradients, how groups
are cut into tiles, groups that start anywhere, and use inside `shard_map` with the dense reference
checked on every device; every kernel's bf16 precision against a float32 reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from tests.helpers import expert_mesh
from tests.references.moe import HIGHEST, gated
from ultraep_jax.config import resolve
from ultraep_jax.experts import registry as experts
from ultraep_jax.experts import tiled as tiled_experts

D, F = 8, 12

# (rows C, group starts, group sizes, tile): empty groups, groups straddling tiles, a group
# starting mid-buffer, rows before, between and after the groups, a buffer that is not a multiple
# of the tile, a tile larger than the buffer, a group shorter than a tile at the buffer's end.
CASES = {
    "contiguous": (64, [0, 16, 16, 53], [16, 0, 37, 11], 16),
    "gaps": (70, [3, 20, 50], [10, 25, 19], 16),
    "one_row_groups": (40, [0, 1, 2, 39], [1, 1, 1, 1], 8),
    "tile_past_end": (13, [2, 7], [4, 6], 32),
    "short_group_at_end": (40, [0, 33], [30, 7], 16),
    "empty": (24, [0, 0], [0, 0], 8),
    "no_rows": (0, [0, 0], [0, 0], 8),
}


def _inputs(C, G, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(C, D)).astype(dtype)
    wg = (rng.normal(size=(G, D, F)) / np.sqrt(D)).astype(dtype)
    wu = (rng.normal(size=(G, D, F)) / np.sqrt(D)).astype(dtype)
    wd = (rng.normal(size=(G, F, D)) / np.sqrt(F)).astype(dtype)
    return x, wg, wu, wd


def _reference(x, wg, wu, wd, starts, sizes):
    """float64 NumPy, one row at a time: row r of group g -> silu(r wg) * (r wu) wd; else 0."""
    x, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, wg, wu, wd))
    out = np.zeros_like(x)
    for g, (a, n) in enumerate(zip(starts, sizes, strict=True)):
        for r in range(a, a + n):
            gate, up = x[r] @ wg[g], x[r] @ wu[g]
            out[r] = (gate / (1 + np.exp(-gate)) * up) @ wd[g]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_forward_equals_reference(case):
    C, starts, sizes, tile = CASES[case]
    x, wg, wu, wd = _inputs(C, len(sizes))
    run = jax.jit(tiled_experts.tiled_glu, static_argnums=6)
    out = run(x, wg, wu, wd, jnp.asarray(starts), jnp.asarray(sizes), tile)
    assert out.shape == (C, D) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, _reference(x, wg, wu, wd, starts, sizes), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["contiguous", "gaps", "tile_past_end", "short_group_at_end"])
def test_gradients_equal_autodiff_of_dense_reference(case):
    C, starts, sizes, tile = CASES[case]
    x, wg, wu, wd = _inputs(C, len(sizes), seed=1)
    cot = np.random.default_rng(2).normal(size=(C, D)).astype(np.float32)
    group = np.full(C, -1)
    for g, (a, n) in enumerate(zip(starts, sizes, strict=True)):
        group[a : a + n] = g

    def dense(x, wg, wu, wd):
        # Every group on every row, then each row keeps its own group's output.
        hi = HIGHEST
        h = jax.nn.silu(jnp.einsum("cd,gdf->gcf", x, wg, precision=hi)) * jnp.einsum(
            "cd,gdf->gcf", x, wu, precision=hi
        )
        y = jnp.einsum("gcf,gfd->gcd", h, wd, precision=hi)
        pick = jnp.asarray(group)[None, :, None] == jnp.arange(len(sizes))[:, None, None]
        return jnp.sum(jnp.where(pick, y, 0), axis=0)

    def tiled(x, wg, wu, wd):
        return tiled_experts.tiled_glu(x, wg, wu, wd, jnp.asarray(starts), jnp.asarray(sizes), tile)

    grads = [
        jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a) * cot), argnums=(0, 1, 2, 3)))(x, wg, wu, wd)
        for f in (tiled, dense)
    ]
    for name, got, want in zip(("x", "w_gate", "w_up", "w_down"), *grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)


def test_rows_outside_groups_do_not_reach_values_or_gradients():
    """inf and NaN in rows of no group (next to a group shorter than a tile, which its tile reads
    at the buffer's end, and past a group's end) change no value and no gradient."""
    C, starts, sizes, tile = CASES["short_group_at_end"]
    starts, sizes = [0, 35], [30, 5]  # rows 30-34 and none after: in no group
    x, wg, wu, wd = _inputs(C, len(sizes), seed=5)
    cot = np.random.default_rng(6).normal(size=(C, D)).astype(np.float32)
    bad = x.copy()
    bad[30:35] = np.array([np.inf, -np.inf, np.nan, 1e30, -1e30])[:, None]

    def loss(x, wg, wu, wd):
        out = tiled_experts.tiled_glu(x, wg, wu, wd, jnp.asarray(starts), jnp.asarray(sizes), tile)
        return jnp.sum(jnp.where(jnp.isfinite(out), out, 0) * cot), out

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, want_out), want = run(x, wg, wu, wd)
    (_, got_out), got = run(bad, wg, wu, wd)
    np.testing.assert_array_equal(got_out, want_out)
    np.testing.assert_array_equal(got[0][30:35], 0)
    for name, g, w in zip(("x", "w_gate", "w_up", "w_down"), got, want, strict=True):
        keep = np.ones(len(g), bool)
        if name == "x":
            keep[30:35] = False
        np.testing.assert_array_equal(np.asarray(g)[keep], np.asarray(w)[keep], err_msg=name)


@pytest.mark.parametrize("split", [(1, 3), (0, 2, 2), (3, 0, 1)])
def test_parts_gradients_equal_one_stack(split):
    """Weights given as consecutive parts (some empty; the layer's masters and replica slots) give
    the values and gradients of the same weights in one stack, each part's gradient its slice."""
    C, starts, sizes, tile = CASES["contiguous"]
    x, wg, wu, wd = _inputs(C, len(sizes), seed=3)
    cot = np.random.default_rng(4).normal(size=(C, D)).astype(np.float32)
    bounds = np.cumsum((0, *split))
    args = (jnp.asarray(starts), jnp.asarray(sizes), tile)

    def parts_loss(x, wg, wu, wd):
        parts = [(wg[a:b], wu[a:b], wd[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        return jnp.sum(tiled_experts.tiled_glu_parts(x, parts, *args) * cot)

    def stack_loss(x, wg, wu, wd):
        return jnp.sum(tiled_experts.tiled_glu(x, wg, wu, wd, *args) * cot)

    got, want = (
        jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(x, wg, wu, wd)
        for f in (parts_loss, stack_loss)
    )
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for name, g, w in zip(("x", "w_gate", "w_up", "w_down"), got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, err_msg=name)


def test_group_tiles_by_hand():
    """Whole tiles from each group's first row; the rest in one tile ending at the group's end, or,
    for a group shorter than a tile, starting at its first row, moved back inside the buffer."""
    starts, sizes = jnp.asarray([3, 20, 20, 50, 69]), jnp.asarray([10, 25, 0, 19, 3])
    full, offset, first_new = tiled_experts.group_tiles(starts, sizes, 72, 16)
    assert np.asarray(full).tolist() == [0, 1, 0, 1, 0]
    assert np.asarray(offset).tolist() == [3, 29, 20, 53, 56]
    assert np.asarray(first_new).tolist() == [3, 36, 20, 66, 69]


def test_group_tiles_cover_each_group_once():
    """Every row of every group in exactly one tile's added rows; whole tiles inside their group;
    the last tile inside the buffer, and inside its group when the group holds a whole tile."""
    rng = np.random.default_rng(7)
    C, tile = 1200, 64
    sizes = rng.integers(0, 150, size=12)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]) + rng.integers(0, 3, size=12).cumsum()
    sizes[-1] = min(sizes[-1], C - starts[-1])  # the last group ends inside the buffer
    full, offset, first_new = (
        np.asarray(a)
        for a in tiled_experts.group_tiles(jnp.asarray(starts), jnp.asarray(sizes), C, tile)
    )
    assert (sizes % tile != 0).any() and (sizes < tile).any() and (sizes > tile).any()
    for g, (a, n) in enumerate(zip(starts, sizes, strict=True)):
        added = [r for j in range(full[g]) for r in range(a + j * tile, a + (j + 1) * tile)]
        assert all(r < a + n for r in added), f"group {g}: whole tile past the end"
        if n % tile:
            assert 0 <= offset[g] and offset[g] + tile <= C, f"group {g}: last tile off the buffer"
            assert n < tile or a <= offset[g], f"group {g}: last tile leaves the group"
            assert offset[g] <= first_new[g] < a + n
            added += list(range(first_new[g], a + n))
        assert added == list(range(a, a + n)), f"group {g}"


def test_bfloat16_close_to_float32():
    C, starts, sizes, tile = CASES["gaps"]
    x, wg, wu, wd = _inputs(C, len(sizes), seed=3)
    ref = _reference(x, wg, wu, wd, starts, sizes)
    out = tiled_experts.tiled_glu(
        *(jnp.asarray(a, jnp.bfloat16) for a in (x, wg, wu, wd)),
        jnp.asarray(starts),
        jnp.asarray(sizes),
        tile,
    )
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("kernel", ["tiled", "ragged_dot", "auto"])
def test_local_experts_masters_then_slots(kernel):
    """Masters' groups then replica slots' groups (different weights), by every kernel, inside
    shard_map on 8 devices with per-device group sizes."""
    mesh = expert_mesh()
    em, S, C = 2, 2, 32
    rng = np.random.default_rng(4)
    sizes = rng.integers(0, 9, size=(8, em + S)).astype(np.int32)
    x = rng.normal(size=(8 * C, D)).astype(np.float32)
    _, *masters = _inputs(1, 8 * em, seed=5)  # each [8 * E_m, ...]
    _, *slots = _inputs(1, 8 * S, seed=6)  # each [8 * S, ...]

    def shard(x, sizes, wg, wu, wd, rg, ru, rd):
        return experts.local_experts(x, (wg, wu, wd), (rg, ru, rd), sizes[0], kernel)

    spec = P("expert")
    run = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=(spec,) * 8, out_specs=spec))
    placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, sizes, *masters, *slots)]
    out = np.asarray(run(*placed))
    for d in range(8):
        w = [
            np.concatenate([m[d * em : (d + 1) * em], s[d * S : (d + 1) * S]])
            for m, s in zip(masters, slots, strict=True)
        ]
        n = sizes[d]
        starts = np.concatenate([[0], np.cumsum(n)[:-1]])
        want = _reference(x[d * C : (d + 1) * C], *w, starts, n)
        np.testing.assert_allclose(
            out[d * C : (d + 1) * C], want, rtol=1e-4, atol=1e-5, err_msg=f"device {d}"
        )


def _bf16_case(seed=0):
    """Rows [64, 64] in groups of 30, 0 and 30, three experts (D=64, F=32) and a cotangent, every
    value a bf16 one (so float32 and bf16 runs start from the same numbers)."""
    rng = np.random.default_rng(seed)
    C, Dw, Fw, G = 64, 64, 32, 3

    def bf16(a):
        return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))

    x = bf16(rng.normal(size=(C, Dw)))
    wg, wu = (bf16(rng.normal(size=(G, Dw, Fw)) / np.sqrt(Dw)) for _ in range(2))
    wd = bf16(rng.normal(size=(G, Fw, Dw)) / np.sqrt(Fw))
    cot = rng.normal(size=(C, Dw)).astype(np.float32)
    return (x, wg, wu, wd), np.array([30, 0, 30], np.int32), cot


def _dense_reference(activation, x, wg, wu, wd, sizes):
    """float32 [C, D] at full precision: each row through its group's expert (one-hot over the
    groups; rows past the groups give 0), ``gated`` the independent unit of tests/references."""
    group = np.repeat(np.arange(len(sizes)), sizes)
    onehot = jnp.asarray(np.eye(len(sizes), dtype=np.float32)[group])  # [rows in groups, G]
    n = len(group)
    gate = jnp.einsum("cd,cg,gdf->cf", x[:n], onehot, wg, precision=HIGHEST)
    up = jnp.einsum("cd,cg,gdf->cf", x[:n], onehot, wu, precision=HIGHEST)
    h = gated(activation, gate, up)
    out = jnp.einsum("cf,cg,gfd->cd", h, onehot, wd, precision=HIGHEST)
    return jnp.concatenate([out, jnp.zeros((x.shape[0] - n, x.shape[1]), out.dtype)])


@pytest.mark.parametrize("limit", [0.5, 1.0])
def test_bfloat16_kernels_compute_the_gated_unit_in_float32(limit):
    """In bf16, with gpt-oss's clamped unit at small limits, every kernel ("tiled", "ragged_dot",
    "tokamax" where it is installed, and the dense shared expert) gives values and gradients
    within 1 % of the largest of the float32 reference's: each computes the unit in float32 on
    float32 products. ``ragged_dot`` computed it in bf16 on bf16 products, gradients off by up to
    13 %."""
    from ultraep_jax.experts.dense import dense_glu

    act = uep.ClampedSwiGLU(limit=limit)
    arrays, sizes, cot = _bf16_case()

    def loss_of(fn, dtype):
        def loss(*arrays):
            out = fn(*(a.astype(dtype) for a in arrays))
            assert out.dtype == dtype
            return jnp.sum(out.astype(jnp.float32) * cot)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))

    def check(name, fn, reference):
        got = jax.jit(fn)(*(jnp.asarray(a, jnp.bfloat16) for a in arrays))
        want = np.asarray(reference(*arrays))
        err = np.abs(np.asarray(got, np.float32) - want).max()
        assert err < 1e-2 * np.abs(want).max(), f"{name}: values: {err}"
        _, grads = loss_of(fn, jnp.bfloat16)(*arrays)
        _, want_grads = loss_of(reference, jnp.float32)(*arrays)
        for i, (g, w) in enumerate(zip(grads, want_grads, strict=True)):
            err = np.abs(np.asarray(g, np.float32) - np.asarray(w)).max()
            assert err < 1e-2 * np.abs(np.asarray(w)).max(), f"{name}: d/d arg {i}: {err}"

    grouped_ref = functools.partial(_dense_reference, act, sizes=sizes)
    kernels = ("tiled", "ragged_dot") + (("tokamax",) if resolve.tokamax_installed() else ())
    for kernel in kernels:

        def grouped(x, wg, wu, wd, kernel=kernel):
            return experts.grouped_glu(x, [(wg, wu, wd)], jnp.asarray(sizes), kernel, act)

        check(kernel, grouped, grouped_ref)

    def shared(x, wg, wu, wd):
        return dense_glu(x, wg[0], wu[0], wd[0], act)

    def shared_ref(x, wg, wu, wd):
        return _dense_reference(act, x, wg[:1], wu[:1], wd[:1], np.array([len(x)]))

    check("dense", shared, shared_ref)
