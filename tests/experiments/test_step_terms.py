"""The step's split into terms (`experiments.lab.step_terms`): the scope rule, exclusive times of
nested events and the split of hand-made traces against hand-computed sums, and one real
profile of a jitted function whose scopes are known."""

import time

import jax
import jax.numpy as jnp
import pytest

from experiments.lab import step_terms


def _line(name: str, op: str, scope: str, root: bool = False) -> str:
    """One HLO instruction of a compiled module's text, traced under ``scope``."""
    head = "ROOT " if root else ""
    return f'  {head}%{name} = f32[4] {op}(f32[4] %b), metadata={{op_name="jit(step)/{scope}"}}'


HLO = "\n".join(
    [
        "HloModule jit_step, entry_computation_layout={()->f32[]}",
        "%body (p: f32[]) -> f32[] {",
        _line("k", "add", "routed_experts/plan/while/body/add"),
        "}",
        "ENTRY %main () -> f32[] {",
        _line("w.1", "while", "routed_experts/plan/while"),
        _line("all-to-all.2", "all-to-all", "routed_experts/dispatch/exchange/all_to_all"),
        _line("fusion.3", "fusion", "transpose(jvp(step))/experts/replica_transfer/psum"),
        _line("fusion.4", "fusion", "transpose(jvp(step))/routed_experts/experts/dot"),
        _line("dot.5", "dot", "attention/dot_general", root=True),
        "}",
    ]
)


def test_scopes_map_to_terms_most_specific_first():
    assert step_terms.term_of("jit(f)/routed_experts/experts/replica_transfer/x") == (
        "replica_transfer"
    )
    assert step_terms.term_of("jit(f)/transpose(jvp(f))/routed_experts/combine/exchange/a") == (
        "exchange"
    )
    assert step_terms.term_of("jit(f)/routed_experts/plan/all_gather") == "planner"
    assert step_terms.term_of("jit(f)/routed_experts/dispatch/sort") == "bookkeeping"
    assert step_terms.term_of("jit(f)/routed_experts/pair_experts") == "bookkeeping"
    assert step_terms.term_of("jit(f)/force_balanced/iota") == "ideal_assignment"
    assert step_terms.term_of("jit(f)/route/top_k") == "rest"
    # A component, not a substring: "planner_x" and "experts2" are no scope of the layer.
    assert step_terms.term_of("jit(f)/planner_x/experts2/dot") == "rest"
    terms = step_terms.instruction_terms(HLO)
    assert terms == {
        "k": "planner",
        "w.1": "planner",
        "all-to-all.2": "exchange",
        "fusion.3": "replica_transfer",
        "fusion.4": "experts",
        "dot.5": "rest",
    }
    assert step_terms.module_name(HLO) == "jit_step"


def _event(name, ts, dur, tid=1, module="jit_step"):
    return {
        "ph": "X",
        "pid": 1,
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "name": name,
        "args": {"hlo_module": module, "hlo_op": name},
    }


def test_exclusive_times_take_nested_events_out_of_their_parent():
    events = [_event("w.1", 0, 100), _event("k", 10, 30), _event("k", 50, 20), _event("x", 200, 5)]
    events.append(_event("y", 20, 10, tid=2))  # another thread: not nested
    got = {(e["name"], e["ts"]): x for e, x in step_terms.exclusive_times(events)}
    assert got == {("w.1", 0): 50, ("k", 10): 30, ("k", 50): 20, ("x", 200): 5, ("y", 20): 10}


def test_split_of_a_hand_made_trace_over_two_steps():
    events = []
    for t0 in (0, 1000):  # two steps, the same ops, times in microseconds
        events += [_event("w.1", t0, 100), _event("k", t0 + 10, 60)]
        events += [_event("all-to-all.2", t0 + 100, 40), _event("fusion.3", t0 + 140, 20)]
        events += [_event("fusion.4", t0 + 160, 300), _event("dot.5", t0 + 460, 80)]
    events.append(_event("fusion.4", 5000, 999, module="jit_other"))  # another module
    events.append({"ph": "X", "pid": 1, "tid": 1, "ts": 6000, "dur": 7, "name": "host"})
    split = step_terms.split_terms(events, HLO, steps=2)
    want = {"planner": 100, "exchange": 40, "replica_transfer": 20, "experts": 300, "rest": 80}
    for term in step_terms.TERMS:
        assert split["terms_s"][term] == pytest.approx(want.get(term, 0) * 1e-6), term
    assert split["collectives_s"] == pytest.approx(
        {t: (40e-6 if t == "exchange" else 0.0) for t in step_terms.TERMS}
    )
    with pytest.raises(ValueError, match="steps=0"):
        step_terms.split_terms(events, HLO, steps=0)
    with pytest.raises(ValueError, match="no 'HloModule'"):
        step_terms.module_name("ENTRY %main () -> f32[] {}")


def test_a_real_profile_splits_by_the_scopes_it_was_traced_under(tmp_path):
    def body(_, x):
        return jnp.tanh(x @ x) * 0.5

    @jax.jit
    def f(x):
        with jax.named_scope("plan"):
            y = jax.lax.fori_loop(0, 8, body, x)
        with jax.named_scope("experts"):
            z = jnp.tanh(y @ y)
        # A fusion takes its root's scope: the unscoped op is one XLA does not fuse with a dot.
        return z, jnp.sort(x, axis=0)

    x = jnp.full((128, 128), 0.01, jnp.float32)
    jax.block_until_ready(f(x))
    steps = 4
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        begin = time.perf_counter()
        for _ in range(steps):
            jax.block_until_ready(f(x))
        wall = (time.perf_counter() - begin) / steps
    split = step_terms.split_terms(
        step_terms.read_trace(tmp_path), f.lower(x).compile().as_text(), steps
    )
    terms = split["terms_s"]
    # Eight matmuls in the loop, one under "experts", a sort outside any scope.
    assert terms["planner"] > terms["experts"] > 0 and terms["rest"] > 0
    assert sum(terms.values()) <= wall
    assert all(v == 0 for k, v in terms.items() if k not in ("planner", "experts", "rest"))
