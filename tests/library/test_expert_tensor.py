"""Expert tensor parallelism (`ExpertParallel(tensor_axis=...)`): each expert's hidden width F split
over a tensor axis beside the EP axis, plain and balanced, against the dense one-device reference.

The meshes: (expert 4, tensor 2) and (data 2, expert 2, tensor 2) of the 8 simulated CPU devices,
with Explicit axes (as `jax.make_mesh` gives them) or Auto. Every variant is one compiled
value-and-gradient program (seconds each on a 2-core machine), so the default run takes a few
variants that together cover each mesh, each axis type, plain, balanced, relays (``max_fanout`` 1
and 2 through the ragged transfer) and the streamed transfer (``transfer_chunks=2``); the rest of
the cases, marked slow, run every variant on each mesh where it runs code of its own ("relay1"
on ep4tp2 only: dp2ep2tp2's 2 EP ranks make the same one-hop schedule at every f). The axis
types change only how the layer places its inputs and weights around the shard_map, not what
runs inside it, so each variant runs with one axis type per mesh, the two meshes taking
different ones.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from tests import helpers
from tests.helpers import layer_cases, padded_exchange
from tests.references.moe import reference_moe
from tests.references.relay import reference_schedule, reference_send_copies

# One test process computes the cases it caches (pytest-xdist).
pytestmark = pytest.mark.xdist_group("test_expert_tensor")

#: The meshes by name: (axis sizes, axis names).
MESHES = {
    "ep4tp2": ((4, 2), ("expert", "tensor")),
    "dp2ep2tp2": ((2, 2, 2), ("data", "expert", "tensor")),
}
TP = 2
E, TOP_K, BATCH, SEQ, SLOTS = 8, 2, 8, 8, 2

#: Variant -> (balanced, max_fanout, comm_backend, transfer_chunks). "relay1" and "chunks2" run the
#: ragged transfer (its hops through the padded exchange: XLA:CPU has no ragged all-to-all),
#: which follows the relay schedule; the padded (dense) transfer sends every copy from the master.
VARIANTS = {
    "plain": (False, 2, None, 1),
    "balanced": (True, 2, None, 1),
    "relay1": (True, 1, "ragged", 1),
    "chunks2": (True, 2, "ragged", 2),
}


def make_mesh(kind: str, axis_types: str) -> Mesh:
    """The mesh ``kind`` of `MESHES` with Explicit or Auto axes."""
    shape, names = MESHES[kind]
    types = (AxisType.Explicit if axis_types == "explicit" else AxisType.Auto,) * len(names)
    return jax.make_mesh(shape, names, axis_types=types)


@dataclasses.dataclass(frozen=True)
class Case:
    mesh: str
    axis_types: str
    variant: str

    @property
    def id(self) -> str:
        return f"{self.mesh}-{self.axis_types}-{self.variant}"


FAST = [
    Case("ep4tp2", "explicit", "plain"),
    Case("ep4tp2", "explicit", "balanced"),
    Case("ep4tp2", "auto", "relay1"),
    Case("dp2ep2tp2", "auto", "plain"),
    Case("dp2ep2tp2", "auto", "balanced"),
    Case("dp2ep2tp2", "explicit", "chunks2"),
]
# Each variant on each mesh, the two meshes with opposite axis types: the rest of the product of
# meshes, axis types and variants repeats a variant's program on a mesh with the other axis type
# only. The ragged transfer at f = 2 runs in "chunks2" on both meshes: each chunk's transfer
# follows the relay schedule as an unstreamed one would, so an unstreamed case at f = 2 ("relay2"
# on each mesh, here before) runs no code "chunks2" misses; on dp2ep2tp2's 2 EP ranks every f
# makes the same one-hop schedule, so "relay1" there (before) repeated "chunks2" too.
SLOW = [
    Case("ep4tp2", "auto", "chunks2"),
]
MATRIX = [pytest.param(c, id=c.id) for c in FAST] + [
    pytest.param(c, id=c.id, marks=pytest.mark.slow) for c in SLOW
]


@functools.cache
def inputs(seed: int = 0):
    """x, parameter values, a cotangent, and the dense reference's y and gradients."""
    rng = np.random.default_rng(seed)
    x, params = layer_cases.make_inputs(rng, BATCH, SEQ, E, TOP_K, skew=True)
    cot = rng.normal(size=x.shape).astype(np.float32)
    ref = layer_cases.reference_value_and_grads(
        jnp.asarray(x), {n: jnp.asarray(v) for n, v in params.items()}, cot, TOP_K
    )
    return x, params, cot, jax.tree.map(np.asarray, ref)


def run(case: Case):
    """The layer of ``case`` on `inputs`: (y, stats, d/dx, d/dparams) as NumPy, its mesh and
    balancer. A ragged variant needs `padded_exchange` patched in first."""
    balanced, fanout, backend, chunks = VARIANTS[case.variant]
    mesh = make_mesh(case.mesh, case.axis_types)
    x, params, cot, _ = inputs()
    balancer = layer_cases.balancer_config(mesh, E, SLOTS, max_fanout=fanout) if balanced else None
    options = {"transfer_chunks": chunks, "tensor_axis": "tensor"}
    if backend is not None:
        options["comm_backend"] = backend
    layer = layer_cases.build_layer(mesh, E, TOP_K, balancer, None, params, **options)
    assert layer.w_gate[...].sharding.spec == P("expert", None, "tensor")
    assert layer.w_down[...].sharding.spec == P("expert", "tensor", None)
    got = layer_cases.layer_value_and_grads(
        layer, layer_cases.place_batch(mesh, x), jnp.asarray(cot)
    )
    return got, mesh, balancer


def reference_transfer(mesh, balancer) -> tuple[float, int]:
    """(bytes, hops) of the replica transfer by the reference schedule: the largest per-rank
    send, in copies of one tensor rank's slices (w_gate, w_up, w_down: 3 * D * F / TP float32
    each), and the deepest relay hop, worst group."""
    x, params, _, _ = inputs()
    G, R = layer_cases.mesh_groups(mesh)
    loads = layer_cases.independent_loads(x, params["router_kernel"], TOP_K, mesh, E)
    copies = hops = 0
    for g in range(G):
        slots = np.asarray(uep.plan(loads[g].astype(np.int32), balancer).slot_expert)
        sent = reference_send_copies(slots, E // R, balancer.max_fanout)
        copies = max(copies, int(sent.max()))
        hops = max(hops, int(reference_schedule(slots, E // R, balancer.max_fanout)["hop"].max()))
    return float(copies * 3 * layer_cases.D * (layer_cases.F // TP) * 4), hops


@pytest.mark.parametrize("case", MATRIX)
def test_values_and_grads_equal_dense_reference(case, monkeypatch):
    """y and the gradients w.r.t. x, the router and every expert weight equal the dense
    one-device reference; a balanced layer replicates, drops nothing, and each rank sends the
    reference schedule's copies of its own F slice only (bytes per link / TP)."""
    if VARIANTS[case.variant][2] == "ragged":
        padded_exchange(monkeypatch)
    (y, stats, gx, gp), mesh, balancer = run(case)
    ref_y, ref_gx, ref_gp = inputs()[3]
    layer_cases.assert_close(y, ref_y, "y")
    layer_cases.assert_close(gx, ref_gx, "d/dx")
    for name in layer_cases.PARAM_NAMES:
        assert gp[name].shape == ref_gp[name].shape, name
        layer_cases.assert_close(gp[name], ref_gp[name], f"d/d{name}")
    assert int(stats["dropped"]) == 0
    if balancer is None:
        assert int(stats["replicas"]) == 0
        return
    assert int(stats["replicas"]) > 0, "no replica"
    assert stats["imbalance_after"] < stats["imbalance_before"]
    if VARIANTS[case.variant][2] == "ragged":  # the padded transfer sends every copy directly
        send_max, hops = reference_transfer(mesh, balancer)
        assert float(stats["transfer_send_max"]) == send_max
        if case.mesh == "ep4tp2":  # 2 EP ranks (dp2ep2tp2) leave nothing to relay
            assert hops >= 2, "no expert was relayed"


def numpy_sigmoid_aux(x_TD: np.ndarray, kernel_DE: np.ndarray, k: int):
    """(aux loss, d aux / d kernel [D, E]) of `uep.SigmoidTopK(k)` (no bias, no groups) on every
    token, in NumPy: ``E / (k T) * sum_e count_e * mean_t p_te``, ``p`` the sigmoid scores
    normalised per token, ``count`` (no gradient) each expert's chosen pairs."""
    x, w = x_TD.astype(np.float64), kernel_DE.astype(np.float64)
    T, E = x.shape[0], w.shape[1]
    s = 1 / (1 + np.exp(-(x @ w)))
    p = s / s.sum(-1, keepdims=True)
    count = np.bincount(np.argsort(-s, axis=-1)[:, :k].ravel(), minlength=E)
    aux = E / (k * T) * np.sum(count * p.mean(0))
    d_p = np.broadcast_to(E / (k * T * T) * count, p.shape)  # d aux / d p[t, e]
    d_s = (d_p - np.sum(d_p * p, -1, keepdims=True)) / s.sum(-1, keepdims=True)
    return aux, x.T @ (d_s * s * (1 - s))


def test_top1_aux_loss_when_tokens_do_not_divide_the_devices():
    """`SigmoidTopK(1)` on dp2ep2tp2 with 9 tokens over its 4 token devices: the aux loss and
    its router-kernel gradient, computed in the program that also computes the layer's output
    (an eager call; a jitted step that returns y), equal the NumPy reference. The count of the
    aux loss was a scatter-add over the router's choices, which XLA split over the token devices
    padded to 12 rows, the 3 padding rows counted for expert 0."""
    from flax import nnx

    D = 8
    mesh = make_mesh("dp2ep2tp2", "explicit")
    layer = uep.MoE(
        D, 4, E, 1, mesh, router=uep.SigmoidTopK(1), tensor_axis="tensor", rngs=nnx.Rngs(0)
    )
    x = np.random.default_rng(1).normal(size=(1, 9, D)).astype(np.float32)
    want, want_grad = numpy_sigmoid_aux(x.reshape(-1, D), np.asarray(layer.router_kernel[...]), 1)
    np.testing.assert_allclose(float(layer(jnp.asarray(x))[1].aux_loss), want, rtol=1e-5)

    @nnx.jit
    def step(layer, x):
        def loss(layer):
            y, stats = layer(x)
            return stats.aux_loss, y

        return nnx.value_and_grad(loss, has_aux=True)(layer)

    (value, y), grads = step(layer, jnp.asarray(x))
    assert y.shape == x.shape
    np.testing.assert_allclose(float(value), want, rtol=1e-5)
    grad = np.asarray(grads.router_kernel[...])
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-4 * np.abs(want_grad).max())


# -- configuration: specs and one-line errors (nothing compiled) ------------------------------


def test_weight_specs_split_hidden_width_over_tensor_axis():
    mesh = make_mesh("dp2ep2tp2", "auto")
    ep = uep.ExpertParallel(mesh, E, tensor_axis="tensor")
    assert ep.weight_specs == (
        P("expert", None, "tensor"),
        P("expert", None, "tensor"),
        P("expert", "tensor", None),
    )
    assert ep.token_axes == ("data", "expert") and ep.tensor_size == TP
    assert ep.local_d_ff(16) == 8


def test_without_tensor_axis_weights_stay_whole():
    mesh = make_mesh("dp2ep2tp2", "auto")
    ep = uep.ExpertParallel(mesh, E)
    assert ep.tensor_axis is None and ep.tensor_size == 1
    assert ep.weight_specs == (ep.expert_spec,) * 3 == (P("expert"),) * 3
    assert ep.token_axes == ("data", "expert")  # "tensor" left out by name, as before


def test_tensor_axis_of_any_name_is_no_token_axis():
    mesh = jax.make_mesh((4, 2), ("expert", "shard"), axis_types=(AxisType.Auto,) * 2)
    assert uep.ExpertParallel(mesh, E).token_axes == ("expert", "shard")
    assert uep.ExpertParallel(mesh, E, tensor_axis="shard").token_axes == ("expert",)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tensor_axis": "tp"}, r"the mesh has no axis 'tp' .* for tensor_axis"),
        ({"tensor_axis": "expert"}, r"tensor_axis 'expert' is also the EP axis"),
        (
            {"tensor_axis": "tensor", "token_axes": ("expert", "tensor")},
            r"token_axes .* include the tensor_axis 'tensor'",
        ),
        ({"tensor_axis": 1}, r"tensor_axis must be a str or None"),
    ],
)
def test_bad_tensor_axis_raises_one_line(kwargs, match):
    mesh = make_mesh("ep4tp2", "auto")
    with pytest.raises((ValueError, TypeError), match=match) as err:
        uep.ExpertParallel(mesh, E, **kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "d_ff, chunks, match",
    [
        (15, 1, r"MoE: d_ff=15 is not divisible by the size 2 of the tensor axis 'tensor'"),
        (4, 3, r"MoE: transfer_chunks=3 exceeds d_ff=2"),
    ],
)
def test_bad_hidden_width_raises_one_line(d_ff, chunks, match):
    """F must split evenly over the tensor ranks, and a transfer chunk is at least one of a
    tensor rank's columns."""
    from flax import nnx

    with pytest.raises(ValueError, match=match) as err:
        uep.MoE(
            8,
            d_ff,
            E,
            TOP_K,
            make_mesh("ep4tp2", "auto"),
            tensor_axis="tensor",
            transfer_chunks=chunks,
            rngs=nnx.Rngs(0),
        )
    assert "\n" not in str(err.value)


def test_routed_experts_rejects_hidden_width_not_divisible():
    mesh = make_mesh("ep4tp2", "auto")
    ep = uep.ExpertParallel(mesh, E, tensor_axis="tensor")
    x = jnp.zeros((8, 4, 8), jnp.float32)
    ids = jnp.zeros((8, 4, TOP_K), jnp.int32)
    w = jnp.zeros((8, 4, TOP_K), jnp.float32)
    params = (jnp.zeros((E, 8, 5)), jnp.zeros((E, 8, 5)), jnp.zeros((E, 5, 8)))
    with pytest.raises(ValueError, match=r"routed_experts: d_ff=5 is not divisible by the size 2"):
        uep.routed_experts(x, ids, w, params, ep)


# -- a user's own shard_map around the per-device core -----------------------------------------


def _users_layer(mesh, ep):
    """``routed_experts_local`` in the user's `shard_map`: tokens over ``ep.token_axes``, the
    weights by ``ep.weight_specs``."""
    tok = P(ep.token_axes)

    def per_shard(x, ids, weights, *params):
        return uep.routed_experts_local(x, ids, weights, params, ep)

    def run(x, weights, params, ids):
        return jax.shard_map(
            per_shard,
            mesh=mesh,
            in_specs=(tok, tok, tok, *ep.weight_specs),
            out_specs=(tok, P()),
        )(x, ids, weights, *params)

    return run


def test_users_shard_map_with_tensor_axis_equals_dense_reference():
    """Balanced, on (data 2, expert 2, tensor 2), ids skewed to expert 0: y and the gradients
    w.r.t. x, the routing weights and every expert weight equal `reference_moe`'s."""
    mesh = make_mesh("dp2ep2tp2", "auto")
    balancer = uep.BalancerConfig(slots_per_rank=1, min_tokens_per_replica=1, min_tokens_per_rank=0)
    ep = uep.ExpertParallel(mesh, E, balancer, None, tensor_axis="tensor")
    rng = np.random.default_rng(5)
    T, D, F = 32, layer_cases.D, layer_cases.F
    x = rng.normal(size=(T, D)).astype(np.float32)
    ids = np.stack([np.zeros(T, int), rng.integers(1, E, T)], axis=1).astype(np.int32)
    weights = rng.random((T, TOP_K)).astype(np.float32)
    params = tuple(
        (rng.normal(size=s) / np.sqrt(s[1])).astype(np.float32)
        for s in ((E, D, F), (E, D, F), (E, F, D))
    )
    cot = rng.normal(size=(T, D)).astype(np.float32)
    y, stats, gx, gw, gp = helpers.routed_value_and_grads(
        _users_layer(mesh, ep), x, weights, params, ids, cot
    )

    def ref(x, weights, params, ids):
        return reference_moe(x, ids, weights, params), None

    ry, _, rgx, rgw, rgp = helpers.routed_value_and_grads(ref, x, weights, params, ids, cot)
    assert int(stats.replicas) > 0, "no replica"
    layer_cases.assert_close(y, ry, "y")
    layer_cases.assert_close(gx, rgx, "d/dx")
    layer_cases.assert_close(gw, rgw, "d/dweights")
    for name, g, r in zip(("w_gate", "w_up", "w_down"), gp, rgp, strict=True):
        layer_cases.assert_close(np.asarray(g), np.asarray(r), f"d/d{name}")


def test_shard_map_over_another_tensor_size_raises_one_line():
    """A configuration for 2 tensor ranks, called in a shard_map whose tensor axis has 1."""
    ep = uep.ExpertParallel(make_mesh("ep4tp2", "auto"), E, tensor_axis="tensor")
    small = jax.make_mesh(
        (4, 1), ("expert", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4]
    )
    x = jnp.zeros((16, layer_cases.D), jnp.float32)
    ids = jnp.zeros((16, TOP_K), jnp.int32)
    params = (
        jnp.zeros((E, layer_cases.D, 8)),
        jnp.zeros((E, layer_cases.D, 8)),
        jnp.zeros((E, 8, layer_cases.D)),
    )
    with pytest.raises(ValueError, match=r"axis 'tensor' has 1 devices, the ExpertParallel's"):
        jax.jit(_users_layer(small, ep))(x, jnp.ones((16, TOP_K)), params, ids)
