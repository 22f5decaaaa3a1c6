"""summary.md of a `experiments/gpu/run_all.sh` run: each figure that needs a GPU (planner,
exchanges, overlap, replay, GPU tests), read from the run's JSON and logs, whether its target is
met, and the command that produced it.

        bash experiments/gpu/run_all.sh --dry_run                # on a CPU: runs/gpu_all_dry
        python -m experiments.gpu.summary --dir=runs/gpu_all_dry
        python -m experiments.gpu.summary --dir=experiments/results/gpu_<UTC date>  # a GPU run

Reads, in ``--dir``: ``commands.tsv`` (part, exit code, seconds, command: one line per part run),
``env.txt``, ``tests_gpu.log``, ``gpu_check/gpu_results.json``, ``exchange/gpu_results.json``,
``gmm/gpu_results.json`` and ``replay_train.json`` / ``replay_prefill.json``; whatever is
missing is reported as not run.
"""

from __future__ import annotations

import json
import os
import re
import sys

from absl import flags

from experiments.lab.program import run_main
from experiments.lab.stepmodel import calibration, layer, shapes

_DIR = flags.DEFINE_string("dir", None, "The run_all.sh output folder.", required=True)

#: The planner bar (us per plan at EP64/E256/S2, one plan, CUDA events).
PLANNER_BAR_US = 20.0
#: The balancer's own cost bar (% of the expert time).
BALANCER_BAR_PCT = 3.0


def _load(folder: str, name: str):
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _lines(folder: str, name: str) -> list[str]:
    """The lines of ``folder/name`` without their newlines; none when the file is missing."""
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return f.read().splitlines()


def commands(folder: str) -> dict:
    """part -> (exit code, seconds, command) of the latest run of each part."""
    out = {}
    for line in _lines(folder, "commands.tsv"):
        part, rc, seconds, command = line.split("\t", 3)
        out[part] = (rc, seconds, command)
    return out


def environment(folder: str) -> dict:
    """``key: value`` lines of env.txt (before its nvidia-smi block)."""
    out = {}
    for line in _lines(folder, "env.txt"):
        if line.startswith("=="):
            break
        key, sep, value = line.partition(": ")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _cmd(cmds: dict, part: str) -> str:
    if part not in cmds:
        return f"(part {part} not run)"
    rc, seconds, command = cmds[part]
    return f"`{command}` (exit {rc}, {seconds} s)"


def tests_bar(folder: str, cmds: dict) -> list[str]:
    """tests/library/test_gpu.py and tests/experiments/test_gpu_planner.py pass."""
    path = os.path.join(folder, "tests_gpu.log")
    if not os.path.exists(path):
        return ["- not run"]
    with open(path) as f:
        tail = [line for line in f.read().splitlines() if line.strip()]
    result = next((ln for ln in reversed(tail) if re.search(r"passed|failed|error", ln)), "?")
    rc = cmds.get("tests", ("?",))[0]
    met = rc == "0" and "failed" not in result and "error" not in result
    return [f"- {result.strip('= ')}: {'MET' if met else 'NOT MET'}", f"- {_cmd(cmds, 'tests')}"]


def planner_bar(check: dict | None, cmds: dict) -> list[str]:
    """Planner <= 20 us per plan at EP64/E256/S2: the slowest of the three targets, per kernel
    the planner section timed (the key prefix names the kernel)."""
    p = (check or {}).get("planner")
    if not isinstance(p, dict):
        return ["- not run"]
    if "error" in p:
        return [f"- section failed: {p['error'][:300]}"]
    lines = [f"- CUDA plans == CPU plans: {p.get('status')}"]
    times = {
        key.removesuffix("event_us_single_by_target").rstrip("_") or "kernel": max(value)
        for key, value in p.get("time", {}).items()
        if key.endswith("event_us_single_by_target")
    }
    for kernel, us in times.items():
        lines.append(f"- {kernel}: {us:.1f} us per plan (slowest of targets 1.5 / 2 / 3)")
    if times:
        best = min(times.values())
        met = best <= PLANNER_BAR_US and p.get("status") == "ok"
        lines.append(
            f"- fastest {best:.1f} us vs bar {PLANNER_BAR_US:g} us: {'MET' if met else 'NOT MET'}"
        )
    else:
        lines.append("- time per plan: not measured (dry run, or no CUDA planner handler)")
    return lines + [f"- {_cmd(cmds, 'gpu_check')}"]


def _rate(r) -> str:
    if isinstance(r, dict) and "gbps" in r:
        return f"{r['gbps']:.3g} GB/s ({r['x_copy']:.2f}x copy)"
    return "skipped" if isinstance(r, str) and r.startswith("skipped") else "-"


def exchange_bar(exchange: dict | None, cmds: dict) -> list[str]:
    """Exchange throughput against a copy of the same bytes, per XLA flag variant, and the
    gradient checks."""
    e = (exchange or {}).get("exchange")
    if not isinstance(e, dict) or "variants" not in e:
        return ["- not run" if e is None else f"- section failed: {str(e)[:300]}"]
    s = e["setup"]
    lines = [
        f"- per rank: tokens {s['rows']} x D={s['d_model']} {s['dtype']}, weights {s['slots']} "
        f"experts of D={s['d_model']} F={s['d_ff']}",
        "",
        "| variant | tokens copy | tokens ragged | tokens padded | weights copy | weights ragged "
        "| weights padded | ragged grads == padded |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, v in e["variants"].items():
        if v.get("status") != "ok" and "tokens" not in v:
            lines.append(f"| {name} | {v.get('status')} |||||||")
            continue
        t, w = v.get("tokens", {}), v.get("weights", {})
        grads = v.get("grad_check", {})
        skipped = v.get("ragged")  # the dry run's reason
        lines.append(
            f"| {name} | {_rate(t.get('copy'))} | {_rate(t.get('ragged', skipped))} | "
            f"{_rate(t.get('padded'))} | {_rate(w.get('copy'))} | "
            f"{_rate(w.get('ragged', skipped))} | "
            f"{_rate(w.get('padded'))} | {grads.get('status', grads.get('error', '-'))} |"
        )
    correct = {
        name: v["tokens"]["ragged"]
        for name, v in e["variants"].items()
        if v.get("grad_check", {}).get("status") == "ok" and "ragged" in v.get("tokens", {})
    }
    if correct:
        name = max(correct, key=lambda n: correct[n]["gbps"])
        lines += ["", f"- fastest correct ragged token exchange: {name}, {_rate(correct[name])}"]
    return lines + ["", f"- {_cmd(cmds, 'exchange')}"]


def overlap_bar(exchange: dict | None, check: dict | None, cmds: dict) -> list[str]:
    """The replica transfer against the masters' matmuls in the compiled replica step (ragged
    backend), per XLA flag variant, and the first backward's check."""
    e = (exchange or {}).get("exchange")
    lines = []
    for name, v in (e or {}).get("variants", {}).items():
        step = v.get("replica_step")
        backend = next((b for b in ("ragged", "padded") if b in (step or {})), None)
        if not isinstance(step, dict) or backend is None:
            lines.append(f"- {name}: {v.get('status')} (no replica step)")
            continue
        verdicts = step[backend]["verdicts"]
        first = verdicts[0] if verdicts else "no collective in the schedule (XLA removed it?)"
        line = f"- {name}, {backend} backend: forward transfer {first}"
        check_ = step.get("first_backward_ragged_vs_padded")
        if check_:
            ok = "ok" if check_.get("ok") else "MISMATCH"
            diff = check_["max_rel_diff"]
            line += f"; first backward ragged vs padded: max rel diff {diff:.1e} ({ok})"
        lines.append(line)
    moe = (check or {}).get("moe")
    if isinstance(moe, dict) and "balanced_overlap" in moe:
        found = moe["balanced_overlap"] or ["no collective (EP=1: no balancer, no exchange)"]
        lines.append(f"- the layer's balanced step (moe section, EP=1): {'; '.join(found)}")
    return (lines or ["- not run"]) + [f"- {_cmd(cmds, 'exchange')}"]


def replay_bar(folder: str, cmds: dict) -> list[str]:
    """The replay table: busiest-rank expert time of none and ultraep, % of ideal, and the
    balancer's own cost as a share of the expert time."""
    lines = [
        "| workload | EP | mode | device | none experts ms (% ideal) "
        "| ultraep experts ms (% ideal) | x none | balancer % experts (added over none) "
        "| noise floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    shapes = []
    for part in ("replay_train", "replay_prefill"):
        for c in _load(folder, f"{part}.json") or []:
            shapes.append(c.get("shape"))
            n, u = c["rows"]["none"], c["rows"]["ultraep"]
            share = u.get("balancer_pct_experts", float("nan"))
            lines.append(
                f"| {c['workload']} | {c['ep']} | {c['mode']} | {c.get('device', '?')} | "
                f"{1e3 * n['experts_s']:.2f} ({n['experts_pct_ideal']:.1f} %) | "
                f"{1e3 * u['experts_s']:.2f} ({u['experts_pct_ideal']:.1f} %) | "
                f"{u['experts_x_none']:.2f} | {share:.1f} % "
                f"({u.get('balancer_added_pct_experts', float('nan')):.1f} %; bar "
                f"{BALANCER_BAR_PCT:g} %) | {c['noise_floor_pct']:.1f} % |"
            )
    if not shapes:
        return ["- not run"]
    lines += ["", f"- shape {shapes[0]}"]
    return lines + [f"- {_cmd(cmds, p)}" for p in ("replay_train", "replay_prefill") if p in cmds]


def best_gmm(folder: str) -> dict[str, float]:
    """kind of kernel -> its best forward + backward TFLOP/s in the run (empty: not run)."""
    c = (_load(folder, "gmm/gpu_results.json") or {}).get("gmm")
    if not isinstance(c, dict) or "sweep" not in c:
        return {}
    best: dict[str, float] = {}
    for row in c["sweep"] + c["shapes"]:
        kind = row["impl"].split()[0]
        if "fwd_bwd_tflops" in row:
            best[kind] = max(best.get(kind, 0.0), row["fwd_bwd_tflops"])
    return best


def gmm_bar(folder: str, cmds: dict) -> list[str]:
    """The grouped matmul's best fwd + bwd TFLOP/s per kind of kernel (no bar; for the record)."""
    best = best_gmm(folder)
    if not best:
        return ["- not run"]
    lines = [
        f"- {kind}: {tf:.3g} TFLOP/s forward + backward (best case)" for kind, tf in best.items()
    ]
    return lines + [f"- {_cmd(cmds, 'gmm')}"]


def model_lines(folder: str, cluster: str = "hgx-h100") -> list[str]:
    """The step model (`experiments.lab.stepmodel`) fed this run's fastest grouped matmul: the
    anchor's force-balanced layer (forward + backward) on ``cluster``, by term."""
    best = best_gmm(folder)
    if not best:
        return ["- not run (needs the gmm part)"]
    # The dense matmul is the reference of the same FLOPs, not a grouped kernel the layer runs.
    grouped = {k: v for k, v in best.items() if k != "dense"} or best
    kind, tflops = max(grouped.items(), key=lambda kv: kv[1])
    params = layer.CostParams(calibration=calibration.Calibration(expert_tflops=tflops))
    setup, hw = shapes.ANCHOR, shapes.CLUSTERS[cluster]
    t = layer.ideal_layer_time(setup.shape, setup.ep, hw, params)
    ms = {k: 1e3 * getattr(t, k) for k in ("experts", "a2a", "other")}
    return [
        f"- {setup.source} ({setup.model}, EP{setup.ep}, {setup.tokens_per_rank} tokens per "
        f"rank) on {hw.gpu}, experts at {kind}'s {tflops:.3g} TFLOP/s, the rest at the "
        f"model's nominal rates: experts {ms['experts']:.2f} ms, all-to-alls {ms['a2a']:.2f} ms, "
        f"attention and the rest {ms['other']:.2f} ms, layer {1e3 * t.total:.2f} ms (modelled)"
    ]


def summary_lines(folder: str) -> list[str]:
    """summary.md's lines."""
    cmds, env = commands(folder), environment(folder)
    check, exchange = (
        _load(folder, "gpu_check/gpu_results.json"),
        _load(folder, "exchange/gpu_results.json"),
    )
    lines = [
        "# GPU figures",
        "",
        f"commit {env.get('commit', '?')}, {env.get('date', '?')}; {env.get('devices', '?')}; "
        f"jax {env.get('jax', '?')}, jaxlib {env.get('jaxlib', '?')}; CUDA planner handler: "
        f"{env.get('cuda_planner_handler', '?')}"
        + (" (dry run on CPU)" if env.get("dry_run") == "1" else ""),
        "",
    ]
    bars = [
        (
            "tests/library/test_gpu.py and tests/experiments/test_gpu_planner.py pass (and jax "
            + env.get("jax", "?")
            + ")",
            tests_bar(folder, cmds),
        ),
        ("Planner <= 20 us at EP64/E256/S2 (CUDA events, one plan)", planner_bar(check, cmds)),
        ("Exchange throughput against a copy of the same bytes", exchange_bar(exchange, cmds)),
        (
            "The replica transfer overlapped with the masters' experts",
            overlap_bar(exchange, check, cmds),
        ),
        ("The replay at DeepSeek-V3 shape (DeepSeek-R1 trace)", replay_bar(folder, cmds)),
        ("Grouped matmul (no bar)", gmm_bar(folder, cmds)),
        ("The step model at this run's grouped-matmul rate (no bar)", model_lines(folder)),
    ]
    for title, body in bars:
        lines += [f"## {title}", "", *body, ""]
    return lines


def main(argv):
    """Writes summary.md into ``--dir`` and prints it; one line ``error: ...`` (exit code 2)
    when ``--dir`` is no folder."""
    del argv
    if not os.path.isdir(_DIR.value):
        print(
            f"error: --dir={_DIR.value} is not a folder: give the folder run_all.sh wrote "
            "(its --out)",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(2)
    text = "\n".join(summary_lines(_DIR.value))
    with open(os.path.join(_DIR.value, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    run_main(main)
