"""What several test files build the same way: the meshes of the 8 simulated devices (also
fixtures: tests/conftest.py), the layer with given parameter values, skewed inputs and parameter
values to write in, a batch placed on a mesh, the layer's values and gradients, those of
`routed_experts` or a reference of it, the replica transfer with its gradient
(`transfer.fetch_replica_experts` over the "expert" axis), and the checks of one-line errors and
of integer arguments."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from ultraep_jax import comm
from ultraep_jax.config import resolve
from ultraep_jax.replicas import transfer

#: The meshes the layer tests run on, by name: (data size, EP size).
MESH_KINDS = {"ep8": (1, 8), "dp2ep4": (2, 4)}


def expert_mesh(ep: int = 8, dp: int = 1) -> jax.sharding.Mesh:
    """``ep`` ranks on the "expert" axis of the first ``dp * ep`` devices, under a "data" axis
    of size ``dp`` when ``dp > 1``."""
    devices = jax.devices()[: dp * ep]
    if dp == 1:
        return jax.make_mesh((ep,), ("expert",), devices=devices)
    return jax.make_mesh((dp, ep), ("data", "expert"), devices=devices)


def auto_axes(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """The same devices and axis names with every axis of type Auto."""
    return jax.sharding.Mesh(
        mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim
    )


def gpu_mesh(axis_sizes, axis_names, axis_types=None) -> AbstractMesh:
    """An abstract mesh of H100s (axes Explicit unless given, as from `jax.make_mesh`), to export
    for CUDA on a host without a GPU: since jax 0.11 the CUDA lowering of a Pallas (Triton) kernel
    reads the GPU's kind from the mesh's abstract device, and fails when it finds none."""
    h100 = AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    types = (AxisType.Explicit,) * len(axis_names) if axis_types is None else axis_types
    return AbstractMesh(axis_sizes, axis_names, axis_types=types, abstract_device=h100)


def gpu_expert_mesh(ep: int = 8, dp: int = 1) -> AbstractMesh:
    """`expert_mesh`'s axes over abstract H100s (`gpu_mesh`)."""
    if dp == 1:
        return gpu_mesh((ep,), ("expert",))
    return gpu_mesh((dp, ep), ("data", "expert"))


def abstract_batch(mesh, shape, dtype) -> jax.ShapeDtypeStruct:
    """A batch of ``shape`` placed as `place_batch` places it, without the values."""
    return jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(mesh, P(tuple(mesh.axis_names)))
    )


def make_mesh(kind: str) -> jax.sharding.Mesh:
    """'ep8': (8,) ("expert",); 'dp2ep4': (2, 4) ("data", "expert")."""
    if kind not in MESH_KINDS:
        raise ValueError(kind)
    dp, ep = MESH_KINDS[kind]
    return expert_mesh(ep, dp)


def set_param(var, value) -> None:
    """Writes a value into an nnx variable, keeping its dtype and sharding."""
    old = var[...]
    var[...] = jax.device_put(jnp.asarray(value, old.dtype), old.sharding)


def build_layer(mesh, params: Mapping[str, np.ndarray] | None = None, **options) -> uep.MoE:
    """``uep.MoE(mesh=mesh, rngs=nnx.Rngs(0), **options)`` with ``params`` (variable name ->
    value, e.g. ``router_kernel``, ``w_gate``, ``router_bias``) written in."""
    layer = uep.MoE(mesh=mesh, rngs=nnx.Rngs(0), **options)
    for name, value in (params or {}).items():
        set_param(getattr(layer, name), value)
    return layer


def draw_routed_inputs(rng, batch, seq, d_model, d_ff, num_experts, skew, hot=(0, 1)):
    """float32 x [batch, seq, D] and the routed experts' parameter values (``router_kernel`` [D,
    E], ``w_gate``, ``w_up`` [E, D, F], ``w_down`` [E, F, D]) drawn from ``rng``; ``skew`` makes
    the ``hot`` experts take most tokens (a shared direction ``u`` in x that their router
    columns align with)."""
    D, F, E = d_model, d_ff, num_experts
    u = rng.normal(size=D)
    u /= np.linalg.norm(u)
    x = rng.normal(size=(batch, seq, D))
    router = 0.7 * rng.normal(size=(D, E))
    if skew:
        x += 2.0 * u
        router[:, list(hot)] += 3.0 * u[:, None]
    params = {
        "router_kernel": router,
        "w_gate": rng.normal(size=(E, D, F)) / math.sqrt(D),
        "w_up": rng.normal(size=(E, D, F)) / math.sqrt(D),
        "w_down": rng.normal(size=(E, F, D)) / math.sqrt(F),
    }
    return x.astype(np.float32), {k: v.astype(np.float32) for k, v in params.items()}


def place_batch(mesh, x):
    """x with its batch axis sharded over every mesh axis (("data", "expert") or "expert")."""
    return jax.device_put(jnp.asarray(x), NamedSharding(mesh, P(tuple(mesh.axis_names))))


def layer_value_and_grads(layer, x, cotangent, names: Sequence[str]):
    """Jitted y, stats, d/dx and d/d(each parameter in ``names``) of sum(y * cotangent), as
    NumPy (the stats a `uep.MoEStats` of NumPy arrays)."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    @jax.jit
    def step(params, rest, x):
        def loss(params, x):
            y, stats = nnx.merge(graphdef, params, rest)(x)
            return jnp.sum(y * cotangent), (y, stats)

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)

    (_, (y, stats)), (gp, gx) = step(params, rest, x)
    grad_layer = nnx.merge(graphdef, gp, rest)
    grads = {name: np.asarray(getattr(grad_layer, name)[...]) for name in names}
    return np.asarray(y), jax.tree.map(np.asarray, stats), np.asarray(gx), grads


def routed_value_and_grads(fn, x, weights, params, experts, cot):
    """y, and the gradients of sum(y * cot) w.r.t. x, weights and params, of ``fn(x, weights,
    params, experts) -> (y, aux)``, jitted (so the ids are traced, as in training); returns
    (y, aux, gx, gw, gparams) as NumPy (aux and gparams as the trees they are)."""

    def loss(x, weights, params, experts):
        y, aux = fn(x, weights, params, experts)
        return jnp.sum(y * cot), (y, aux)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, (y, aux)), (gx, gw, gp) = grad(x, weights, params, experts)
    return np.asarray(y), jax.tree.map(np.asarray, aux), np.asarray(gx), np.asarray(gw), gp


def fetch_with_grads(mesh, masters: Sequence[np.ndarray], slot_expert, cotangents, **options):
    """The replica transfer of ``masters`` (each [E, ...], split over "expert") to the slots
    ``slot_expert`` [R, S], jitted, and the gradients of sum(fetched * cotangent) w.r.t. the
    masters (``options``: more `transfer.fetch_replica_experts` keywords). Returns (fetched
    [R * S, ...] each, gradients [E, ...] each)."""

    def per_rank(slots_RS, *ws):
        return transfer.fetch_replica_experts(ws, slots_RS, axis_name="expert", **options)

    specs = tuple(P("expert") for _ in masters)
    fetch = jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), *specs), out_specs=specs)

    def loss(*ws):
        got = fetch(jnp.asarray(slot_expert), *ws)
        return sum(jnp.sum(g * c) for g, c in zip(got, cotangents, strict=True)), got

    split = NamedSharding(mesh, P("expert"))
    args = [jax.device_put(w, split) for w in masters]
    argnums = tuple(range(len(masters)))
    (_, got), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(*args)
    return got, grads


def assert_raises_one_line(error, match, fn, *args, **kwargs) -> None:
    """Asserts that ``fn(*args, **kwargs)`` raises ``error`` with one line matching ``match``."""
    with pytest.raises(error, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)


def assert_integer_rule(name: str, fn) -> None:
    """The one rule of an integer argument, here ``fn(value)``'s: TypeError (one line naming the
    argument ``name``) for a bool, a float (even 2.0) or a string; ValueError for an integer below
    the minimum; NumPy integers accepted."""
    for bad in (True, np.bool_(False), 2.0, np.float32(3), "2"):
        assert_raises_one_line(TypeError, rf"^{re.escape(name)} must be an int, got ", fn, bad)
    assert_raises_one_line(
        ValueError, rf"^{re.escape(name)} must be (a positive int|an int >= 0), got -1$", fn, -1
    )
    fn(np.int64(8))  # accepted


#: Whether the default device is a GPU; `needs_gpu` skips a test elsewhere.
ON_GPU = jax.devices()[0].platform == "gpu"
needs_gpu = pytest.mark.skipif(
    not ON_GPU,
    reason=(
        f"needs a GPU (default device platform is {jax.devices()[0].platform!r}; on a GPU machine "
        "set JAX_PLATFORMS=cuda,cpu, since conftest.py defaults it to cpu)"
    ),
)


def random_slots(rng, R, em, S, fill, hot):
    """int32 [R, S]: a valid slot layout (no rank holds an expert twice, none holds its own
    master), ``hot`` experts much more likely than the rest."""
    E = R * em
    weights = np.ones(E)
    weights[rng.choice(E, size=min(hot, E), replace=False)] = 30.0
    slots = np.full((R, S), -1, np.int32)
    for t in range(R):
        allowed = np.ones(E, bool)
        allowed[t * em : (t + 1) * em] = False
        for s in range(S):
            if rng.random() < fill and allowed.any():
                p = weights * allowed
                e = rng.choice(E, p=p / p.sum())
                slots[t, s], allowed[e] = e, False
    return slots


def padded_exchange(monkeypatch):
    """Runs the ragged path's exchanges (the token exchange, the transfer's exchanged hops)
    through the padded exchange (XLA:CPU has no ragged all-to-all), so that the ragged path's
    layout and indexing are checked here."""
    real = comm.exchange_by_backend

    def exchange(operand, ex, *, axis_name, backend="auto"):
        return real(operand, ex, axis_name=axis_name, backend="padded")

    monkeypatch.setattr(comm, "exchange_by_backend", exchange)
    # The resolver refuses "ragged" on CPU devices; here its exchanges run the padded way.
    ragged, padded = resolve.CANDIDATES["comm_backend"]
    anywhere = dataclasses.replace(ragged, supported=lambda platform, facts: True)
    monkeypatch.setitem(resolve.CANDIDATES, "comm_backend", (anywhere, padded))
