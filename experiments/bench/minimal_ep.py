"""A fixed-buffer expert-parallel layer of a few lines: the baseline whose compile time
`experiments.bench.compile_layer` sets the library's against (its own module: no flags, so a test
can import it)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def minimal_ep(x_TD, ids_TK, w_TK, params, mesh, *, num_experts: int, top_k: int):
    """[T, D]: a fixed-buffer expert-parallel layer (capacity 1.25 x the mean per expert)."""
    R, E, K = mesh.shape["expert"], num_experts, top_k

    def shard(x, ids, w, wg, wu, wd):
        T = x.shape[0]
        cap = math.ceil(1.25 * T * K / E)
        onehot = jax.nn.one_hot(ids.reshape(-1), E, dtype=jnp.int32)  # [T*K, E]
        # A pair's slot is its position among its own expert's pairs (0-based).
        slot = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=1) - 1
        keep = (slot < cap) & (slot >= 0)
        dest = jnp.where(keep, ids.reshape(-1) * cap + slot, E * cap)
        buf = jnp.zeros((E * cap + 1, x.shape[1]), x.dtype).at[dest].set(jnp.repeat(x, K, 0))
        buf = buf[:-1].reshape(R, E // R * cap, -1)
        got = jax.lax.all_to_all(buf, "expert", 0, 0, tiled=True)  # [R(src), Em*cap, D]
        got = got.reshape(R, E // R, cap, -1).transpose(1, 0, 2, 3).reshape(E // R, R * cap, -1)
        h = jax.nn.silu(jnp.einsum("gcd,gdf->gcf", got, wg)) * jnp.einsum("gcd,gdf->gcf", got, wu)
        out = jnp.einsum("gcf,gfd->gcd", h, wd)
        out = out.reshape(E // R, R, cap, -1).transpose(1, 0, 2, 3).reshape(R, -1, out.shape[-1])
        back = jax.lax.all_to_all(out, "expert", 0, 0, tiled=True).reshape(E * cap, -1)
        back = jnp.concatenate([back, jnp.zeros((1, back.shape[1]), back.dtype)])
        y = back[dest].reshape(T, K, -1)
        return jnp.einsum("tk,tkd->td", w * keep.reshape(T, K), y)

    spec = P("expert")
    return jax.shard_map(shard, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec)(
        x_TD, ids_TK, w_TK, *params
    )
