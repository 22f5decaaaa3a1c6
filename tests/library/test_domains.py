"""Fast domains (`BalancerConfig.ranks_per_domain`): the topology-aware relay schedule against the
NumPy reference of ffi/TRANSFER.md ("Fast domains"), one domain bit-identical to the default,
and the layer over domains of 2 and 4 ranks equal to the dense reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ultraep_jax as uep
from tests.helpers import layer_cases, padded_exchange, random_slots
from tests.references.relay import reference_schedule, reference_slow_copies
from ultraep_jax.replicas import relay


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _schedule(slots, em, f, d):
    s = relay.relay_schedule(slots, em, f, d)
    return {"hop": s.hop_RS, "sender": s.sender_RS, "source": s.source_RS}


def schedule(slots, em, f, d=None) -> dict:
    return jax.tree.map(np.asarray, _schedule(jnp.asarray(slots), em, f, d))


def remote_domains(slots, em, d) -> int:
    """Pairs (expert, domain other than its master's) with a replica of the expert: the fewest
    slow-link copies that deliver every replica."""
    R, _ = slots.shape
    return len(
        {(int(e), t // d) for t in range(R) for e in slots[t] if e >= 0 and t // d != e // em // d}
    )


@pytest.mark.parametrize("f", [0, 1, 2, 3])
@pytest.mark.parametrize(
    "R, em, S, d", [(4, 2, 2, 2), (8, 1, 3, 2), (8, 2, 2, 4), (16, 4, 2, 4), (64, 4, 2, 8)]
)
def test_schedule_with_domains_equals_reference(R, em, S, d, f):
    """Random plans: hop, sender and source equal the reference; the hops fit the static count;
    the slow links carry exactly one copy per (expert, remote domain) that needs it; no rank
    sends more than f copies per relay slot it holds in a link class, beyond its own masters."""
    rng = np.random.default_rng(R * 1000 + em * 100 + S * 10 + d + f)
    for case in range(15):
        slots = random_slots(rng, R, em, S, fill=rng.uniform(0.2, 1.0), hot=1 + case % 4)
        got = schedule(slots, em, f, d)
        want = reference_schedule(slots, em, f, d)
        for key in ("hop", "sender", "source"):
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{key}\n{slots}")
        assert got["hop"].max() <= relay.schedule_hops(R, f, d)
        assert reference_slow_copies(slots, em, want, d) == remote_domains(slots, em, d)
        for h in range(1, relay.schedule_hops(R, f, d) + 1):  # the ragged operand's rows
            sent = np.bincount(want["sender"][want["hop"] == h], minlength=R + 1)[:R]
            assert sent.max() <= relay.hop_send_bound(R, S, em, f, d, h), (h, slots)


@pytest.mark.parametrize("f", [0, 1, 2])
@pytest.mark.parametrize("R, em, S", [(4, 2, 2), (8, 1, 3), (16, 4, 2)])
def test_one_domain_is_the_default_schedule(R, em, S, f):
    """``ranks_per_domain = R`` gives the schedule of no topology, bit for bit."""
    rng = np.random.default_rng(R + em + S + f)
    for case in range(10):
        slots = random_slots(rng, R, em, S, fill=rng.uniform(0.2, 1.0), hot=1 + case % 4)
        default, one = schedule(slots, em, f), schedule(slots, em, f, R)
        for key in default:
            np.testing.assert_array_equal(one[key], default[key], err_msg=key)
    assert relay.schedule_hops(R, f, R) == relay.schedule_hops(R, f) == relay.static_hops(R, f)


def test_hand_computed_domain_tree():
    """8 ranks in domains {0..3} and {4..7}; expert 0 (master rank 0) on ranks 1, 2, 5, 6, 7,
    f = 2. The master sends to ranks 1 and 2 in its domain and to the one gateway, rank 5, over
    the slow link (hop 1); rank 5 sends to ranks 6 and 7 (hop 2). Expert 4 (master rank 2) only
    on rank 6: its master sends it in hop 1. Two slow copies; the topology-blind tree (rank 2
    masters a replicated expert, so it comes last: 1, 5 | 6, 7, 2 from 1, 5, 1) sends three."""
    slots = np.full((8, 2), -1, np.int32)
    slots[[1, 2, 5, 6, 7], 0] = 0
    slots[6, 1] = 4
    got = schedule(slots, 2, 2, 4)
    np.testing.assert_array_equal(
        got["hop"], [[0, 0], [1, 0], [1, 0], [0, 0], [0, 0], [1, 0], [2, 1], [2, 0]]
    )
    np.testing.assert_array_equal(
        got["sender"], [[8, 8], [0, 8], [0, 8], [8, 8], [8, 8], [0, 8], [5, 2], [5, 8]]
    )
    np.testing.assert_array_equal(got["source"], np.zeros((8, 2)))
    assert reference_slow_copies(slots, 2, reference_schedule(slots, 2, 2, 4), 4) == 2
    blind = schedule(slots, 2, 2)
    np.testing.assert_array_equal(blind["sender"][:, 0], [8, 0, 1, 8, 8, 0, 1, 5])
    assert reference_slow_copies(slots, 2, reference_schedule(slots, 2, 2), 4) == 3


def test_master_with_more_than_f_experts_to_send_across_hands_them_to_a_local_relay():
    """Rank 0 masters experts 0, 1, 2 (E_m = 4), each on rank 1 (its domain) and rank 5 (the
    other), f = 2: sending three slow copies itself would exceed f, so it sends the three over
    the fast link to rank 1 (hop 1), which sends them across to rank 5 (hop 2). With f = 3 the
    master sends its three slow copies itself, in hop 1."""
    slots = np.full((8, 3), -1, np.int32)
    slots[1] = slots[5] = [0, 1, 2]
    got = schedule(slots, 4, 2, 4)
    np.testing.assert_array_equal(got["hop"][[1, 5]], [[1, 1, 1], [2, 2, 2]])
    np.testing.assert_array_equal(got["sender"][[1, 5]], [[0, 0, 0], [1, 1, 1]])
    np.testing.assert_array_equal(got["source"][[1, 5]], [[0, 1, 2], [0, 1, 2]])
    wide = schedule(slots, 4, 3, 4)
    np.testing.assert_array_equal(wide["hop"][[1, 5]], [[1, 1, 1], [1, 1, 1]])
    np.testing.assert_array_equal(wide["sender"][[1, 5]], [[0, 0, 0], [0, 0, 0]])
    for f in (2, 3):
        want = reference_schedule(slots, 4, f, 4)
        assert reference_slow_copies(slots, 4, want, 4) == 3


@pytest.mark.parametrize("R, f, d, want", [(8, 2, 4, 4), (8, 2, 2, 4), (8, 0, 2, 3), (64, 2, 8, 7)])
def test_schedule_hops(R, f, d, want):
    assert relay.schedule_hops(R, f, d) == want


@pytest.mark.parametrize("value, match", [(3, "must divide the EP size"), (0, "ranks_per_domain")])
def test_bad_ranks_per_domain_raises_one_line(value, match):
    with pytest.raises(ValueError, match=match) as err:
        uep.BalancerConfig(8, 8, ranks_per_domain=value)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=match):
        uep.ExpertParallel(
            layer_cases.make_mesh("ep8"), 8, uep.BalancerConfig(ranks_per_domain=value)
        )


# 2 streamed chunks on every mesh and domain size, each case a compile of the layer's step. The
# relay schedule over domains does not depend on the chunks, and each chunk's transfer follows
# the schedule as one unstreamed transfer would (test_relay runs 1, 2 and 4 chunks through the
# same transfer): a case at 1 chunk (ep8, d = 2, seed 0, here before) runs no code these miss.
# The ep8 cases run on one JAX line (slow); the others run the same code on dp2ep4.
@pytest.mark.parametrize(
    "mesh_kind, d, seed, chunks",
    [
        pytest.param("ep8", 2, 0, 2, marks=pytest.mark.slow),
        pytest.param("ep8", 4, 0, 2, marks=pytest.mark.slow),
        ("dp2ep4", 2, 3, 2),
    ],
)
def test_layer_over_domains_equals_dense_reference(mesh_kind, d, seed, chunks, monkeypatch):
    """The balanced layer (relays f = 2, the ragged transfer run through the padded exchange;
    1 or 2 streamed chunks) over fast domains of ``d`` ranks: values and gradients equal the
    dense reference, a gateway relays inside its remote domain, and the reported largest send
    is the reference schedule's."""
    padded_exchange(monkeypatch)
    mesh = layer_cases.make_mesh(mesh_kind)
    G, R = layer_cases.mesh_groups(mesh)
    rng = np.random.default_rng(seed)
    E, k = 8, 2
    x, params = layer_cases.make_inputs(rng, 8, 8, E, k, skew=True, hot=[0, 1])
    cot = rng.normal(size=x.shape).astype(np.float32)
    balancer = layer_cases.balancer_config(mesh, E, slots=2, max_fanout=2, ranks_per_domain=d)
    layer = layer_cases.build_layer(
        mesh, E, k, balancer, None, params, comm_backend="ragged", transfer_chunks=chunks
    )
    y, stats, gx, gp = layer_cases.layer_value_and_grads(
        layer, layer_cases.place_batch(mesh, x), jnp.asarray(cot)
    )
    ref_y, ref_gx, ref_gp = layer_cases.reference_value_and_grads(
        jnp.asarray(x), {n: jnp.asarray(v) for n, v in params.items()}, cot, k
    )
    loads = layer_cases.independent_loads(x, params["router_kernel"], k, mesh, E)
    slots = [
        np.asarray(uep.plan(loads[g].astype(np.int32), balancer).slot_expert) for g in range(G)
    ]
    sched = [reference_schedule(s, E // R, 2, d) for s in slots]
    ranks = np.arange(R)[:, None]
    assert any(
        (
            (sc["sender"] < R)
            & (sc["sender"] // d == ranks // d)
            & (sl // (E // R) // d != ranks // d)
        ).any()
        for sl, sc in zip(slots, sched, strict=True)
    ), "no gateway relays inside its domain"
    assert int(stats["dropped"]) == 0
    copies = max(int(np.bincount(s["sender"].ravel(), minlength=R + 1)[:R].max()) for s in sched)
    assert float(stats["transfer_send_max"]) == copies * 3 * layer_cases.D * layer_cases.F * 4
    layer_cases.assert_close(y, ref_y, "y")
    layer_cases.assert_close(gx, ref_gx, "d/dx")
    for name in layer_cases.PARAM_NAMES:
        layer_cases.assert_close(gp[name], ref_gp[name], f"d/d{name}")
