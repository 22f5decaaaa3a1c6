"""The layer as a drop-in for other codebases: the per-shard core inside a user's `shard_map`,
`routed_experts` and `MoE`, on meshes with data, EP and tensor ("model") axes, Explicit and Auto
axis types, with padding masks, in float32 and bfloat16, with SwiGLU and GeGLU experts: values
and gradients against the dense one-device reference (tests/references/moe.py) with the masked
tokens left out, and y's sharding equal to x's.

The cases cover every pair of levels of the six factors (entry point, mesh, axis type, mask,
dtype, activation) at least once (`_pairwise_cases`: 9 cases, the fewest that can), rather than
their full product: each case compiles a forward and backward pass, and the full product is 216
compilations.
"""

from __future__ import annotations

import itertools
import math
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from tests import helpers
from tests.helpers import set_param
from tests.references.moe import reference_moe
from ultraep_jax.planning import planner as _planner

D, F, E, K = 16, 8, 8, 2
B, L = 8, 6  # 48 tokens: 6 per device on 8 token devices, 12 on 4 (with a "model" axis)

#: The meshes the cases run on: the standard two (tests/helpers.py) and a third axis the layer
#: leaves to the user (name -> (shape, axis names)).
EXTRA_MESHES = {"dp2ep2tp2": ((2, 2, 2), ("data", "expert", "model"))}
MESHES = (*helpers.MESH_KINDS, *EXTRA_MESHES)
FACTORS = {
    "entry": ("local", "routed", "layer"),
    "mesh": MESHES,
    "axes": ("explicit", "auto"),
    "mask": ("none", "random", "all"),
    "dtype": ("float32", "bfloat16"),
    "activation": ("silu", "gelu"),
}


def _pairs(case: dict) -> set:
    """The pairs of (factor, level) that ``case`` covers."""
    return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(case, 2)}


def _greedy_cover(rng: random.Random) -> list[dict]:
    """Factor assignments covering every pair of levels of any two factors: each new case covers
    the most pairs not yet covered, ties broken by ``rng``."""
    names = list(FACTORS)
    combos = [
        dict(zip(names, c, strict=True)) for c in itertools.product(*(FACTORS[n] for n in names))
    ]
    covers = [_pairs(c) for c in combos]
    wanted = set().union(*covers)
    cases = []
    while wanted:
        gains = [len(c & wanted) for c in covers]
        i = rng.choice([i for i, g in enumerate(gains) if g == max(gains)])
        cases.append(combos[i])
        wanted -= covers[i]
    return cases


def _pairwise_cases() -> list[dict]:
    """The shortest list found of factor assignments in which every pair of levels of any two
    factors occurs: `_greedy_cover` at seeds 0, 1, ... until a list reaches the lower bound, the
    product of the two largest level counts (9 here, found at seed 6; at most 100 seeds, the
    shortest kept; deterministic). The greedy without ties broken at random made 12 cases."""
    sizes = sorted(len(levels) for levels in FACTORS.values())
    bound = sizes[-1] * sizes[-2]
    best = None
    for seed in range(100):
        cases = _greedy_cover(random.Random(seed))
        if best is None or len(cases) < len(best):
            best = cases
        if len(best) <= bound:
            break
    return best


CASES = _pairwise_cases()


def _mesh(name: str, axes: str):
    """The mesh ``name`` of `MESHES`, its axes Explicit (as `jax.make_mesh` gives them) or Auto."""
    if name in helpers.MESH_KINDS:
        mesh = helpers.make_mesh(name)
    else:
        mesh = jax.make_mesh(*EXTRA_MESHES[name])
    return mesh if axes == "explicit" else helpers.auto_axes(mesh)


def _draw(seed: int, dtype):
    """x [B, L, D], router kernel [D, E], (w_gate, w_up, w_down), each choice's ids and weights
    (a skewed routing: most pairs to experts 0 and 1), and a cotangent for y."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, L, D))
    router = rng.normal(size=(D, E))
    router[:, :2] += 2.0 * x.mean(axis=(0, 1))[:, None]
    params = (
        rng.normal(size=(E, D, F)) / math.sqrt(D),
        rng.normal(size=(E, D, F)) / math.sqrt(D),
        rng.normal(size=(E, F, D)) / math.sqrt(F),
    )
    ids = np.where(
        rng.random((B, L, K)) < 0.6, rng.integers(0, 2, (B, L, K)), rng.integers(0, E, (B, L, K))
    )
    ids[..., 1] = np.where(ids[..., 1] == ids[..., 0], (ids[..., 0] + 1) % E, ids[..., 1])
    weights = rng.random((B, L, K))
    cot = rng.normal(size=(B, L, D))
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return (
        cast(x),
        jnp.asarray(router, jnp.float32),
        tuple(cast(w) for w in params),
        jnp.asarray(ids, jnp.int32),
        jnp.asarray(weights, jnp.float32),
        jnp.asarray(cot, jnp.float32),
    )


def _mask(kind: str, seed: int):
    if kind == "none":
        return None
    if kind == "all":
        return jnp.zeros((B, L), bool)
    return jnp.asarray(np.random.default_rng(seed + 7).random((B, L)) < 0.7)


def _ep(mesh, activation, **kw):
    balancer = uep.BalancerConfig(slots_per_rank=1, min_tokens_per_replica=1, min_tokens_per_rank=0)
    return uep.ExpertParallel(mesh, E, balancer, capacity_factor=None, activation=activation, **kw)


def _put(mesh, ep, x, ids, weights, params, mask):
    """The arrays placed as a user would: tokens split over the token axes on the batch axis,
    expert weights over the EP axis."""
    tok = NamedSharding(mesh, P(ep.token_axes))
    experts = NamedSharding(mesh, ep.expert_spec)
    put = jax.device_put
    return (
        put(x, tok),
        put(ids, tok),
        put(weights, tok),
        tuple(put(w, experts) for w in params),
        None if mask is None else put(mask, tok),
    )


def _user_shard_map(mesh, ep):
    """A user's own EP layer: their `shard_map`, our per-shard core inside."""
    tok, experts = P(ep.token_axes), ep.expert_spec

    def per_shard(x, ids, weights, mask, *params):
        return uep.routed_experts_local(x, ids, weights, params, ep, mask)

    def run(x, ids, weights, params, mask):
        mask_spec = tok if mask is not None else None
        return jax.shard_map(
            per_shard,
            mesh=mesh,
            in_specs=(tok, tok, tok, mask_spec, experts, experts, experts),
            out_specs=(tok, P()),
        )(x, ids, weights, mask, *params)

    return run


def _assert_close(actual, desired, dtype: str) -> None:
    """Elementwise in float32; in bfloat16 (8 significant bits, rounded at every matmul) the
    relative error of the whole array, which elementwise bounds cannot state for values near 0."""
    if dtype == "bfloat16":
        err = np.linalg.norm(actual - desired) / max(np.linalg.norm(desired), 1e-30)
        assert err < 1.5e-2, err
    else:
        np.testing.assert_allclose(actual, desired, atol=2e-5, rtol=2e-5)


@pytest.mark.slow  # a forward and backward compilation per case
@pytest.mark.parametrize("case", CASES, ids=["-".join(c.values()) for c in CASES])
def test_values_gradients_and_sharding_equal_dense_reference(case):
    dtype = jnp.dtype(case["dtype"])
    mesh = _mesh(case["mesh"], case["axes"])
    ep = _ep(mesh, case["activation"])
    x, router, params, ids, weights, cot = _draw(CASES.index(case), dtype)
    mask = _mask(case["mask"], 3)
    host_args = jax.device_get((x, ids, weights, params, mask))
    x, ids, weights, params, mask = _put(mesh, ep, x, ids, weights, params, mask)

    names = ("w_gate", "w_up", "w_down")
    if case["entry"] == "layer":
        layer = uep.MoE(
            D,
            F,
            E,
            K,
            mesh,
            ep.balancer,
            None,
            activation=case["activation"],
            param_dtype=dtype,
            rngs=nnx.Rngs(0),
        )
        set_param(layer.router_kernel, np.asarray(router))
        for name, w in zip(names, host_args[3], strict=True):
            set_param(getattr(layer, name), w)
        graphdef, state, rest = nnx.split(layer, nnx.Param, ...)
        params = state

        def loss(x, weights_unused, state):
            y, stats = nnx.merge(graphdef, state, rest)(x, mask)
            return jnp.sum(y.astype(jnp.float32) * cot), (y, stats)

    else:
        run = (
            _user_shard_map(mesh, ep)
            if case["entry"] == "local"
            else (lambda x, i, w, p, m: uep.routed_experts(x, i, w, p, ep, m))
        )

        def loss(x, weights, params):
            y, stats = run(x, ids, weights, params, mask)
            return jnp.sum(y.astype(jnp.float32) * cot), (y, stats)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, (y, stats)), (gx, gw, gp) = grad(x, weights, params)
    if case["entry"] == "layer":
        grads = nnx.merge(graphdef, gp, rest)
        gp = tuple(getattr(grads, name)[...] for name in names)

    x_h, ids_h, weights_h, params_h, mask_h = host_args

    def ref_loss(x, weights, params):
        ids = ids_h
        if case["entry"] == "layer":  # the layer's own router, on the same x
            routing = uep.SoftmaxTopK(K)(x.reshape(-1, D).astype(jnp.float32) @ router)
            ids, weights = (a.reshape(B, L, K) for a in (routing.experts, routing.weights))
        y = reference_moe(x, ids, weights, params, mask=mask_h, activation=case["activation"])
        return jnp.sum(y * cot), y

    ref_grad = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1, 2), has_aux=True))
    host = lambda a: np.asarray(jax.device_get(a), np.float32)  # noqa: E731
    (_, y_ref), (gx_ref, gw_ref, gp_ref) = ref_grad(x_h, weights_h, params_h)
    close = lambda a, b: _assert_close(host(a), host(b), case["dtype"])  # noqa: E731
    close(y, y_ref)
    close(gx, gx_ref)
    if case["entry"] != "layer":  # the layer's weights come from its router
        close(gw, gw_ref)
    for g, g_ref in zip(gp, gp_ref, strict=True):
        close(g, g_ref)

    real = B * L if mask is None else int(np.sum(mask_h))
    assert int(stats.masked) == B * L - real
    assert int(np.sum(stats.expert_load)) == K * real
    assert int(stats.dropped) == 0 and int(stats.invalid) == 0
    if mask is not None:
        np.testing.assert_array_equal(host(y)[~mask_h], 0)
        np.testing.assert_array_equal(host(gx)[~mask_h], 0)
    assert y.dtype == x.dtype
    assert y.sharding.is_equivalent_to(x.sharding, y.ndim), (y.sharding, x.sharding)


def _routed_case(mesh, seed=0, dtype=jnp.float32, batch=B, seq=L):
    """Host arrays of one call: x, router, params, ids, weights, cotangent (`_draw`), cut to
    ``batch`` x ``seq`` tokens."""
    x, router, params, ids, weights, cot = _draw(seed, dtype)
    cut = lambda a: a[:batch, :seq]  # noqa: E731
    return cut(x), params, cut(ids), cut(weights), cut(cot)


@pytest.mark.parametrize(
    "shape, names", [((8,), ("data",)), ((8, 1), ("data", "expert"))], ids=["no_ep", "ep1"]
)
def test_mesh_without_ep_axis_runs_local_experts(shape, names):
    """No EP axis (asked for with ``expert_axis=None``) or one of size 1: every device runs every
    expert on its own tokens; no plan, no exchange; values and gradients equal the dense
    reference."""
    mesh = jax.make_mesh(shape, names)
    ep = _ep(mesh, "silu", **({} if "expert" in names else {"expert_axis": None}))
    assert ep.ep_size == 1 and ep.active_balancer is None
    x, params, ids, weights, cot = _routed_case(mesh)
    mask = _mask("random", 1)

    def loss(x, params):
        y, stats = uep.routed_experts(x, ids, weights, params, ep, mask)
        return jnp.sum(y * cot), (y, stats)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, (y, stats)), (gx, gp) = grad(x, params)

    def ref_loss(x, params):
        y = reference_moe(x, ids, weights, params, mask=mask, activation="silu")
        return jnp.sum(y * cot), y

    ref_grad = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1), has_aux=True))
    (_, y_ref), (gx_ref, gp_ref) = ref_grad(x, params)
    for a, b in [(y, y_ref), (gx, gx_ref), *zip(gp, gp_ref, strict=True)]:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)
    want = np.bincount(np.asarray(ids)[np.asarray(mask)].ravel(), minlength=E)
    np.testing.assert_array_equal(stats.expert_load, want)
    hlo = jax.jit(loss).lower(x, params).as_text()
    assert "ultraep_plan" not in hlo and "all_to_all" not in hlo


def test_token_count_not_divisible_by_devices_is_padded(ep8_mesh):
    """15 tokens on 8 devices: padded with masked tokens, which no stat counts."""
    ep = _ep(ep8_mesh, "silu")
    x, params, ids, weights, _ = _routed_case(ep8_mesh, batch=3, seq=5)
    y, stats = uep.routed_experts(x, ids, weights, params, ep)
    y_ref = reference_moe(x, ids, weights, params, activation="silu")
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=2e-5, rtol=2e-5)
    assert int(stats.masked) == 0 and int(np.sum(stats.expert_load)) == 15 * K


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_masked_tokens_may_hold_any_id(jit, ep8_mesh):
    """Padding tokens' ids are never looked at: -1 or E at masked tokens neither raises eagerly
    nor counts as invalid under jit, and their weights (even NaN) reach nothing."""
    ep = _ep(ep8_mesh, "gelu")
    x, params, ids, weights, _ = _routed_case(ep8_mesh)
    mask = _mask("random", 2)
    garbage_ids = jnp.where(mask[..., None], ids, jnp.where(jnp.arange(K) == 0, -1, E))
    nan_weights = jnp.where(mask[..., None], weights, jnp.nan)
    call = lambda *a: uep.routed_experts(*a, ep, mask)  # noqa: E731
    y, stats = (jax.jit(call) if jit else call)(x, garbage_ids, nan_weights, params)
    y_ref = reference_moe(x, ids, weights, params, mask=mask, activation="gelu")
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=2e-5, rtol=2e-5)
    assert int(stats.invalid) == 0 and int(stats.masked) == int(np.sum(~np.asarray(mask)))


def _count_calls(jaxpr, want) -> int:
    """Equations for which ``want(eqn)`` holds in ``jaxpr``, counting each call site of a nested
    jaxpr (jit, shard_map, checkpoint, cond branches) as often as it is called."""
    total = 0
    for eqn in jaxpr.eqns:
        if want(eqn):
            total += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    total += _count_calls(sub.jaxpr, want)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    total += _count_calls(sub, want)
    return total


def _gradient_counts(fn, *args) -> tuple[int, int]:
    """(planner calls, all-to-alls) in the program of ``fn``'s gradient, as JAX emits it: the
    planner is one primitive until lowering picks the platform's (`planning.planner`), or the FFI
    call where the native planner is named."""
    jaxpr = jax.make_jaxpr(jax.grad(fn, argnums=(0, 1)))(*args).jaxpr
    plans = _count_calls(
        jaxpr,
        lambda e: (
            e.primitive is _planner.PLAN_PRIMITIVE or e.params.get("target_name") == "ultraep_plan"
        ),
    )
    a2a = _count_calls(jaxpr, lambda e: e.primitive.name == "all_to_all")
    return plans, a2a


def test_remat_policy_keeps_plan_and_exchanges(ep8_mesh):
    """With ``save_only_these_names(*uep.remat.NAMES)`` the backward pass reuses the plan and the
    exchanged rows: one planner call per layer (two when nothing is saved) and fewer
    all-to-alls."""
    ep = _ep(ep8_mesh, "silu")
    x, params, ids, weights, cot = _routed_case(ep8_mesh)

    def layers(x, params):  # two layers of different routing (XLA would merge equal plans)
        y, _ = uep.routed_experts(x, ids, weights, params, ep)
        y, _ = uep.routed_experts(y, (ids + 1) % E, weights, params, ep)
        return jnp.sum(y * cot)

    kept = jax.checkpoint(
        layers, policy=jax.checkpoint_policies.save_only_these_names(*uep.remat.NAMES)
    )
    none = jax.checkpoint(layers, policy=jax.checkpoint_policies.nothing_saveable)
    plans_kept, a2a_kept = _gradient_counts(kept, x, params)
    plans_none, a2a_none = _gradient_counts(none, x, params)
    assert plans_kept == 2, plans_kept
    assert plans_none == 4, plans_none
    assert a2a_kept < a2a_none, (a2a_kept, a2a_none)
