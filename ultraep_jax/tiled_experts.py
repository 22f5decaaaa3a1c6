"""SwiGLU experts over grouped rows as a loop over (row tile, group) work items, with its VJP.

`jax.lax.ragged_dot` on XLA:CPU is a masked dense product: every group multiplies every row of
the buffer, so its cost is groups x buffer rows whatever the real group sizes are. Here the rows
are cut into tiles of ``tile`` rows and a `jax.lax.while_loop` visits only the (tile, group) pairs
that hold rows, running the whole SwiGLU MLP of that group on the tile (rows of other groups
masked). The trip count is a runtime value, so the cost tracks the rows actually present: at most
``ceil(rows / tile) + G`` work items. The backward pass is a second loop (custom VJP) that
recomputes the hidden activations per tile instead of storing them.

Groups are given by explicit row ranges ``[start[g], start[g] + size[g])`` so that one buffer can
be split between two calls (master experts, then replica slots) without shifting rows.

Shapes: C rows, D model width, F hidden width, G groups, m = tile rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ultraep_jax._vma import vary, varying_axes


def default_tile(num_rows: int) -> int:
    """Rows per tile: 64, or fewer (a multiple of 8) for small buffers."""
    return max(8, min(64, -(-num_rows // 32) * 8))


def work_items(
    group_start: jax.Array, group_size: jax.Array, tile: int, max_items: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The (tile, group) pairs that hold rows, groups in order, tiles ascending within a group.

    Args:
      group_start, group_size: int32 [G], each group's rows ``[start, start + size)``.
      tile: rows per tile.
      max_items: static length of the result (at least ``ceil(C / tile) + G``).

    Returns:
      item_tile, item_group: int32 [max_items] (entries past the count are clamped, unused);
      count: int32 [], the number of valid items.
    """
    end = group_start + group_size
    first = group_start // tile
    n = jnp.where(group_size > 0, (end - 1) // tile - first + 1, 0)
    cum = jnp.cumsum(n)
    i = jnp.arange(max_items, dtype=jnp.int32)
    group = jnp.clip(jnp.searchsorted(cum, i, side="right"), 0, group_size.shape[0] - 1)
    item_tile = first[group] + i - (cum[group] - n[group])
    return item_tile.astype(jnp.int32), group.astype(jnp.int32), cum[-1].astype(jnp.int32)


def _dot(a, b, contract):
    """float32 ``a . b`` contracting a's axis ``contract[0]`` with b's ``contract[1]``."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _tile_inputs(x, group_start, group_size, item_tile, item_group, i, tile):
    """Row offset, rows [m, D] and row mask [m, 1] of work item ``i``."""
    t, g = item_tile[i], item_group[i]
    offset = t * tile
    rows = jax.lax.dynamic_slice_in_dim(x, offset, tile, axis=0)
    row = offset + jnp.arange(tile, dtype=jnp.int32)
    mask = (row >= group_start[g]) & (row < group_start[g] + group_size[g])
    return offset, g, rows, mask[:, None]


def _forward(x, w_gate, w_up, w_down, group_start, group_size, tile):
    C, D = x.shape
    G = w_gate.shape[0]
    Cp = -(-C // tile) * tile
    xp = jnp.pad(x, ((0, Cp - C), (0, 0)))
    item_tile, item_group, count = work_items(group_start, group_size, tile, Cp // tile + G)

    def body(carry):
        i, out = carry
        offset, g, rows, mask = _tile_inputs(
            xp, group_start, group_size, item_tile, item_group, i, tile
        )
        gate = _dot(rows, w_gate[g], (1, 0))
        up = _dot(rows, w_up[g], (1, 0))
        h = (jax.nn.silu(gate) * up).astype(x.dtype)
        y = _dot(h, w_down[g], (1, 0)).astype(out.dtype)
        old = jax.lax.dynamic_slice_in_dim(out, offset, tile, axis=0)
        out = jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mask, y, old), offset, axis=0)
        return i + 1, out

    out = vary(jnp.zeros((Cp, D), x.dtype), varying_axes(xp))
    i0 = vary(jnp.int32(0), varying_axes(count))
    _, out = jax.lax.while_loop(lambda c: c[0] < count, body, (i0, out))
    return out[:C]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _swiglu(x, w_gate, w_up, w_down, group_start, group_size, tile):
    return _forward(x, w_gate, w_up, w_down, group_start, group_size, tile)


def _swiglu_fwd(x, w_gate, w_up, w_down, group_start, group_size, tile):
    out = _forward(x, w_gate, w_up, w_down, group_start, group_size, tile)
    return out, (x, w_gate, w_up, w_down, group_start, group_size)


def _swiglu_bwd(tile, res, d_out):
    x, w_gate, w_up, w_down, group_start, group_size = res
    C, D = x.shape
    G = w_gate.shape[0]
    Cp = -(-C // tile) * tile
    xp = jnp.pad(x, ((0, Cp - C), (0, 0)))
    dp = jnp.pad(d_out, ((0, Cp - C), (0, 0)))
    item_tile, item_group, count = work_items(group_start, group_size, tile, Cp // tile + G)

    def body(carry):
        i, dx, dwg, dwu, dwd = carry
        offset, g, rows, mask = _tile_inputs(
            xp, group_start, group_size, item_tile, item_group, i, tile
        )
        dy = jnp.where(mask, jax.lax.dynamic_slice_in_dim(dp, offset, tile, axis=0), 0)
        wg, wu, wd = w_gate[g], w_up[g], w_down[g]
        gate = _dot(rows, wg, (1, 0))
        up = _dot(rows, wu, (1, 0))
        sig = jax.nn.sigmoid(gate)
        act = gate * sig
        h = (act * up).astype(x.dtype)
        dh = _dot(dy, wd, (1, 1))  # [m, F]
        d_up = dh * act
        d_gate = dh * up * sig * (1 + gate * (1 - sig))
        d_rows = _dot(d_gate.astype(x.dtype), wg, (1, 1)) + _dot(d_up.astype(x.dtype), wu, (1, 1))
        old = jax.lax.dynamic_slice_in_dim(dx, offset, tile, axis=0)
        dx = jax.lax.dynamic_update_slice_in_dim(dx, old + d_rows, offset, axis=0)
        dwg = dwg.at[g].add(_dot(rows, d_gate.astype(x.dtype), (0, 0)))
        dwu = dwu.at[g].add(_dot(rows, d_up.astype(x.dtype), (0, 0)))
        dwd = dwd.at[g].add(_dot(h, dy, (0, 0)))
        return i + 1, dx, dwg, dwu, dwd

    axes = varying_axes(xp) | varying_axes(dp)
    f32 = jnp.float32
    init = (
        vary(jnp.int32(0), varying_axes(count)),
        vary(jnp.zeros((Cp, D), f32), axes),
        vary(jnp.zeros(w_gate.shape, f32), axes),
        vary(jnp.zeros(w_up.shape, f32), axes),
        vary(jnp.zeros(w_down.shape, f32), axes),
    )
    _, dx, dwg, dwu, dwd = jax.lax.while_loop(lambda c: c[0] < count, body, init)
    return (
        dx[:C].astype(x.dtype),
        dwg.astype(w_gate.dtype),
        dwu.astype(w_up.dtype),
        dwd.astype(w_down.dtype),
        None,
        None,
    )


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def tiled_swiglu(
    rows: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    group_start: jax.Array,
    group_size: jax.Array,
    tile: int | None = None,
) -> jax.Array:
    """[C, D]: ``(silu(x @ w_gate[g]) * (x @ w_up[g])) @ w_down[g]`` for the rows of each group g,
    zeros for rows in no group.

    Args:
      rows: [C, D].
      w_gate, w_up: [G, D, F]; w_down: [G, F, D].
      group_start, group_size: int32 [G]: group g holds rows ``[start, start + size)``; groups
        must not overlap and must lie inside ``[0, C)``.
      tile: rows per work item (static); default `default_tile(C)`.
    """
    tile = default_tile(rows.shape[0]) if tile is None else tile
    # One varying type for every operand, so that the custom VJP's cotangents match its inputs;
    # the cast's own transpose sums the weight gradients over the axes the weights do not vary on.
    axes = frozenset().union(*(varying_axes(a) for a in (rows, w_gate, w_up, w_down)))
    args = [vary(a, axes) for a in (rows, w_gate, w_up, w_down)]
    start = vary(group_start.astype(jnp.int32), axes)
    size = vary(group_size.astype(jnp.int32), axes)
    return _swiglu(*args, start, size, tile)
