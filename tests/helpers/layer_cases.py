"""The MoE layer cases several test files run: the layer at small widths on the 8 simulated
devices, its inputs drawn with a clear routing margin, its values and gradients and those of the
dense one-device reference (tests/references), the cached results of `CASES`, and what its
lowering is checked for. Used by tests/library/test_moe.py (whose test process computes the
cached cases: pytest-xdist group "test_moe") and the files that run the same layer."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ultraep_jax as uep
from tests import helpers
from tests.helpers import make_mesh, place_batch
from tests.references.layer import reference_layer
from tests.references.routing import Router, select_experts

D, F = 8, 16

RTOL = 1e-4
ATOL = 1e-5
PARAM_NAMES = ("router_kernel", "w_gate", "w_up", "w_down")


# -- the reference: routing and the dense one-device MoE (tests/references) ----------------


def reference_experts(x, router_kernel, top_k):
    """(experts int [T, k], margin): the softmax top-k choice of the reference router from
    float64 logits, tokens flattened in (batch, seq) order, and its smallest logit margin."""
    logits = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    logits = logits @ np.asarray(router_kernel, np.float64)
    return select_experts(logits, Router("softmax", top_k))


def reference_value_and_grads(x, params, cotangent, top_k):
    """y and the gradients of sum(y * cotangent) w.r.t. x and every parameter (a dict), the
    experts chosen by `reference_experts`."""
    experts, _ = reference_experts(x, params["router_kernel"], top_k)
    return _reference_value_and_grads(x, params, jnp.asarray(experts), cotangent)


@jax.jit
def _reference_value_and_grads(x, params, experts, cotangent):
    def loss(x, params):
        y = reference_layer(x, params, experts, Router("softmax", experts.shape[-1]))
        return jnp.sum(y * cotangent), y

    (_, y), (gx, gp) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
    return y, gx, gp


# -- building and running the layer ------------------------------------------------------------


def mesh_groups(mesh) -> tuple[int, int]:
    """(G, R): independent EP groups (the "data" size, 1 without it) and the EP size."""
    return mesh.shape.get("data", 1), mesh.shape["expert"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One layer configuration and input distribution."""

    mesh: str
    num_experts: int
    top_k: int
    batch: int
    seq: int
    slots: int
    skew: bool
    seed: int

    @property
    def id(self) -> str:
        kind = "skew" if self.skew else "uniform"
        return (
            f"{self.mesh}-E{self.num_experts}-k{self.top_k}-b{self.batch}x{self.seq}"
            f"-S{self.slots}-{kind}"
        )


def balancer_config(mesh, num_experts, slots, **kwargs) -> uep.BalancerConfig:
    """A balancer for this mesh that replicates readily (tiny token floor) and balances at the
    tests' few tokens per rank (no fallback)."""
    kwargs.setdefault("min_tokens_per_replica", 2)
    kwargs.setdefault("min_tokens_per_rank", 0)
    return uep.BalancerConfig(
        num_experts=num_experts, ep_size=mesh.shape["expert"], slots_per_rank=slots, **kwargs
    )


def make_inputs(rng, batch, seq, num_experts, top_k, skew, hot=(0, 1)):
    """x [batch, seq, D] and parameter values of this file's widths (`helpers.draw_routed_inputs`),
    drawn again until every token's top-k choice has a clear logit margin."""
    for _ in range(50):
        x, params = helpers.draw_routed_inputs(rng, batch, seq, D, F, num_experts, skew, hot)
        if reference_experts(x, params["router_kernel"], top_k)[1] > 1e-3:
            return x, params
    raise AssertionError("could not draw inputs with a clear routing margin")


def build_layer(mesh, num_experts, top_k, balancer, capacity_factor, params=None, **options):
    """uep.MoE of this file's widths with the values of ``params`` (PARAM_NAMES) written in, if
    given (``options``: more `uep.MoE` keywords, such as ``comm_backend``)."""
    return helpers.build_layer(
        mesh,
        None if params is None else {name: params[name] for name in PARAM_NAMES},
        d_model=D,
        d_ff=F,
        num_experts=num_experts,
        top_k=top_k,
        balancer=balancer,
        capacity_factor=capacity_factor,
        **options,
    )


def to_numpy_stats(stats) -> dict:
    """MoEStats as a dict of NumPy arrays."""
    return {f.name: np.asarray(getattr(stats, f.name)) for f in dataclasses.fields(stats)}


def layer_forward(layer, x):
    """Jitted forward of the layer as a pure function of its split state: (y, stats)."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    @jax.jit
    def fwd(params, rest, x):
        return nnx.merge(graphdef, params, rest)(x)

    y, stats = fwd(params, rest, x)
    return np.asarray(y), to_numpy_stats(stats)


def layer_value_and_grads(layer, x, cotangent):
    """Jitted y, stats (a dict) and the gradients of sum(y * cotangent) w.r.t. x and every
    parameter."""
    y, stats, gx, grads = helpers.layer_value_and_grads(layer, x, cotangent, PARAM_NAMES)
    return y, to_numpy_stats(stats), gx, grads


def independent_loads(x, router_kernel, top_k, mesh, num_experts):
    """int [G, R, E] (token, choice) pairs per EP group, source rank and expert, from the
    reference routing; device (g, r) holds the g*R + r-th slice of the batch."""
    G, R = mesh_groups(mesh)
    idx, _ = reference_experts(x, router_kernel, top_k)
    idx = idx.reshape(G, R, -1)
    loads = np.zeros((G, R, num_experts), np.int64)
    for g, r in itertools.product(range(G), range(R)):
        loads[g, r] = np.bincount(idx[g, r], minlength=num_experts)
    return loads


def rank_loads(loads):
    """[G, R] pairs received by each EP rank's masters, from [G, R_src, E] loads."""
    G, R, E = loads.shape
    return loads.sum(axis=1).reshape(G, R, E // R).sum(axis=-1)


def group_imbalance(rank_load) -> float:
    """max over groups of max/mean rank load."""
    rank_load = np.asarray(rank_load, np.float64)
    return float(np.max(rank_load.max(axis=-1) / rank_load.mean(axis=-1)))


def assert_close(got, want, what, rtol=RTOL, atol=ATOL):
    """float32-tolerance comparison, absolute tolerance scaled to the reference's magnitude."""
    want = np.asarray(want)
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * scale, err_msg=what)


# -- dropless: output and gradients ---------------------------------------------------------

CASES = [
    Case("ep8", 8, 1, 8, 8, slots=2, skew=True, seed=0),
    Case("ep8", 16, 2, 16, 8, slots=1, skew=False, seed=1),
    Case("dp2ep4", 8, 2, 8, 12, slots=2, skew=True, seed=3),
    Case("dp2ep4", 8, 3, 16, 4, slots=1, skew=False, seed=4),
]
SKEWED = [c for c in CASES if c.skew]


@functools.cache
def run_case(case: Case) -> dict:
    """Balanced and unbalanced (dropless) layer results and the reference, as NumPy."""
    rng = np.random.default_rng(case.seed)
    mesh = make_mesh(case.mesh)
    x, params = make_inputs(rng, case.batch, case.seq, case.num_experts, case.top_k, case.skew)
    cotangent = rng.normal(size=x.shape).astype(np.float32)
    ref_y, ref_gx, ref_gp = reference_value_and_grads(
        jnp.asarray(x), {k: jnp.asarray(v) for k, v in params.items()}, cotangent, case.top_k
    )
    out = {
        "x": x,
        "params": params,
        "cotangent": cotangent,
        "ref": (
            np.asarray(ref_y),
            np.asarray(ref_gx),
            {k: np.asarray(v) for k, v in ref_gp.items()},
        ),
        "loads": independent_loads(x, params["router_kernel"], case.top_k, mesh, case.num_experts),
    }
    balancer = balancer_config(mesh, case.num_experts, case.slots)
    for key, bal in (("balanced", balancer), ("plain", None)):
        layer = build_layer(mesh, case.num_experts, case.top_k, bal, None, params)
        out[key] = layer_value_and_grads(layer, place_batch(mesh, x), jnp.asarray(cotangent))
    out["balancer"] = balancer
    return out


# -- lowering ------------------------------------------------------------------------------


RAGGED_OP = re.compile(r"custom_call\s*@ragged_all_to_all\b")


def pure_forward(layer):
    """(fn(params, rest, x) -> (y, stats), params, rest) for lowering and export."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def fn(params, rest, x):
        return nnx.merge(graphdef, params, rest)(x)

    return fn, params, rest
