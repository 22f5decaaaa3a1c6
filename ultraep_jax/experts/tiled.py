"""Gated experts (SwiGLU and its kin) over grouped rows as a loop over groups and, inside each,
over row tiles, with its VJP.

`jax.lax.ragged_dot` on XLA:CPU is a masked dense product: every group multiplies every row of
the buffer, so its cost is groups x buffer rows whatever the real group sizes are. Here a loop
visits each group once (its weights are sliced once) and runs the whole gated MLP on the group's
rows in tiles of ``tile`` rows laid from the group's first row; the rows a group has past its
last whole tile take one more tile, which ends at the group's end and recomputes rows of the tile
before it, their results masked off (`group_tiles`). Trip counts are runtime values, so the cost
tracks the rows actually present, and every tile has one static shape. (Covering the rest in tiles
of halving size, as before, cost a training call 2.5-3 % more for 8-10 groups of unaligned sizes
than for tile-aligned ones at D=128, F=64: every small tile and every loop that runs pays a fixed
cost, and a balanced rank's groups have unaligned sizes where the force-balanced ideal's do not.
With one tile for the rest, both cost the same within 1 %.) A group's w_gate and w_up sit side by
side, so a tile runs one matmul for both, and one for their input and weight gradients (10 % off a
training call at D=128, F=64, 64-row tiles). The backward pass is a loop of the same shape (custom
VJP) that recomputes the hidden activations per tile instead of storing them and sums each group's
weight gradients in the loop carry. Both loops visit only the groups that have rows: an empty group
(an unused replica slot, an expert no token chose) would otherwise still pay its per-group set-up,
which cost a training call at D=64, F=128 with two empty slots 5 % of its time.

Groups are given by explicit row ranges ``[start[g], start[g] + size[g])`` so that one buffer can
be split between two calls (master experts, then replica slots) without shifting rows.

The activation is static and hashable (a name of `ACTIVATIONS` or a `ClampedSwiGLU`); the backward
pass takes its elementwise derivatives by automatic differentiation (`activations.glu_with_grads`),
so any elementwise gated unit works with the same loop. A stack may carry biases (gpt-oss's
experts): the gate and up biases are added to a tile's one gate|up product, the down bias to its
output, and their gradients are summed in the same loop as the weights'.

Shapes: C rows, D model width, F hidden width, G groups, m = rows of a tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ultraep_jax._vma import vary, varying_axes
from ultraep_jax.base.activations import check_activation, glu, glu_with_grads


def default_tile(num_rows: int) -> int:
    """Rows per tile: 64, or fewer (a multiple of 8) for small buffers."""
    return max(8, min(64, -(-num_rows // 32) * 8))


def group_tiles(start, size, num_rows: int, tile: int):
    """How groups of rows ``[start, start + size)`` of a ``num_rows``-row buffer are cut into
    tiles of ``tile`` rows (``tile <= num_rows``).

    Args:
      start, size: int32 arrays of one shape (e.g. [G]), each group's rows.

    Returns:
      (full, offset, first_new), int32 of that shape: ``full`` whole tiles at rows
      ``start + j * tile``, then, when ``size`` is not a multiple of ``tile``, one more tile at
      rows ``[offset, offset + tile)`` that adds rows ``[first_new, start + size)``. That tile
      ends at the group's end when the group holds a whole tile (it stays inside the group and
      recomputes rows of the tile before it), else it starts at the group's first row, moved back
      as far as it must be to end inside the buffer.
    """
    full = size // tile
    offset = jnp.where(full > 0, start + size - tile, jnp.minimum(start, num_rows - tile))
    return full, offset, start + full * tile


def _dot(a, b, contract):
    """float32 ``a . b`` contracting a's axis ``contract[0]`` with b's ``contract[1]``."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _repeat(count, body, carry):
    """``body(j, carry)`` for j = 0 .. count - 1, ``count`` a traced int32 []."""

    def step(c):
        j, inner = c
        return j + 1, body(j, inner)

    j0 = vary(jnp.int32(0), varying_axes(count))
    return jax.lax.while_loop(lambda c: c[0] < count, step, (j0, carry))[1]


def _over_groups(group_size, body, carry):
    """``body(g, carry)`` for each group g with rows, in group order; groups of no rows cost
    nothing (a balanced rank's unused replica slots, experts no token chose)."""
    # Non-empty groups first, in order: a stable sort on "is empty".
    order = jnp.argsort((group_size <= 0).astype(jnp.int32), stable=True).astype(jnp.int32)
    count = jnp.sum(group_size > 0, dtype=jnp.int32)
    return _repeat(count, lambda j, c: body(order[j], c), carry)


def _over_tiles(g, group_start, group_size, num_rows, tile, tile_fn, carry):
    """``tile_fn(offset, mask, carry)`` on each tile of group ``g`` (`group_tiles`): ``mask``
    None for whole tiles, bool [tile, 1] (the rows it adds) for the last one."""
    start, size = group_start[g], group_size[g]
    full, offset, first_new = group_tiles(start, size, num_rows, tile)
    carry = _repeat(full, lambda j, c: tile_fn(start + j * tile, None, c), carry)
    rows = offset + jnp.arange(tile, dtype=jnp.int32)
    mask = ((rows >= first_new) & (rows < start + size))[:, None]
    # A loop of 0 or 1 trips, not a `lax.cond`: a conditional copies the buffers it carries.
    rest = (size > full * tile).astype(jnp.int32)
    return _repeat(rest, lambda j, c: tile_fn(offset, mask, c), carry)


def _part_offsets(parts) -> np.ndarray:
    """int [len(parts) + 1]: the first group of each part overall, then the group count."""
    return np.cumsum([0] + [part[0].shape[0] for part in parts])


def _row(part, g):
    """Group ``g``'s slice of every tensor of ``part`` (None stays None)."""
    return tuple(None if w is None else w[g] for w in part)


def _group_weights(parts, g):
    """(w_gate|w_up [D, 2F], w_down [F, D], b_gate|b_up [2F] or None, b_down [D] or None) of
    group ``g`` (traced int32 []) counted over all parts: gate and up side by side, so that a
    tile runs one matmul for both."""
    if len(parts) == 1:
        group = _row(parts[0], g)
    else:
        offsets = _part_offsets(parts)
        which = jnp.sum(g >= offsets[1:-1]).astype(jnp.int32)
        branches = [
            functools.partial(lambda part, o: _row(part, g - o), part, int(o))
            for part, o in zip(parts, offsets, strict=False)
        ]
        group = jax.lax.switch(which, branches)
    wg, wu, wd = group[:3]
    bg, bu, bd = group[3:] or (None, None, None)
    bgu = None if bg is None else jnp.concatenate([bg, bu])
    return jnp.concatenate([wg, wu], axis=1), wd, bgu, bd


def _plus(a, bias):
    """float32 ``a`` [m, n] plus ``bias`` [n] (nothing when None)."""
    return a if bias is None else a + bias.astype(jnp.float32)


def _forward(x, parts, group_start, group_size, tile, activation):
    C, D = x.shape
    out = vary(jnp.zeros((C, D), x.dtype), varying_axes(x))

    # One loop over every part's groups: a collective that XLA scheduled between two loops would
    # make the rank running a replica slot wait for its expert's master rank to finish the master
    # group first (a training step measured 37 ms of such waiting on each of two pinned ranks).
    def group(g, out):
        wgu, wd, bgu, bd = _group_weights(parts, g)
        F = wd.shape[0]

        def tile_fn(offset, mask, out):
            rows = jax.lax.dynamic_slice_in_dim(x, offset, tile, axis=0)
            gate_up = _plus(_dot(rows, wgu, (1, 0)), bgu)
            h = glu(activation, gate_up[:, :F], gate_up[:, F:]).astype(x.dtype)
            y = _plus(_dot(h, wd, (1, 0)), bd).astype(out.dtype)
            if mask is not None:
                y = jnp.where(mask, y, jax.lax.dynamic_slice_in_dim(out, offset, tile, axis=0))
            return jax.lax.dynamic_update_slice_in_dim(out, y, offset, axis=0)

        return _over_tiles(g, group_start, group_size, C, tile, tile_fn, out)

    return _over_groups(group_size, group, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _glu(x, parts, group_start, group_size, tile, activation):
    return _forward(x, parts, group_start, group_size, tile, activation)


def _glu_fwd(x, parts, group_start, group_size, tile, activation):
    out = _forward(x, parts, group_start, group_size, tile, activation)
    return out, (x, parts, group_start, group_size)


def _split_parts(grads, offsets, F: int):
    """Per part, the (w_gate, w_up, w_down[, b_gate, b_up, b_down]) gradients from every group's
    [G, D, 2F] gate|up and [G, F, D] down gradients, then, with biases, the [G, 2F] gate|up and
    [G, D] (or None) down bias gradients."""
    grad_gu, grad_d, *biases = grads

    def part(a, b):
        weights = (grad_gu[a:b, :, :F], grad_gu[a:b, :, F:], grad_d[a:b])
        if not biases:
            return weights
        grad_bgu, grad_bd = biases
        return (*weights, grad_bgu[a:b, :F], grad_bgu[a:b, F:], _slice(grad_bd, a, b))

    return tuple(
        part(a, b) for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)
    )


def _slice(a, start: int, stop: int):
    """``a[start:stop]``, None for None."""
    return None if a is None else a[start:stop]


def _grads(x, dy_all, parts, group_start, group_size, tile, activation):
    """dx [C, D] (float32) and every part's weight gradients (float32, one [G_i, ...] per
    weight), in one loop over all groups (see `_forward`)."""
    axes = varying_axes(x) | varying_axes(dy_all)
    f32, dtype = jnp.float32, x.dtype
    offsets = _part_offsets(parts)

    def group(g, carry):
        dx, grads = carry
        wgu, wd, bgu, bd = _group_weights(parts, g)
        F = wd.shape[0]

        def tile_fn(offset, mask, acc):
            dx, g_gu, g_d, *g_b = acc
            rows = jax.lax.dynamic_slice_in_dim(x, offset, tile, axis=0)
            dy = jax.lax.dynamic_slice_in_dim(dy_all, offset, tile, axis=0)
            if mask is not None:
                # Rows the tile does not add contribute nothing, even if they hold inf or NaN
                # (another group's rows, or buffer rows in no group): 0 * inf would be NaN.
                rows, dy = jnp.where(mask, rows, 0), jnp.where(mask, dy, 0)
            gate_up = _plus(_dot(rows, wgu, (1, 0)), bgu)  # [m, 2F]
            dh = _dot(dy, wd, (1, 1))  # [m, F]
            h, d_gate, d_up = glu_with_grads(activation, gate_up[:, :F], gate_up[:, F:], dh)
            h = h.astype(dtype)
            d_gate_up = jnp.concatenate([d_gate, d_up], axis=1).astype(dtype)  # [m, 2F]
            d_rows = _dot(d_gate_up, wgu, (1, 1))
            old = jax.lax.dynamic_slice_in_dim(dx, offset, tile, axis=0)
            dx = jax.lax.dynamic_update_slice_in_dim(dx, old + d_rows, offset, axis=0)
            acc = (dx, g_gu + _dot(rows, d_gate_up, (0, 0)), g_d + _dot(h, dy, (0, 0)))
            if not g_b:
                return acc
            # A bias's gradient: its output's cotangent summed over the tile's rows.
            g_bgu = g_b[0] + jnp.sum(d_gate_up.astype(f32), axis=0)
            g_bd = None if g_b[1] is None else g_b[1] + jnp.sum(dy.astype(f32), axis=0)
            return (*acc, g_bgu, g_bd)

        zero = tuple(None if a is None else vary(jnp.zeros(a.shape[1:], f32), axes) for a in grads)
        dx, *group_grads = _over_tiles(g, group_start, group_size, C, tile, tile_fn, (dx, *zero))
        grads = tuple(
            None if a is None else a.at[g].set(b) for a, b in zip(grads, group_grads, strict=True)
        )
        return dx, grads

    C, D = x.shape
    G, F = int(offsets[-1]), parts[0][2].shape[1]
    dx = vary(jnp.zeros((C, D), f32), axes)
    # Every part's groups in one stack, split once at the end: one in-place update per group.
    shapes = [(G, D, 2 * F), (G, F, D)]
    if len(parts[0]) > 3:  # biases: gate|up [G, 2F], and down [G, D] unless the parts have none
        shapes += [(G, 2 * F), None if parts[0][5] is None else (G, D)]
    zeros = tuple(None if s is None else vary(jnp.zeros(s, f32), axes) for s in shapes)
    dx, grads = _over_groups(group_size, group, (dx, zeros))
    return dx, _split_parts(grads, offsets, F)


def _glu_bwd(tile, activation, res, d_out):
    x, parts, group_start, group_size = res
    dx, grads = _grads(x, d_out, parts, group_start, group_size, tile, activation)
    grads = tuple(
        tuple(None if w is None else g.astype(w.dtype) for g, w in zip(pg, part, strict=True))
        for pg, part in zip(grads, parts, strict=True)
    )
    return dx.astype(x.dtype), grads, None, None


_glu.defvjp(_glu_fwd, _glu_bwd)


def tiled_glu_parts(
    rows: jax.Array,
    parts,
    group_start: jax.Array,
    group_size: jax.Array,
    tile: int | None = None,
    activation="silu",
) -> jax.Array:
    """[C, D]: ``glu(x @ w_gate[g] + b_gate[g], x @ w_up[g] + b_up[g]) @ w_down[g] + b_down[g]``
    for the rows of each group g (``glu``: `activations.glu`; the biases 0 where a part has
    none), zeros for rows in no group, with the groups' weights in consecutive parts.

    Args:
      rows: [C, D].
      parts: a sequence of weight stacks (w_gate, w_up [G_i, D, F], w_down [G_i, F, D]), each
        optionally followed by its biases (b_gate, b_up [G_i, F], b_down [G_i, D] or None), every
        part alike, whose groups follow each other (a rank's masters, then its replica slots,
        without concatenating them): group g of ``group_start`` is the first part's group g while
        g < G_0, and so on.
      group_start, group_size: int32 [sum G_i]: group g holds rows ``[start, start + size)``;
        groups must not overlap and must lie inside ``[0, C)``.
      tile: rows per full tile (static; at most C); default `default_tile(C)`.
      activation: a name of `ACTIVATIONS` or a `ClampedSwiGLU` (static).
    """
    check_activation(activation)
    if len({tuple(w is None for w in part) + (len(part),) for part in parts}) > 1:
        raise ValueError("tiled_glu_parts: every part must carry the same biases")
    tile = default_tile(rows.shape[0]) if tile is None else tile
    tile = max(1, min(tile, rows.shape[0]))  # a full tile must fit in the buffer
    # One varying type for every operand, so that the custom VJP's cotangents match its inputs;
    # the cast's own transpose sums the weight gradients over the axes the weights do not vary on.
    leaves = [rows, *jax.tree.leaves(parts)]
    axes = frozenset().union(*(varying_axes(a) for a in leaves))
    # A part of no groups takes no rows (its gradient is zero without being computed).
    parts = tuple(
        tuple(None if w is None else vary(w, axes) for w in part)
        for part in parts
        if part[0].shape[0]
    )
    if not parts or rows.shape[0] == 0:  # no weights, or no rows for a tile to read
        return jnp.zeros_like(rows)
    start = vary(group_start.astype(jnp.int32), axes)
    size = vary(group_size.astype(jnp.int32), axes)
    return _glu(vary(rows, axes), parts, start, size, tile, activation)


def tiled_glu(
    rows: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    group_start: jax.Array,
    group_size: jax.Array,
    tile: int | None = None,
    activation="silu",
) -> jax.Array:
    """`tiled_glu_parts` with one weight stack: w_gate, w_up [G, D, F]; w_down [G, F, D]."""
    parts = [(w_gate, w_up, w_down)]
    return tiled_glu_parts(rows, parts, group_start, group_size, tile, activation)
