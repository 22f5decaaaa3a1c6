"""The expert kernels' registry: gated feed-forward networks (SwiGLU by default; `activations`)
applied to rows grouped by expert, with or without biases.

Every kernel runs rows through the groups of one or more weight stacks, laid out one after the
other from row 0 (a rank's masters, then its slots). Which kernel a name is on the platform of the
mesh being traced on, "auto" included, is `config.resolve`'s rule (its candidates, in the order
"auto" tries them); `_MATMULS` maps each grouped-matmul kernel's name to its code, and "tiled" is
the one kernel that runs a whole stack at once. Adding a kernel is one file (its grouped matmul),
its candidate there and one entry here. The GPU and tokamax grouped matmuls are imported when a
layer using them is traced, so importing the library loads no Pallas, Mosaic or tokamax module.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ultraep_jax._ops import exclusive_cumsum
from ultraep_jax.base.activations import check_activation, glu
from ultraep_jax.config import resolve
from ultraep_jax.experts.tiled import tiled_glu_parts


def _ragged_dot(lhs, rhs, group_sizes, platform, facts, out_dtype):
    """`jax.lax.ragged_dot`, its products in ``out_dtype`` (accumulated in float32 and rounded
    once when that is bf16)."""
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype)


def _mgpu(lhs, rhs, group_sizes, platform, facts, out_dtype):
    """JAX's Hopper (Mosaic GPU) ragged-dot kernels (`gmm_mgpu`), imported when first traced;
    accumulated in float32, the products in the operands' dtype (the kernels write no other)."""
    from ultraep_jax.experts import gmm_mgpu

    return gmm_mgpu.grouped_matmul_mgpu(lhs, rhs, group_sizes).astype(out_dtype)


def _tokamax(lhs, rhs, group_sizes, platform, facts, out_dtype):
    """tokamax's ragged dot with the implementation of ``platform`` (`gmm_tokamax`), imported
    when first traced; float32 products."""
    from ultraep_jax.experts import gmm_tokamax

    products = gmm_tokamax.grouped_matmul_tokamax(
        lhs, rhs, group_sizes, platform=platform, device_kind=facts.device_kind
    )
    return products.astype(out_dtype)


#: Each grouped matmul by its kernel name: (lhs [M, K], rhs [G, K, N], group_sizes [G], the
#: platform, `resolve.Facts`, the products' dtype) -> [M, N], `jax.lax.ragged_dot`'s semantics.
_MATMULS = {"ragged_dot": _ragged_dot, "mgpu": _mgpu, "tokamax": _tokamax}


def _resolved_matmul(kernel: str, platform: str | None, facts: resolve.Facts):
    """``ragged_dot(lhs, rhs, group_sizes)`` by the grouped matmul that ``kernel`` is on
    ``platform`` for each call's own operands ("auto" on CUDA: Mosaic GPU where the operands
    suit it, else `ragged_dot`), its products in ``out_dtype`` (float32 unless given)."""

    def grouped(lhs, rhs, group_sizes, out_dtype=jnp.float32):
        given = dataclasses.replace(facts, operands=resolve.Operands.of(lhs, rhs))
        name = resolve.choose("expert_kernel", kernel, platform, given)
        target = resolve.canonical_platform(platform, facts.device_kind)
        return _MATMULS[name](lhs, rhs, group_sizes, target, given, out_dtype)

    return grouped


def _tiled(rows, stacks, starts, group_sizes, activation):
    """The tiled loop (`tiled`: its cost tracks the rows present) over every given stack
    at once: on a CPU nothing can overlap, and one loop has half the fixed cost of two."""
    first, last = stacks[0][1], stacks[-1][2]  # the given stacks' groups are consecutive
    parts = [stack for stack, _, _ in stacks]
    sizes = group_sizes[first:last]
    return tiled_glu_parts(rows, parts, starts[first:last], sizes, activation=activation)


def _row_biases(biases, sizes, num_rows: int) -> tuple:
    """Each row's group's biases ([C, ...] per bias; zeros for rows in no group, whose outputs
    are zero), the rows grouped from row 0 by ``sizes``; None stays None."""
    group_C = jnp.searchsorted(
        jnp.cumsum(sizes), jnp.arange(num_rows, dtype=jnp.int32), side="right"
    )
    return tuple(
        None if b is None else jnp.take(b, group_C, axis=0, mode="fill", fill_value=0)
        for b in biases
    )


def _plus(a, bias):
    """``a`` plus ``bias`` in a's dtype (nothing when None)."""
    return a if bias is None else a + bias.astype(a.dtype)


#: The names of a matmul stack's float32 gate and up products, the only values of its forward
#: pass its backward pass keeps (`_by_matmul`).
_GATE, _UP = "ultraep_expert_gate", "ultraep_expert_up"


def _by_matmul(grouped):
    """The experts as three calls of ``grouped`` (``ragged_dot(lhs, rhs, group_sizes)``
    semantics) per stack, so that one stack's work does not wait for another's weights; a
    stack's biases are each row's group's, added to the products. As in the tiled kernel, the
    gated unit (and each bias sum) is computed in float32 whatever the rows' dtype, and its
    output rounded to that dtype for the down matmul: in bf16 a unit computed on bf16 products
    (a clamped unit's bounds at small limits most) gave gradients off by a sixth of their
    largest.

    A stack's backward pass keeps at most its float32 gate and up products [C, F] and
    recomputes the rest from them and the rows (the rolls, the gated unit and its output
    [C, F]: elementwise work, no matmul), not the products of every elementwise step of the
    unit (which a `lax.cond` around the slots' stack had to hand out whole); and a stack's
    output is in the rows' dtype, its down products rounded once. The stacks' rows are disjoint
    (a row gets zeros from every stack but its own), so their outputs add exactly in that
    dtype."""

    def one_stack(rows, stack, shift, sizes, activation):
        (w_gate, w_up, w_down), biases = stack[:3], stack[3:] or (None, None, None)
        # Grouped matmuls know no row offset: rotate the stack's first row to row 0 and back
        # (a dynamic roll, whose transpose is another roll; a gather would transpose to a slow
        # scatter-add). ``shift`` is None for a stack whose groups start at row 0.
        shifted = rows if shift is None else jnp.roll(rows, -shift, axis=0)
        b_gate, b_up, b_down = _row_biases(biases, sizes, rows.shape[0])
        f32 = jnp.float32
        gate = checkpoint_name(_plus(grouped(shifted, w_gate, sizes).astype(f32), b_gate), _GATE)
        up = checkpoint_name(_plus(grouped(shifted, w_up, sizes).astype(f32), b_up), _UP)
        h = glu(activation, gate, up).astype(rows.dtype)
        if b_down is None:  # the products rounded once, straight to the rows' dtype
            part = grouped(h, w_down, sizes, rows.dtype)
        else:
            part = _plus(grouped(h, w_down, sizes), b_down).astype(rows.dtype)
        return part if shift is None else jnp.roll(part, shift, axis=0)

    # Without CSE barriers: XLA may still reuse a forward value it holds anyway (the masters'
    # stack outside any cond); the policy bounds what a stack run in the replica slots' cond
    # hands its backward pass. With barriers, XLA:GPU's schedule of DeepSeek-V3's layer at EP8
    # held 19 GiB more per device (compiled for H100s, ragged_dot; docs/results/memory.md).
    policy = jax.checkpoint_policies.save_only_these_names(_GATE, _UP)
    stack_fn = jax.checkpoint(one_stack, policy=policy, static_argnums=(4,), prevent_cse=False)

    def run(rows, stacks, starts, group_sizes, activation):
        out = None
        for stack, first, last in stacks:
            shift = starts[first] if first else None
            part = stack_fn(rows, stack, shift, group_sizes[first:last], activation)
            out = part if out is None else out + part
        return out

    return run


def _glu_on(platform: str | None, kernel: str, rows, stacks, starts, group_sizes, activation):
    """[C, D]: ``stacks`` (weights, first group, end group) through ``kernel`` as it resolves on
    ``platform``: the tiled loop over every stack at once, or each stack as its grouped
    matmuls' calls (`_by_matmul`)."""
    facts = resolve.traced_facts()
    if resolve.choose("expert_kernel", kernel, platform, facts) == "tiled":
        return _tiled(rows, stacks, starts, group_sizes, activation)
    run = _by_matmul(_resolved_matmul(kernel, platform, facts))
    return run(rows, stacks, starts, group_sizes, activation)


def fuses_stacks(kernel: str) -> bool:
    """Whether ``kernel`` runs every weight stack in one loop (it is "tiled" on the platform of
    the mesh traced on), rather than each stack as its own calls ("auto" where no mesh names the
    platform counts as the latter)."""
    platform = resolve.traced_platform()
    if platform is None:
        return kernel == "tiled"
    return resolve.choose("expert_kernel", kernel, platform, resolve.traced_facts()) == "tiled"


def grouped_glu(
    rows: jax.Array,
    stacks: list[tuple[jax.Array | None, ...] | None],
    group_sizes: jax.Array,
    kernel: str = "auto",
    activation="silu",
) -> jax.Array:
    """[C, D]: ``glu(x @ w_gate[g] + b_gate[g], x @ w_up[g] + b_up[g]) @ w_down[g] + b_down[g]``
    for each row's group g (``glu``: `activations.glu` of ``activation``, for a name
    ``act(gate) * up``; a bias 0 where the stack has none).

    Args:
      rows: [C, D], grouped from row 0: the first ``group_sizes[0]`` rows belong to group 0, and
        so on; rows in no group give zeros.
      stacks: the groups' weights, stack after stack, each (w_gate, w_up [G_i, D, F], w_down
        [G_i, F, D]), optionally followed by its biases (b_gate, b_up [G_i, F], b_down [G_i, D]
        or None: no down bias); None for a stack run elsewhere (its rows give zeros here), whose
        G_i is what ``group_sizes`` leaves after the given stacks (at most one None, first or
        last).
      group_sizes: int32 [G], G = sum of the G_i.
      kernel: one of `config.execution.KERNELS`: "tiled" (`tiled`: a loop over row tiles whose cost
        tracks the rows present; all stacks in one loop), "ragged_dot" (`jax.lax.ragged_dot`; a
        masked dense product on CPU, in which inf or NaN in one group's weights reaches every row
        as 0 * inf; the tiled kernel keeps a group's non-finite values in its own rows), "mgpu"
        (JAX's Hopper Mosaic GPU kernels, `gmm_mgpu`), "tokamax" (tokamax's ragged dot with the
        platform's implementation, `gmm_tokamax`), or "auto", resolved for the platform of the
        mesh traced on (`config.resolve`): tiled on CPU; on CUDA Mosaic GPU on Hopper where the
        operands suit it, else `jax.lax.ragged_dot`; on TPU tokamax's Mosaic TPU kernel where
        it is installed and takes the operands, else `ragged_dot`. The matmul kernels run each
        stack as its own calls, so that the masters' work does not wait for the replica weights
        to arrive.
      activation: a name of `activations.ACTIVATIONS` (default "silu": SwiGLU) or an
        `activations.ClampedSwiGLU`.
    """
    check_activation(activation)
    resolve.check_name("expert_kernel", kernel, "grouped_glu")
    sizes = group_sizes.astype(jnp.int32)
    unknown = sizes.shape[0] - sum(s[0].shape[0] for s in stacks if s is not None)
    given, first = [], 0  # (weights, first group, end group) of each given stack
    for stack in stacks:
        count = unknown if stack is None else stack[0].shape[0]
        if stack is not None:
            given.append((stack, first, first + count))
        first += count
    starts = exclusive_cumsum(sizes, 0)

    def run(platform):
        return functools.partial(_glu_on, platform, kernel, rows, given, starts, sizes, activation)

    return resolve.by_platform("expert_kernel", kernel, run)


def local_experts(
    rows: jax.Array,
    masters: tuple[jax.Array, ...],
    replicas: tuple[jax.Array, ...] | None,
    group_sizes: jax.Array,
    kernel: str = "auto",
    activation="silu",
) -> jax.Array:
    """[C, D]: every received row through its local instance: the E_m masters' groups first,
    then the S replica slots' groups (`grouped_glu` of the two stacks).

    Args:
      rows: [C, D], grouped by local instance from row 0.
      masters: (w_gate, w_up [E_m, D, F], w_down [E_m, F, D]), this rank's master experts,
        optionally followed by their biases (`grouped_glu`).
      replicas: the same for the S slots ([S, ...]), or None when there are no slots.
      group_sizes: int32 [E_m + S].
      kernel, activation: see `grouped_glu`.
    """
    stacks = [masters] if replicas is None else [masters, replicas]
    return grouped_glu(rows, stacks, group_sizes, kernel, activation)
