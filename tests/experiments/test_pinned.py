"""The replica transfer's slot-column branches, and ranks as pinned processes (the launcher, the
calibration and the MoE bench in that mode)."""

import io
import json
import os
import subprocess
import sys
import threading

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.lab import pinned_ranks
from experiments.lab.pinned_ranks import _forward_lines, is_rank_library_line, launch_pinned_ranks
from tests.helpers import expert_mesh, fetch_with_grads
from tests.xla_settings import program_env
from ultraep_jax.replicas import transfer

# End-to-end runs of the programs (seconds to minutes each): `-m "not slow"` skips them.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "slots, want",
    [
        ([[-1, -1], [-1, -1]], 0),
        ([[3, -1], [-1, -1]], 1),
        ([[-1, -1], [-1, 0]], 2),
        ([[-1, 2], [1, -1]], 2),
        ([[5, 6, -1], [7, -1, -1]], 2),
    ],
)
def test_active_slots_counts_the_leading_columns_in_use(slots, want):
    assert int(transfer.active_slots(jnp.asarray(slots, jnp.int32))) == want


def _reference_fetch(masters, slot_expert):
    """NumPy: each slot gets its expert's weights from the full [E, ...] tensors, zeros if empty."""
    return [
        np.stack([w[e] if e >= 0 else np.zeros_like(w[0]) for e in row])
        for w in masters
        for row in [slot_expert.reshape(-1)]
    ]


@pytest.mark.parametrize("backend", ["padded", "auto"])
@pytest.mark.parametrize(
    "slot_expert",
    [
        [[-1, -1]] * 4,  # no replica: no exchange at all
        [[5, -1], [-1, -1], [0, -1], [-1, -1]],  # first column only
        [[5, 7], [-1, 2], [0, -1], [-1, 3]],  # both columns
        [[-1, -1], [-1, 6], [-1, -1], [-1, -1]],  # second column only
    ],
)
def test_fetch_replica_experts_and_its_gradient_equal_numpy(slot_expert, backend):
    R, em, S = 4, 2, 2
    E = R * em
    mesh = expert_mesh(R)
    rng = np.random.default_rng(0)
    masters = [
        rng.normal(size=(E, 3, 5)).astype(np.float32),
        rng.normal(size=(E, 4)).astype(np.float32),
    ]
    slot_expert = np.asarray(slot_expert, np.int32)
    cot = [rng.normal(size=(R * S, *w.shape[1:])).astype(np.float32) for w in masters]
    got, grads = fetch_with_grads(mesh, masters, slot_expert, cot, backend=backend)
    for g, want in zip(got, _reference_fetch(masters, slot_expert), strict=True):
        np.testing.assert_array_equal(np.asarray(g), want)
    # The gradient of each master: the sum of the cotangents of the slots that hold it.
    flat = slot_expert.reshape(-1)
    for g, c, w in zip(grads, cot, masters, strict=True):
        want = np.zeros_like(w)
        for i, e in enumerate(flat):
            if e >= 0:
                want[e] += c[i]
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-6)


def test_launch_pinned_ranks_refuses_more_ranks_than_cores():
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="needs that many cores"):
        launch_pinned_ranks(cores + 1, "experiments.bench.moe", [])


# As the ranks print them (two ranks at once interleave them on a shared terminal).
_GLOO_LINE = (
    "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
)
_JAX_LINE = (
    "I1124 16:30:04.316648 139756629298048 distributed.py:172] Connecting to JAX distributed "
    "service on 127.0.0.1:52289\n"
)


def test_rank_library_lines_are_left_out_unless_verbose():
    own = ["calibration: 2 pinned ranks with equal work take 1.6 ms\n", "step     1  loss 6.1\n"]
    own.append("I see [Gloo] in the middle of a line\n")
    assert is_rank_library_line(_GLOO_LINE) and is_rank_library_line(_JAX_LINE)
    assert not any(is_rank_library_line(line) for line in own)
    text = "".join([_GLOO_LINE, own[0], _JAX_LINE, *own[1:]])
    for verbose, want in ((False, "".join(own)), (True, text)):
        sink = io.StringIO()
        _forward_lines(io.BytesIO(text.encode()), sink, verbose, threading.Lock())
        assert sink.getvalue() == want


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_moe_bench_on_two_pinned_ranks(tmp_path):
    out = tmp_path / "moe.json"
    cmd = [sys.executable, "-m", "experiments.bench.moe", "--pinned_ranks=2", "--repeats=1"]
    cmd += ["--d_model=16", "--d_ff=32", "--num_experts=8", "--tokens_per_device=128"]
    cmd += ["--seq_len=32", "--skew=4", f"--json_out={out}"]
    env = program_env()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "calibration: 2 pinned ranks" in done.stdout
    # Only the program's own lines: not gloo's nor JAX's as the ranks join.
    assert "Gloo" not in done.stdout + done.stderr, done.stdout[:2000]
    assert "distributed.py" not in done.stderr, done.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["config"]["ep_size"] == 2 and res["config"]["devices"] == 2
    assert res["calibration"]["processes"] == 2 and res["calibration"]["ratio"] > 0
    # Real-time priority is opt-in (--realtime_ranks): the ranks of a test run at normal priority.
    assert res["calibration"]["realtime"] is False
    assert "not at real-time priority" in done.stdout
    runs = res["runs"]
    pairs = 2 * 2 * 128  # ranks x top_k x tokens per rank
    for run in runs.values():
        assert sum(run["rank_load_before"]) == pairs
        assert run["temp_mib"] > 0 and run["minor_faults"] >= 0
    assert res["config"]["malloc"] == "keep"  # pinned ranks keep freed memory by default
    # The hot experts all sit on rank 0; balancing brings it within the buffer, plain EP drops.
    before = runs["balanced_capped"]["rank_load_before"]
    assert before[0] > before[1]
    assert runs["balanced_capped"]["dropped"] == 0
    assert runs["plain_capped"]["dropped"] == before[0] - runs["plain_capped"]["buffer_rows"]
    assert max(runs["balanced_capped"]["rank_load_after"]) <= runs["balanced_capped"]["buffer_rows"]
    # The force-balanced ideal spreads the pairs evenly over the ranks and drops none.
    assert runs["ideal_capped"]["rank_load_after"] == [pairs // 2] * 2
    assert runs["ideal_capped"]["dropped"] == 0


def test_ranks_take_real_time_priority_only_when_asked(monkeypatch):
    """A rank's set-up pins it to its core, and raises its scheduling class only with
    ``realtime`` (``--realtime_ranks``, off by default): it would starve the machine's other
    work."""
    calls = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: calls.append(("pin", cores)))
    monkeypatch.setattr(os, "sched_setscheduler", lambda *a: calls.append(("realtime",)))
    pinned_ranks._pin(1, realtime=False)()
    assert calls == [("pin", {1})]
    pinned_ranks._pin(1, realtime=True)()
    assert calls[1:] == [("pin", {1}), ("realtime",)]
    assert pinned_ranks.realtime_requested() is False  # the flag's default
