"""The relay schedule (`replicas.relay`) against the NumPy reference of ffi/TRANSFER.md."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ultraep_jax as uep
from tests.helpers import fetch_with_grads, layer_cases, padded_exchange, random_slots
from tests.references.relay import reference_schedule, reference_send_copies
from ultraep_jax.replicas import relay, streaming, transfer


@functools.partial(jax.jit, static_argnums=(1, 2))
def _schedule_arrays(slots, em, f):
    sched = relay.relay_schedule(slots, em, f)
    hops = relay.static_hops(slots.shape[0], f)
    return sched, relay.send_copies(sched), relay.hop_copies(sched, hops)


def jitted_schedule(slots, em, f, per_hop=False):
    sched, sent, hop_copies = _schedule_arrays(jnp.asarray(slots), em, f)
    got = {
        "hop": np.asarray(sched.hop_RS),
        "sender": np.asarray(sched.sender_RS),
        "source": np.asarray(sched.source_RS),
    }
    if per_hop:
        return got, np.asarray(sent), [np.asarray(a) for a in hop_copies]
    return got, np.asarray(sent)


@pytest.mark.parametrize("f", [0, 1, 2, 3])
@pytest.mark.parametrize("R, em, S", [(2, 1, 1), (4, 2, 2), (8, 1, 3), (16, 4, 2), (64, 4, 2)])
def test_schedule_equals_reference(R, em, S, f):
    rng = np.random.default_rng(R * 100 + em * 10 + S + f)
    for case in range(20):
        slots = random_slots(rng, R, em, S, fill=rng.uniform(0.2, 1.0), hot=1 + case % 4)
        got, sent, (per_hop_sent, per_hop_received) = jitted_schedule(slots, em, f, per_hop=True)
        want = reference_schedule(slots, em, f)
        for key in ("hop", "sender", "source"):
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{key}\n{slots}")
        np.testing.assert_array_equal(sent, reference_send_copies(slots, em, f))
        hops = relay.static_hops(R, f)
        assert got["hop"].max() <= hops
        for h in range(hops):
            in_hop = want["hop"] == h + 1
            np.testing.assert_array_equal(
                per_hop_sent[h], np.bincount(want["sender"][in_hop], minlength=R)[:R]
            )
            np.testing.assert_array_equal(per_hop_received[h], in_hop.sum(axis=1))
            # The ragged transfer's operand holds this many rows: no rank may send more.
            assert per_hop_sent[h].max() <= relay.hop_send_bound(R, S, em, f, None, h + 1)


def test_hand_computed_tree():
    """Expert 0 (master rank 0) on ranks 1..6, expert 2 (master rank 1) on rank 0: each master
    has one replicated expert, so sends up to f = 2 copies; rank 1 has its own master to send,
    so it comes last among expert 0's replicas (a leaf), and ranks 2 and 3 relay."""
    slots = np.full((8, 1), -1, np.int32)
    slots[1:7, 0] = 0
    slots[0, 0] = 2  # expert 2's master is rank 1; its replica on rank 0
    got, sent = jitted_schedule(slots, 2, 2)
    # Expert 0's replicas in order: ranks 2, 3, 4, 5, 6 (by distance from rank 0), then rank 1.
    # Level 1 (hop 1): ranks 2, 3 from the master; level 2: ranks 4, 5, 6, 1 from 2, 3, 2, 3.
    np.testing.assert_array_equal(got["hop"][:, 0], [1, 2, 1, 1, 2, 2, 2, 0])
    np.testing.assert_array_equal(got["sender"][:, 0], [1, 3, 0, 0, 2, 3, 2, 8])
    np.testing.assert_array_equal(got["source"][:, 0], [0, 0, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(sent, [2, 1, 2, 2, 0, 0, 0, 0])


def test_root_fanout_is_shared_by_a_ranks_replicated_masters():
    """Rank 0 masters experts 0 and 1, both replicated 3 times: with f = 2 each gets a root
    fan-out of 1, so rank 0 sends 2 copies in all; the first replicas relay the rest."""
    slots = np.array([[-1, -1], [0, 1], [0, 1], [0, 1]], np.int32)
    got, sent = jitted_schedule(slots, 2, 2)
    np.testing.assert_array_equal(got["hop"], [[0, 0], [1, 1], [2, 2], [2, 2]])
    np.testing.assert_array_equal(got["sender"], [[4, 4], [0, 0], [1, 1], [1, 1]])
    np.testing.assert_array_equal(got["source"], [[0, 0], [0, 1], [0, 1], [0, 1]])
    np.testing.assert_array_equal(sent, [2, 4, 0, 0])
    direct, _ = jitted_schedule(slots, 2, 0)
    np.testing.assert_array_equal(direct["sender"], [[4, 4], [0, 0], [0, 0], [0, 0]])


@pytest.mark.parametrize("R, f, want", [(2, 1, 1), (8, 0, 1), (8, 1, 7), (8, 2, 3), (64, 2, 6)])
def test_static_hops(R, f, want):
    assert relay.static_hops(R, f) == want


def test_schedule_of_real_plans_equals_reference():
    """Plans of the FFI planner on skewed loads (EP16, E=64, S=2) at f = 1, 2."""
    rng = np.random.default_rng(5)
    cfg = uep.BalancerConfig(64, 16, slots_per_rank=2, min_tokens_per_replica=4)
    for _ in range(5):
        loads = rng.integers(0, 50, size=(16, 64)).astype(np.int32)
        loads[:, rng.choice(64, 3, replace=False)] *= 40
        slots = np.asarray(uep.plan(loads, cfg).slot_expert)
        assert (slots >= 0).sum() > 0
        for f in (1, 2):
            got, _ = jitted_schedule(slots, 4, f)
            want = reference_schedule(slots, 4, f)
            for key in ("hop", "sender", "source"):
                np.testing.assert_array_equal(got[key], want[key], err_msg=key)


# -- the relayed transfer and its gradient ------------------------------------------------------


def _assert_fetch_equals_numpy(got, grads, masters, slot_expert, cot):
    """Every slot holds its expert's weights (zeros when empty), bit for bit, and each master's
    gradient is the sum of the cotangents of the slots holding it."""
    flat = slot_expert.reshape(-1)
    for g, w in zip(got, masters, strict=True):
        want = np.stack([w[e] if e >= 0 else np.zeros_like(w[0]) for e in flat])
        np.testing.assert_array_equal(np.asarray(g), want)
    for g, c, w in zip(grads, cot, masters, strict=True):
        want = np.zeros_like(w)
        for i, e in enumerate(flat):
            if e >= 0:
                want[e] += c[i]
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-6, atol=1e-6)


# f = 0 (no relay) on the ragged transfer only: its one hop's operand is sized for a master that
# sends every copy itself (`relay.hop_send_bound`); the padded (dense) transfer ignores f.
@pytest.mark.parametrize(
    "f, backend",
    [(1, "padded"), (2, "padded"), (1, "ragged"), (2, "ragged"), (0, "ragged")],
)
def test_relayed_fetch_and_its_gradient_equal_numpy(f, backend, monkeypatch, ep8_mesh):
    """8 ranks, 2 masters each, 2 slots: expert 0 on 6 ranks (relayed through 2 or 3 levels with
    f = 1 or 2, sent by its master alone with f = 0, there with expert 1 on rank 7), expert 3 on
    2; every slot gets its expert, and each master's gradient is the sum of the cotangents of
    every slot holding it (summed through the relays)."""
    if backend == "ragged":
        padded_exchange(monkeypatch)
    R, em, S = 8, 2, 2
    E = R * em
    slot_expert = np.array(
        [[3, -1], [0, -1], [0, 3], [0, -1], [-1, -1], [0, -1], [0, 9], [0, -1]], np.int32
    )
    if f == 0:  # rank 0 sends two experts, 7 rows in all, the last expert 1: rows that differ
        slot_expert[7, 1] = 1
    sched = reference_schedule(slot_expert, em, f)
    if f:
        assert sched["hop"].max() >= 2, "the layout must need relays"
    else:
        assert (
            sched["hop"].max() == 1 and (sched["sender"][np.isin(slot_expert, (0, 1))] == 0).all()
        )
    rng = np.random.default_rng(f)
    masters = [
        rng.normal(size=(E, 3, 5)).astype(np.float32),
        rng.normal(size=(E, 4)).astype(np.float32),
    ]
    cot = [rng.normal(size=(R * S, *w.shape[1:])).astype(np.float32) for w in masters]
    got, grads = fetch_with_grads(
        ep8_mesh, masters, slot_expert, cot, backend=backend, max_fanout=f
    )
    _assert_fetch_equals_numpy(got, grads, masters, slot_expert, cot)


@pytest.mark.parametrize(
    "S, want", [(0, ()), (1, (1,)), (2, (1, 2)), (3, (1, 2, 3)), (4, (1, 2, 4)), (6, (1, 2, 4, 6))]
)
def test_dense_hop_compiles_a_branch_per_bucket_of_columns(S, want):
    assert transfer.column_buckets(S) == want


@pytest.mark.parametrize("used", [0, 1, 2, 3, 4])
def test_dense_fetch_moving_only_the_columns_in_use_equals_numpy(used, ep8_mesh):
    """S = 4 slots, the plan filling 3 ranks' slots in each of the first ``used`` columns (the
    other ranks' slots there empty): the dense hop moves 1, 2 or 4 columns (or none) and every
    slot still gets its expert, every master the sum of its slots' cotangents."""
    R, em, S = 8, 2, 4
    rng = np.random.default_rng(used)
    slot_expert = np.full((R, S), -1, np.int32)
    for c in range(used):
        ranks = rng.choice(R, size=3, replace=False)
        slot_expert[ranks, c] = rng.integers(0, R * em, size=3)
    masters = [
        rng.normal(size=(R * em, 3, 5)).astype(np.float32),
        rng.normal(size=(R * em, 4)).astype(np.float32),
    ]
    cot = [rng.normal(size=(R * S, *w.shape[1:])).astype(np.float32) for w in masters]
    got, grads = fetch_with_grads(ep8_mesh, masters, slot_expert, cot, backend="padded")
    assert (slot_expert >= 0).any() == bool(used)
    _assert_fetch_equals_numpy(got, grads, masters, slot_expert, cot)


def test_relay_hops_lower_for_cuda_with_ragged_all_to_all(ep8_mesh):
    """The relayed transfer exports for CUDA: one ragged all-to-all for hop 1 and one per later
    hop (inside a conditional), whose transposes carry the gradients back."""
    R, em, S = 8, 2, 2

    def per_rank(slots_RS, w):
        (got,) = transfer.fetch_replica_experts(
            (w,), slots_RS, axis_name="expert", backend="ragged", max_fanout=2
        )
        return got

    fetch = jax.shard_map(
        per_rank, mesh=ep8_mesh, in_specs=(P(), P("expert")), out_specs=P("expert")
    )

    def loss(w, slots):
        return jnp.sum(fetch(slots, w) ** 2)

    args = (
        jax.ShapeDtypeStruct(
            (R * em, 4), jnp.float32, sharding=NamedSharding(ep8_mesh, P("expert"))
        ),
        jax.ShapeDtypeStruct((R, S), jnp.int32, sharding=NamedSharding(ep8_mesh, P())),
    )
    exported = jax.export.export(
        jax.jit(jax.grad(loss)),
        platforms=["cuda"],
        # ragged_all_to_all has no export compatibility guarantee in this JAX
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")],
    )(*args)
    text = exported.mlir_module()
    calls = len(re.findall(r"custom_call @ragged_all_to_all\(", text))
    assert calls == 2 * relay.static_hops(R, 2), calls  # every hop forward and transposed
    assert "psum_scatter" not in text and "reduce_scatter" not in text
    # Each operand holds the rows a rank can send in its hop (hop 1: max(f, E_m) = 2, later f x
    # S = 4) or, transposed, the S = 2 it received: never one per slot of the group (R x S).
    rows = [
        int(re.search(r": \(tensor<(\d+)x4xf32>", line)[1])
        for line in text.splitlines()
        if "custom_call @ragged_all_to_all(" in line
    ]
    assert sorted(set(rows)) == [2, 4], rows


# -- the layer with relays: values and gradients equal the dense reference ---------------------


LAYER_EXPERTS = 8


def _relayed_layer_case(mesh, f, backend, monkeypatch, chunks=1, seed=0):
    """The balanced layer on skewed inputs (E=8, top-2) with ``max_fanout=f``; returns its
    results, the reference's and the plans' slots of each EP group (by the FFI planner)."""
    if backend == "ragged":
        padded_exchange(monkeypatch)
    G, R = layer_cases.mesh_groups(mesh)
    rng = np.random.default_rng(seed)
    E, k, batch, seq = LAYER_EXPERTS, 2, 8, 8
    x, params = layer_cases.make_inputs(rng, batch, seq, E, k, skew=True, hot=[0, 1])
    cot = rng.normal(size=x.shape).astype(np.float32)
    balancer = layer_cases.balancer_config(mesh, E, slots=2, max_fanout=f)
    layer = layer_cases.build_layer(
        mesh, E, k, balancer, None, params, comm_backend=backend, transfer_chunks=chunks
    )
    got = layer_cases.layer_value_and_grads(
        layer, layer_cases.place_batch(mesh, x), jnp.asarray(cot)
    )
    ref = layer_cases.reference_value_and_grads(
        jnp.asarray(x), {n: jnp.asarray(v) for n, v in params.items()}, cot, k
    )
    loads = layer_cases.independent_loads(x, params["router_kernel"], k, mesh, E)
    slots = [
        np.asarray(uep.plan(loads[g].astype(np.int32), balancer).slot_expert) for g in range(G)
    ]
    return got, ref, slots


def deepest_hop(slots, f) -> int:
    """The last relay hop of any group's plan (reference schedule)."""
    return max(
        int(reference_schedule(s, LAYER_EXPERTS // s.shape[0], f)["hop"].max()) for s in slots
    )


def want_send_max(slots, f) -> float:
    """The largest per-rank send in bytes, by the reference schedule: copies of w_gate, w_up and
    w_down in float32, worst group."""
    copies = max(int(reference_send_copies(s, LAYER_EXPERTS // s.shape[0], f).max()) for s in slots)
    return float(copies * 3 * layer_cases.D * layer_cases.F * 4)


# The padded transfer ignores f (its dense hop sends every copy from the master), so f enters
# its layer only through the relay schedule of the `transfer_send_max` stat (computed the same
# way whatever the backend), the code the ragged cases run: one padded case. f changes only the
# schedule's values and its number of hops, and the data axis only splits the batch into groups
# that each run ep8's code at 4 ranks: the ragged transfer runs once at each f, the tree (f = 2)
# on ep8 and the chain (f = 1, 3 hops) on dp2ep4. (Before, every (f, backend) ran on both meshes:
# 6 compiles of the layer's value and gradients. ep8's 7-hop chain runs in `routed_experts`, the
# layer's core, in test_robustness's ragged capacity case at f = 1, and alone in the fetch test
# here; the padded transfer on dp2ep4 in test_moe's balanced dp2ep4 cases and the streamed
# case below.)
@pytest.mark.parametrize(
    "mesh, f, backend",
    [("ep8", 2, "ragged"), ("ep8", 2, "padded"), ("dp2ep4", 1, "ragged")],
    indirect=["mesh"],
)
def test_layer_with_relays_equals_dense_reference(mesh, f, backend, monkeypatch):
    (y, stats, gx, gp), (ref_y, ref_gx, ref_gp), slots = _relayed_layer_case(
        mesh, f, backend, monkeypatch
    )
    assert deepest_hop(slots, f) >= 2, "no expert was relayed"
    assert int(stats["dropped"]) == 0
    assert float(stats["transfer_send_max"]) == want_send_max(slots, f)
    assert want_send_max(slots, f) < want_send_max(slots, 0), "relay sends no less than direct"
    layer_cases.assert_close(y, ref_y, "y")
    layer_cases.assert_close(gx, ref_gx, "d/dx")
    for name in layer_cases.PARAM_NAMES:
        layer_cases.assert_close(gp[name], ref_gp[name], f"d/d{name}")


# 2 and 4 chunks run the same loop over the chunks, a rank's own code that the data axis leaves as
# it is (it only splits the batch into groups): each backend runs the loop once, each case a
# compile of the layer's step, the ragged transfer at 4 chunks on ep8 (every hop in every chunk)
# and the padded one at 2 on dp2ep4. (Before, each mesh and backend took both counts: 4 cases.
# More counts run in test_robustness's capacity cases, ragged at 2 and 3 chunks and padded at
# 4, in test_domains, ragged at 2 on both meshes, and in test_expert_tensor.)
@pytest.mark.parametrize(
    "mesh, chunks, backend",
    [("ep8", 4, "ragged"), ("dp2ep4", 2, "padded")],
    indirect=["mesh"],
)
def test_layer_with_streamed_transfer_equals_dense_reference(mesh, chunks, backend, monkeypatch):
    """The replica weights in 2 or 4 chunks of the hidden width (through relays, f = 2)."""
    (y, stats, gx, gp), (ref_y, ref_gx, ref_gp), slots = _relayed_layer_case(
        mesh, 2, backend, monkeypatch, chunks=chunks, seed=1
    )
    assert int(stats["replicas"]) > 0, "no replica"
    assert int(stats["dropped"]) == 0
    assert float(stats["transfer_send_max"]) == want_send_max(slots, 2)
    layer_cases.assert_close(y, ref_y, "y")
    layer_cases.assert_close(gx, ref_gx, "d/dx")
    for name in layer_cases.PARAM_NAMES:
        layer_cases.assert_close(gp[name], ref_gp[name], f"d/d{name}")


@pytest.mark.parametrize(
    "d_ff, chunks, sizes", [(16, 1, [16]), (16, 4, [4] * 4), (10, 3, [4, 3, 3])]
)
def test_hidden_chunks_cover_the_width(d_ff, chunks, sizes):
    got = streaming.hidden_chunks(d_ff, chunks)
    assert [c.stop - c.start for c in got] == sizes
    assert got[0].start == 0 and got[-1].stop == d_ff
    assert all(a.stop == b.start for a, b in zip(got[:-1], got[1:], strict=True))


def test_streamed_transfer_moves_each_chunk_separately(ep8_mesh):
    """With n chunks the CPU lowering holds n reduce-scatters per hop (one transfer per chunk)
    where one chunk holds one."""

    def count(chunks):
        layer = uep.MoE(
            d_model=layer_cases.D,
            d_ff=layer_cases.F,
            num_experts=8,
            top_k=2,
            mesh=ep8_mesh,
            balancer=layer_cases.balancer_config(ep8_mesh, 8, slots=1, max_fanout=0),
            transfer_chunks=chunks,
            rngs=nnx.Rngs(0),
        )
        x = jnp.ones((8, 4, layer_cases.D), jnp.float32)
        graphdef, state = nnx.split(layer)
        text = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, x).as_text()
        return len(re.findall(r"reduce_scatter", text))

    one = count(1)
    assert one >= 1
    assert count(4) == 4 * one


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"transfer_chunks": 0}, ValueError, r"transfer_chunks must be a positive int, got 0"),
        ({"transfer_chunks": 2.0}, TypeError, r"transfer_chunks must be an int, got float 2.0"),
        ({"transfer_chunks": 17}, ValueError, r"transfer_chunks=17 exceeds d_ff=16"),
    ],
)
def test_bad_transfer_chunks_raise_one_line(kwargs, error, match, ep8_mesh):
    with pytest.raises(error, match=match) as err:
        uep.MoE(
            d_model=layer_cases.D,
            d_ff=layer_cases.F,
            num_experts=8,
            top_k=2,
            mesh=ep8_mesh,
            rngs=nnx.Rngs(0),
            **kwargs,
        )
    assert "\n" not in str(err.value)
    if kwargs["transfer_chunks"] != 17:
        with pytest.raises(error, match=match):
            uep.ExpertParallel(ep8_mesh, 8, **kwargs)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_max_fanout_raises(value):
    with pytest.raises((ValueError, TypeError), match="max_fanout"):
        uep.BalancerConfig(8, 4, max_fanout=value)


def test_transfer_send_max_is_zero_without_replicas(ep8_mesh):
    """Plain EP, and a balancer whose plan makes no replica (a tolerance no load exceeds; a
    balancer with no spare slot, the case this covered before, is now refused at construction)."""
    rng = np.random.default_rng(3)
    x, params = layer_cases.make_inputs(rng, 8, 8, 8, 2, skew=True)
    for balancer in (None, layer_cases.balancer_config(ep8_mesh, 8, slots=1, balance_eps=1e9)):
        layer = layer_cases.build_layer(ep8_mesh, 8, 2, balancer, None, params)
        _, stats = layer_cases.layer_forward(layer, layer_cases.place_batch(ep8_mesh, x))
        assert int(stats["replicas"]) == 0
        assert stats["transfer_send_max"].dtype == np.float32
        assert float(stats["transfer_send_max"]) == 0.0


def test_layer_computes_the_relay_schedule_once_per_call(monkeypatch, ep8_mesh):
    """One relay schedule per layer call, shared by every chunk's transfer (the relayed, ragged
    exchange's layout) and the `transfer_send_max` stat, which counts that schedule's sends."""
    padded_exchange(monkeypatch)
    calls = []
    real = relay.relay_schedule

    def counted(*args, **kwargs):
        calls.append(args[2])  # max_fanout
        return real(*args, **kwargs)

    monkeypatch.setattr(relay, "relay_schedule", counted)
    rng = np.random.default_rng(0)
    x, params = layer_cases.make_inputs(rng, 8, 8, LAYER_EXPERTS, 2, skew=True, hot=[0, 1])
    balancer = layer_cases.balancer_config(ep8_mesh, LAYER_EXPERTS, slots=2, max_fanout=2)
    layer = layer_cases.build_layer(
        ep8_mesh, LAYER_EXPERTS, 2, balancer, None, params, comm_backend="ragged", transfer_chunks=2
    )
    x = layer_cases.place_batch(ep8_mesh, x)
    # The layer's jitted functions keep traces of earlier tests' calls. Cleared after building
    # the layer and placing x (no trace of the layer's call there), so that only the call's own
    # programs compile again, not every small program of the layer's initialisation.
    jax.clear_caches()
    _, stats = layer_cases.layer_forward(layer, x)
    assert int(stats["replicas"]) > 0, "no replica"
    assert calls == [2]
