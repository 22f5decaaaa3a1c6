"""The layer where the EP groups of different data (or FSDP) rows get different plans.

Each index of the token axes other than the EP axis is an independent EP group with its own plan
(`uep.ExpertParallel.token_axes`), so groups take different plan-chosen branches (the replica
transfer's `lax.cond`, its slot-column `lax.switch`, a relay hop's `lax.cond`). A collective over
the data axis inside such a branch, forward or transposed, deadlocks (XLA:CPU aborts after 40 s,
"Termination timeout for all reduce"; DESIGN.md section 13). Each case below makes the two groups'
plans differ in one way, asserts that they do (the per-group plans of the reference routing's
loads, which the layer's `MoEStats` must add up to), and checks the balanced layer's output and
gradients against plain EP (``balancer=None``) and the dense one-device reference, on a data x EP
mesh and on MaxText's FSDP x EP layout (weights split over "fsdp" too), and in two processes under
`jax.distributed` (`divergent_multihost_worker.py`).

The ways to diverge:
  masked_group: one group's tokens are all padding (``token_mask``), the other replicates.
  balanced_group: one group's loads are already balanced (its plan has no replica: plain EP's
    branch), the other replicates; no token masked. (``min_tokens_per_rank`` cannot make groups
    diverge: it is decided on the static tokens per device, the same in every group.)
  slot_columns: one group fills 2 slot columns, the other 1 (the dense transfer's switch).
  relay_hops: with ``max_fanout=1`` one group's replicas take 2 relay hops, the other's 1 (a
    relay hop's `lax.cond`; relays exist on the ragged path only, run here with
    `jax.lax.ragged_all_to_all` lowered to its exact emulation, `helpers.ragged_emulation`).
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers.divergent import (
    DIVERGENCES,
    GROUPS,
    assert_plans_differ,
    assert_same_results,
    assert_stats_of_groups,
    run_divergence,
    save_run,
)

# One test process compiles the layers this file caches (pytest-xdist).
# Every case on each JAX line (conftest.py, --suite=quick): what it checks is what a JAX version
# compiles.
pytestmark = [pytest.mark.xdist_group("test_divergent_plans"), pytest.mark.every_case]

WORKER = pathlib.Path(__file__).with_name("divergent_multihost_worker.py")
#: How long the two worker processes may take (cold, on 2 busy cores: 130 s); a hang is killed.
WORKER_SECONDS = 300


def _marks(name: str, mesh_kind: str) -> list:
    """The relay case on the FSDP mesh compiles the ragged path once more (12 s of CPU, the
    file's costliest compile): slow."""
    relayed = DIVERGENCES[name].max_fanout is not None
    return [pytest.mark.slow] if relayed and mesh_kind == "fsdp" else []


#: (divergence, mesh) pairs: every divergence on both meshes.
CASES = [
    pytest.param(name, mesh_kind, marks=_marks(name, mesh_kind))
    for name in DIVERGENCES
    for mesh_kind in ("data", "fsdp")
]


@pytest.mark.parametrize("name, mesh_kind", CASES)
def test_groups_plans_differ(name, mesh_kind):
    """The inputs give the groups different plans, and the layer ran those plans."""
    res, balancer = run_divergence(name, mesh_kind), DIVERGENCES[name].balancer
    assert_plans_differ(name, res["loads"], res["plans"], balancer)
    stats = res["balanced"][1]
    assert_stats_of_groups(stats, res["loads"], res["plans"], balancer)
    assert int(stats["masked"]) == int(np.sum(~res["mask"]))


@pytest.mark.parametrize("name, mesh_kind", CASES)
def test_output_and_grads_equal_plain_ep_and_reference(name, mesh_kind):
    """Forward and backward with the groups' plans differing: the balanced layer equals plain EP
    and the dense reference (and plain EP the reference)."""
    res = run_divergence(name, mesh_kind)
    assert_same_results(res["balanced"], res["plain"], f"{name} balanced vs plain EP")
    assert_same_results(res["balanced"], res["ref"], f"{name} balanced vs dense reference")
    assert_same_results(res["plain"], res["ref"], f"{name} plain EP vs dense reference")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two processes start, import and compile: 40 s of CPU
def test_two_processes_as_the_two_groups(tmp_path):
    """Under `jax.distributed`, each process one data row (its 4 devices one EP group), the
    groups' plans differing (one group all padding): value and gradients finish and equal the
    single-process run (`divergent_multihost_worker.py`)."""
    results = tmp_path / "single_process.npz"
    save_run(results, run_divergence("masked_group", "data")["balanced"])
    address = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    # No persistent compilation cache: on jax 0.12.1 two CPU processes that load their program
    # from it hang in the first collective (a cold cache passes), so a second run would hang.
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), address, str(i), str(results)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(GROUPS)
    ]
    deadline = time.monotonic() + WORKER_SECONDS
    try:
        for i, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"the two processes did not finish in {WORKER_SECONDS} s (a hang)")
            assert proc.returncode == 0, err[-3000:]
            assert f"process {i}: ok" in out
    finally:
        for proc in procs:  # a hung worker ignores SIGTERM (JAX's preemption notifier)
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
