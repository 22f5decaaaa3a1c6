"""What tests/library/test_divergent_plans.py and its two-process worker share: the cases
in which the EP groups of different data (or FSDP) rows get different plans, their inputs,
the per-group plans of the reference routing, and the layer run on each mesh (that file's
docstring says what each case is)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from tests import helpers
from tests.helpers import layer_cases as lc
from tests.helpers.ragged_emulation import emulated_ragged_all_to_all
from ultraep_jax.replicas import relay

E, K, S = 8, 2, 2
GROUPS, EP = 2, 4
BATCH, SEQ = 8, 8  # one batch row (8 tokens) per device; group g holds rows 4g .. 4g + 3
HOT = (0, 1)  # both masters on EP rank 0
#: Receive-buffer rows per rank: dropless (`capacity_factor=None`), every pair to one rank.
CAPACITY = EP * K * (BATCH * SEQ // (GROUPS * EP))

#: MaxText's placement of the layer's parameters on its FSDP x EP mesh: the model width over
#: "fsdp" (its logical axes "embed" / "embed_no_exp"), the experts over "expert".
FSDP_SPECS = {
    "router_kernel": P("fsdp", None),
    "w_gate": P("expert", "fsdp", None),
    "w_up": P("expert", "fsdp", None),
    "w_down": P("expert", None, "fsdp"),
}


def divergent_mesh(kind: str) -> jax.sharding.Mesh:
    """'data': ("data", "expert") = (2, 4); 'fsdp': ("fsdp", "expert") = (2, 4), MaxText's axis
    order (its batch split over both, as ``place_batch`` splits it)."""
    if kind == "data":
        return helpers.expert_mesh(EP, GROUPS)
    return jax.make_mesh((GROUPS, EP), ("fsdp", "expert"), devices=jax.devices()[: GROUPS * EP])


# -- inputs ------------------------------------------------------------------------------------


def draw(seed: int, shifts: tuple[float, float]):
    """(x float32 [BATCH, SEQ, D], the parameter values (`lc.PARAM_NAMES`), a cotangent like x)
    of one draw, as `helpers.draw_routed_inputs` draws them but skewed per group: the router's
    `HOT` columns aligned with a direction u, and group g's tokens shifted by ``shifts[g] * u``
    (the larger the shift, the more of its pairs go to rank 0's experts)."""
    rng = np.random.default_rng(seed)
    u = rng.normal(size=lc.D)
    u /= np.linalg.norm(u)
    router = 0.7 * rng.normal(size=(lc.D, E))
    router[:, list(HOT)] += 3.0 * u[:, None]
    x = rng.normal(size=(BATCH, SEQ, lc.D))
    rows = BATCH // GROUPS
    for g, shift in enumerate(shifts):
        x[g * rows : (g + 1) * rows] += shift * u
    params = {
        "router_kernel": router,
        "w_gate": rng.normal(size=(E, lc.D, lc.F)) / np.sqrt(lc.D),
        "w_up": rng.normal(size=(E, lc.D, lc.F)) / np.sqrt(lc.D),
        "w_down": rng.normal(size=(E, lc.F, lc.D)) / np.sqrt(lc.F),
    }
    cotangent = rng.normal(size=x.shape)
    return (
        x.astype(np.float32),
        {k: v.astype(np.float32) for k, v in params.items()},
        cotangent.astype(np.float32),
    )


def balanced_rows(router_kernel) -> np.ndarray:
    """float32 [BATCH / GROUPS, SEQ, D]: one group's tokens whose top-2 choices load every expert
    equally: token t's logits are 2 at expert t mod E, 1 at expert t + 1 mod E and 0 elsewhere
    (x solved from the router kernel [D, E], D = E here)."""
    T = BATCH // GROUPS * SEQ
    logits = np.zeros((T, E))
    t = np.arange(T)
    logits[t, t % E] = 2.0
    logits[t, (t + 1) % E] = 1.0
    x = np.linalg.solve(np.asarray(router_kernel, np.float64).T, logits.T).T
    return x.reshape(BATCH // GROUPS, SEQ, lc.D).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Divergence:
    """One way for the two groups' plans to differ: its inputs (`draw`'s seed and shifts), the
    group whose tokens are all masked, whether group 1's tokens are `balanced_rows`, and the
    relay bound that runs the ragged path (None: the default, 2, on the padded path, what
    "auto" is on CPU)."""

    name: str
    seed: int
    shifts: tuple[float, float]
    masked_group: int | None = None
    balanced_group: bool = False
    max_fanout: int | None = None

    @property
    def balancer(self) -> uep.BalancerConfig:
        """`lc.balancer_config`'s (it replicates readily at these few tokens), with S slots."""
        fanout = {} if self.max_fanout is None else {"max_fanout": self.max_fanout}
        return lc.balancer_config(divergent_mesh("data"), E, S, **fanout)

    @property
    def options(self) -> dict:
        """More `uep.MoE` keywords: the ragged exchange for a relay case."""
        return {} if self.max_fanout is None else {"comm_backend": "ragged"}

    def inputs(self):
        """(x, params, cotangent, token_mask bool [BATCH, SEQ])."""
        x, params, cot = draw(self.seed, self.shifts)
        rows = BATCH // GROUPS
        if self.balanced_group:
            x[rows:] = balanced_rows(params["router_kernel"])
        mask = np.ones((BATCH, SEQ), bool)
        if self.masked_group is not None:
            mask[self.masked_group * rows : (self.masked_group + 1) * rows] = False
        return x, params, cot, mask


DIVERGENCES = {
    d.name: d
    for d in (
        Divergence("masked_group", seed=0, shifts=(3.0, 3.0), masked_group=1),
        Divergence("balanced_group", seed=0, shifts=(3.0, 0.0), balanced_group=True),
        Divergence("slot_columns", seed=13, shifts=(3.0, 0.0)),
        # Last: its emulation clears JAX's in-memory caches (`helpers.ragged_emulation`).
        Divergence("relay_hops", seed=25, shifts=(4.0, 1.0), max_fanout=1),
    )
}


# -- the per-group plans -------------------------------------------------------------------------


def group_loads(x, router_kernel, mask) -> np.ndarray:
    """int32 [G, R, E]: each group's (token, choice) pairs per source rank and expert, from the
    reference routing; masked tokens in none."""
    experts, margin = lc.reference_experts(x, router_kernel, K)
    assert margin > 1e-3, f"routing margin {margin}: the layer may choose other experts"
    experts = experts.reshape(GROUPS, EP, -1, K)
    real = mask.reshape(GROUPS, EP, -1)
    loads = np.zeros((GROUPS, EP, E), np.int32)
    for g in range(GROUPS):
        for r in range(EP):
            loads[g, r] = np.bincount(experts[g, r][real[g, r]].reshape(-1), minlength=E)
    return loads


def group_plans(loads, balancer: uep.BalancerConfig, capacity: int) -> list[uep.Plan]:
    """Each group's plan of its loads [G, R, E] (`uep.plan`, as NumPy), what the layer's group
    must compute from the same loads."""
    plans = (uep.plan(loads_RE, balancer, capacity=capacity) for loads_RE in loads)
    return [jax.tree.map(np.asarray, plan) for plan in plans]


def used_columns(plan: uep.Plan) -> int:
    """Slot columns holding a replica on some rank."""
    return int(np.sum(np.any(plan.slot_expert >= 0, axis=0)))


def relay_schedule(plan: uep.Plan, balancer: uep.BalancerConfig) -> relay.RelaySchedule:
    """The relay schedule the layer computes from the plan's slots (`core._relay_schedule`)."""
    return relay.relay_schedule(
        jnp.asarray(plan.slot_expert), E // EP, balancer.max_fanout, balancer.domain_size
    )


def relay_hops(plan: uep.Plan, balancer: uep.BalancerConfig) -> int:
    """Hops of the plan's relay schedule (0: no replica)."""
    return int(np.max(np.asarray(relay_schedule(plan, balancer).hop_RS), initial=0))


def assert_stats_of_groups(stats: dict, loads, plans, balancer: uep.BalancerConfig) -> None:
    """The layer's `MoEStats` (summed over the groups; the imbalance and the transfer's largest
    send the worst group's) are those of the per-group ``plans``: the groups ran these plans,
    not one plan for both."""
    em = E // EP
    want_rows = sum(
        np.concatenate([p.master_quota.reshape(EP, em), p.slot_quota], axis=1) for p in plans
    )
    np.testing.assert_array_equal(stats["group_rows"], want_rows, "rows per local group")
    np.testing.assert_array_equal(stats["expert_load"], loads.sum(axis=(0, 1)))
    np.testing.assert_array_equal(stats["rank_load_after"], sum(p.rank_load for p in plans))
    assert int(stats["replicas"]) == sum(int(np.sum(p.slot_expert >= 0)) for p in plans)
    imbalance = max(float(uep.imbalance(p.rank_load)) for p in plans)
    np.testing.assert_allclose(stats["imbalance_after"], imbalance, rtol=1e-6)
    copy_bytes = 4 * 3 * lc.D * lc.F  # float32 w_gate, w_up and w_down of one expert
    sends = [relay.largest_send_bytes(relay_schedule(p, balancer), copy_bytes) for p in plans]
    assert float(stats["transfer_send_max"]) == max(float(b) for b in sends)
    assert int(stats["dropped"]) == 0 and int(stats["invalid"]) == 0


def assert_plans_differ(name: str, loads, plans, balancer: uep.BalancerConfig) -> None:
    """What the divergence ``name`` means, in the per-group plans."""
    replicas = [int(np.sum(p.slot_expert >= 0)) for p in plans]
    assert not np.array_equal(plans[0].slot_expert, plans[1].slot_expert), name
    if name == "masked_group":
        assert loads[1].sum() == 0 and replicas[0] > 0 and replicas[1] == 0, replicas
    elif name == "balanced_group":
        assert loads[1].sum() == K * BATCH // GROUPS * SEQ, loads[1].sum()
        assert np.all(plans[1].rank_load == plans[1].rank_load[0]), plans[1].rank_load
        assert replicas[0] > 0 and replicas[1] == 0, replicas
    elif name == "slot_columns":
        assert [used_columns(p) for p in plans] == [2, 1], [p.slot_expert for p in plans]
    elif name == "relay_hops":
        # Only the hops differ: both groups replicate, into one slot column each.
        assert [relay_hops(p, balancer) for p in plans] == [2, 1], [p.slot_expert for p in plans]
        assert min(replicas) > 0 and [used_columns(p) for p in plans] == [1, 1], replicas
    else:
        raise AssertionError(name)


# -- the layer -------------------------------------------------------------------------------


def _layer(mesh_kind: str, balancer, params=None, **options) -> uep.MoE:
    """The layer of this file's widths, with ``params`` written in; on the FSDP mesh placed as
    MaxText places them (`FSDP_SPECS`)."""
    mesh = divergent_mesh(mesh_kind)
    layer = lc.build_layer(mesh, E, K, balancer, None, params, **options)
    if mesh_kind == "fsdp":
        for name, spec in FSDP_SPECS.items():
            var, sharding = getattr(layer, name), NamedSharding(layer.mesh, spec)
            var[...] = jax.device_put(var[...], sharding)
            assert var[...].sharding.is_equivalent_to(sharding, var[...].ndim), name
    return layer


@functools.cache
def _step(mesh_kind: str, balancer: uep.BalancerConfig | None, **options):
    """(graphdef, rest, jitted step(params, x, mask, cot) -> (y, stats, d/dx, d/dparams)) of
    sum(y * cot), compiled once for every case of this mesh and configuration."""
    graphdef, _, rest = nnx.split(_layer(mesh_kind, balancer, **options), nnx.Param, ...)

    @jax.jit
    def step(params, x, mask, cot):
        def loss(params, x):
            y, stats = nnx.merge(graphdef, params, rest)(x, mask)
            return jnp.sum(y * cot), (y, stats)

        (_, (y, stats)), (gp, gx) = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)
        return y, stats, gx, gp

    return graphdef, rest, step


def layer_arrays(mesh_kind: str, balancer, x, params, cot, mask, place=None, **options):
    """y, stats, d/dx and {name: d/dname} (`lc.PARAM_NAMES`) of the layer (``balancer``: a
    `uep.BalancerConfig`, or None for plain EP; ``options``: more `uep.MoE` keywords), as jax
    Arrays; ``place(mesh, a)`` puts the batch arrays on the mesh (`helpers.place_batch` when
    None)."""
    graphdef, rest, step = _step(mesh_kind, balancer, **options)
    _, values, _ = nnx.split(_layer(mesh_kind, balancer, params, **options), nnx.Param, ...)
    mesh, place = divergent_mesh(mesh_kind), place or helpers.place_batch
    y, stats, gx, gp = step(values, place(mesh, x), place(mesh, mask), place(mesh, cot))
    grads = nnx.merge(graphdef, gp, rest)
    return y, stats, gx, {name: getattr(grads, name)[...] for name in lc.PARAM_NAMES}


def layer_run(mesh_kind: str, balancer, x, params, cot, mask, **options):
    """`layer_arrays` as NumPy (the stats a dict)."""
    y, stats, gx, grads = layer_arrays(mesh_kind, balancer, x, params, cot, mask, **options)
    as_numpy = {name: np.asarray(g) for name, g in grads.items()}
    return np.asarray(y), lc.to_numpy_stats(stats), np.asarray(gx), as_numpy


def reference(x, params, cot, mask):
    """The dense one-device reference of sum(y * cot) over the real tokens, as `layer_run`
    returns it: y (0 at masked tokens), None (no stats), d/dx and d/dparams."""
    real = mask[..., None]
    y, gx, gp = lc.reference_value_and_grads(
        jnp.asarray(x), {k: jnp.asarray(v) for k, v in params.items()}, cot * real, K
    )
    grads = {k: np.asarray(v) for k, v in gp.items()}
    return np.asarray(y) * real, None, np.asarray(gx), grads


@functools.cache
def run_divergence(name: str, mesh_kind: str) -> dict:
    """The case's inputs, loads and per-group plans, and the balanced layer's, plain EP's and
    the reference's results (a relay case's balanced layer on the emulated ragged path)."""
    case = DIVERGENCES[name]
    x, params, cot, mask = case.inputs()
    loads = group_loads(x, params["router_kernel"], mask)
    out = {
        "mask": mask,
        "loads": loads,
        "plans": group_plans(loads, case.balancer, CAPACITY),
        "plain": layer_run(mesh_kind, None, x, params, cot, mask),
        "ref": reference(x, params, cot, mask),
    }
    run = functools.partial(layer_run, mesh_kind, case.balancer, x, params, cot, mask)
    if case.max_fanout is None:
        out["balanced"] = run()
    else:
        with emulated_ragged_all_to_all() as emulation:
            out["balanced"] = run(**case.options)
        assert emulation.lowered > 0, "the ragged path did not run"
    return out


def assert_same_results(got, want, what: str) -> None:
    """y, d/dx and every parameter's gradient of ``got`` equal ``want``'s."""
    (y, _, gx, gp), (want_y, _, want_gx, want_gp) = got, want
    lc.assert_close(y, want_y, f"{what}: y")
    lc.assert_close(gx, want_gx, f"{what}: d/dx")
    for name in lc.PARAM_NAMES:
        lc.assert_close(gp[name], want_gp[name], f"{what}: d/d{name}")


def save_run(path, run) -> None:
    """`layer_run`'s results into the .npz ``path`` (`load_run` reads them back)."""
    y, stats, gx, grads = run
    arrays = {"y": y, "gx": gx}
    arrays.update({f"stats.{k}": v for k, v in stats.items()})
    arrays.update({f"grad.{k}": v for k, v in grads.items()})
    np.savez(path, **arrays)


def load_run(path):
    """The results `save_run` wrote: (y, stats, d/dx, grads), as `layer_run` returns them."""
    with np.load(path) as f:
        part = {k: f[k] for k in f.files}
    stats = {k.removeprefix("stats."): v for k, v in part.items() if k.startswith("stats.")}
    grads = {k.removeprefix("grad."): v for k, v in part.items() if k.startswith("grad.")}
    return part["y"], stats, part["gx"], grads
