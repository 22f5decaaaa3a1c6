"""Tests for experiments/stepmodel_programs/topology.py (its figures: topology_cells.py) and the
per-link-class transfer rule it charges (`links.relay_seconds`): schedules small enough to count
each rank's copies per link class by hand, and a few real DeepSeek-R1 layers at EP32 where the
topology-aware schedule must never send more copies across domains than the blind one, and exactly
the least any schedule can."""

import numpy as np
import pytest
from conftest import skip_without_traces

from experiments.lab.batched import batched_schedule
from experiments.lab.loads import traces
from experiments.lab.stepmodel import layer, links
from experiments.lab.stepmodel.layer import CostParams
from experiments.stepmodel_programs import topology_cells

# Two domains of two ranks: a copy within a domain takes 0.5 s, across domains 2 s.
LINKS = links.Links(domain=2, nvlink_bytes_s=4.0, ib_bytes_s=1.0)
COPY = 2.0


def test_relay_seconds_counts_each_class_by_hand():
    # Rank 0 sends one copy to rank 1 (its domain) and one to rank 2 (the other) in hop 1; rank 2
    # forwards to rank 3 (its domain) in hop 2. Empty slots: hop 0, sender R.
    hop = np.array([[[0, 0], [1, 0], [1, 0], [2, 0]]])
    sender = np.array([[[4, 4], [0, 4], [0, 4], [2, 4]]])
    c = links.relay_link_copies(hop, sender, domain=2)
    assert c["near_out"][0].tolist() == [[1, 0, 0, 0], [0, 0, 1, 0]]
    assert c["far_out"][0].tolist() == [[1, 0, 0, 0], [0, 0, 0, 0]]
    assert c["near_in"][0].tolist() == [[0, 1, 0, 0], [0, 0, 0, 1]]
    assert c["far_in"][0].tolist() == [[0, 0, 1, 0], [0, 0, 0, 0]]
    got = links.relay_seconds(hop, sender, COPY, LINKS)
    # Hop 1: rank 0's near (0.5 s) and far (2 s) copies run concurrently: 2 s. Hop 2: 0.5 s.
    assert got["seconds"].tolist() == [2.5]
    assert got["slow_copies"].tolist() == [1.0] and got["hops"].tolist() == [2.0]


def test_relay_seconds_charges_the_busiest_receiver():
    # Ranks 2 and 3 each send rank 0 one copy over the slow link in the same hop: each sender
    # takes 2 s, rank 0 receives two copies, 4 s.
    hop = np.array([[[1, 1], [0, 0], [0, 0], [0, 0]]])
    sender = np.array([[[2, 3], [4, 4], [4, 4], [4, 4]]])
    got = links.relay_seconds(hop, sender, COPY, LINKS)
    assert got["seconds"].tolist() == [4.0] and got["slow_copies"].tolist() == [2.0]


def test_exchange_seconds_by_hand():
    # Rank 0 sends 1 unit to rank 1 (near) and 3 to rank 2 (far); rank 3 sends 2 to rank 2 (near).
    units = np.zeros((4, 4))
    units[0, 1], units[0, 2], units[3, 2] = 1, 3, 2
    # Rank 0 out: max(1 * 2 / 4, 3 * 2 / 1) = 6; rank 2 in: max(2 * 2 / 4, 3 * 2 / 1) = 6.
    assert links.exchange_seconds(units, COPY, LINKS) == 6.0


def test_library_schedules_blind_and_aware_by_hand():
    # Expert 0 (master rank 0, domain 0) has replicas on ranks 2 and 3 (domain 1). Blind, f=2:
    # the master sends both over the slow link in hop 1 (4 s). Aware: one slow copy to the
    # gateway (rank 2) in hop 1 (2 s), which forwards to rank 3 over NVLink in hop 2 (0.5 s).
    held = np.array([[[-1], [-1], [0], [0]]], np.int32)
    blind = batched_schedule(4, 1, 2, None)(held)
    aware = batched_schedule(4, 1, 2, 2)(held)
    b = links.relay_seconds(*map(np.asarray, blind), COPY, LINKS)
    a = links.relay_seconds(*map(np.asarray, aware), COPY, LINKS)
    assert (b["slow_copies"][0], b["seconds"][0]) == (2.0, 4.0)
    assert (a["slow_copies"][0], a["seconds"][0]) == (1.0, 2.5)


def test_topologies_and_padding():
    assert topology_cells.topology("hgx-h100", 64).domain == 8
    assert topology_cells.topology("gb200-nvl72", 64).domain == 64
    two_racks = topology_cells.topology("gb200-nvl72", 128)
    assert two_racks.domain == 64 and two_racks.cluster.nvlink_domain == 64
    assert topology_cells.padded_experts(256, 128) == 256
    assert topology_cells.padded_experts(60, 32) == topology_cells.padded_experts(60, 64) == 64
    assert topology_cells.padded_experts(60, 128) is None
    assert topology_cells.trace_model("qwen1.5-moe").num_experts == 60


def test_aware_never_sends_more_across_domains_on_real_layers():
    if not (traces.default_traces_dir() / "deepseek-r1").is_dir():
        skip_without_traces("no deepseek-r1 trace")
    model, ep, experts = topology_cells.trace_model("deepseek-r1"), 32, 256
    _, loads = topology_cells.trace_loads("deepseek-r1", model, ep, experts, 8192, stride=116)
    assert len(loads) == 6  # 12 runs x 58 layers, every 116th
    plans = topology_cells.plan(
        loads, topology_cells.uep.BalancerConfig(num_experts=experts, ep_size=ep)
    )
    params = CostParams()
    copy_bytes = layer.replica_bytes(model, params)
    nodes = topology_cells.topology("hgx-h100", ep)
    link = params.calibration.links(nodes.cluster)
    blind = links.relay_seconds(*topology_cells.schedule(plans.held, 8, 2, None), copy_bytes, link)
    aware = links.relay_seconds(*topology_cells.schedule(plans.held, 8, 2, 8), copy_bytes, link)
    assert np.all(aware["slow_copies"] <= blind["slow_copies"])
    # The aware schedule's slow copies are the least possible: one per (expert, remote domain).
    home = np.arange(experts) // (experts // ep) // 8
    for n, held in enumerate(plans.held):
        ranks, cols = np.nonzero(held >= 0)
        domains = {(int(held[r, c]), r // 8) for r, c in zip(ranks, cols, strict=True)}
        least = sum(1 for e, d in domains if home[e] != d)
        assert aware["slow_copies"][n] == least
    # The program's rows agree, and in one NVL72 domain the two schedules are one and the same.
    rows = topology_cells.cell_rows("deepseek-r1", ep, plans, model, experts, nodes, 2, params, {})
    by = {r["policy"]: r for r in rows}
    assert by["aware"]["vs_blind"]["slow_more"] == 0
    assert by["none"]["transfer_ms"]["max"] == 0 and by["blind"]["pct_ideal"]["median"] > 90
    rack = topology_cells.topology("gb200-nvl72", ep)
    rows = topology_cells.cell_rows("deepseek-r1", ep, plans, model, experts, rack, 2, params, {})
    by = {r["policy"]: r for r in rows}
    assert by["aware"]["slow_gb"]["max"] == by["blind"]["slow_gb"]["max"] == 0
    assert by["aware"]["transfer_ms"] == by["blind"]["transfer_ms"]


def test_aware_plans_with_the_domains_on_real_layers():
    # The aware policy's plans are uep.plan's with ranks_per_domain = d (its targets prefer a
    # domain that already gets the expert); none and blind keep one domain. On 8-GPU nodes that
    # takes fewer slow-link copies than the aware schedule on one domain's plans; on one NVL72
    # domain (d = EP) the plans and rows are blind's.
    if not (traces.default_traces_dir() / "deepseek-r1").is_dir():
        skip_without_traces("no deepseek-r1 trace")
    model, ep, experts = topology_cells.trace_model("deepseek-r1"), 32, 256
    _, loads = topology_cells.trace_loads("deepseek-r1", model, ep, experts, 8192, stride=116)
    cfg = topology_cells.uep.BalancerConfig(num_experts=experts, ep_size=ep)
    one = topology_cells.plan(loads, cfg)
    aware = topology_cells.plan(loads, topology_cells.dataclasses.replace(cfg, ranks_per_domain=8))
    assert (aware.held != one.held).any()
    params = CostParams()
    nodes = topology_cells.topology("hgx-h100", ep)
    rows = topology_cells.cell_rows(
        "deepseek-r1", ep, one, model, experts, nodes, 2, params, {}, aware_plans=aware
    )
    same = topology_cells.cell_rows("deepseek-r1", ep, one, model, experts, nodes, 2, params, {})
    by, by_same = {r["policy"]: r for r in rows}, {r["policy"]: r for r in same}
    assert by["blind"] == by_same["blind"] and by["none"] == by_same["none"]
    assert by["aware"]["slow_gb"]["mean"] < by_same["aware"]["slow_gb"]["mean"]
    run = topology_cells.Run(traces=("deepseek-r1",), ep_sizes=(32,), stride=116)
    got = topology_cells.evaluate(run, {}, params, log=lambda line: None)
    assert [r for r in got if r["topology"] == "hgx-h100"] == rows
    rack = [r for r in got if r["topology"] == "gb200-nvl72"]
    assert rack == topology_cells.cell_rows(
        "deepseek-r1",
        ep,
        one,
        model,
        experts,
        topology_cells.topology("gb200-nvl72", ep),
        2,
        params,
        {},
    )


@pytest.mark.parametrize("trace", topology_cells.TRACES)
def test_every_trace_has_a_model_shape(trace):
    assert topology_cells.trace_model(trace).trace == trace
