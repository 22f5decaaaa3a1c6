"""The parent side of the GPU check's exchange section (`experiments.gpu.exchange`): one child
process per XLA flag variant (XLA reads ``XLA_FLAGS`` once, when its backend starts, and aborts
on a flag it does not know), its result or the reason there is none, and the section's lines."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

from experiments.gpu.exchange import DRY, ExchangeSetup
from experiments.lab.output_files import write_json

#: XLA flag variants the section compares by default: name -> flags (space-separated).
VARIANTS = {
    "default": "",
    "decomposer": "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true",
    "one_shot_off": "--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false",
    "device_kernel": "--xla_gpu_experimental_ragged_all_to_all_use_device_kernel=true",
    "latency_hiding": "--xla_gpu_enable_latency_hiding_scheduler=true",
}
_UNKNOWN_FLAG = re.compile(r"Unknown flags? in XLA_FLAGS:\s*(.*)")


@dataclasses.dataclass(frozen=True)
class ExchangeRun:
    """What the section runs (the ``--exchange_*`` flags).

    Attributes:
      variants: name -> XLA flags (space-separated; "" for XLA's defaults).
      setup: the sizes (`DEEPSEEK_V3`; the dry run uses `DRY`).
      timeout_s: seconds one variant's child may take.
      out_dir: where each child's log, JSON and compiled step go (None: a temporary folder).
    """

    variants: dict
    setup: ExchangeSetup
    timeout_s: float
    out_dir: str | None


def parse_variants(entries) -> dict:
    """name -> flags from ``--exchange_variants`` entries: a name of `VARIANTS`, or flags
    (``--xla_...=v``, several joined by ``+``), named after themselves."""
    out = {}
    for entry in entries:
        if entry in VARIANTS:
            out[entry] = VARIANTS[entry]
        elif entry.startswith("--"):
            out[entry] = " ".join(entry.split("+"))
        else:
            raise ValueError(
                f"unknown exchange variant {entry!r}; expected one of {list(VARIANTS)}"
            )
    return out


def _child_env(flags: str, dry: bool) -> dict:
    env = dict(os.environ)
    base = env.get("XLA_FLAGS", "")
    if dry:
        env["JAX_PLATFORMS"] = "cpu"
        base = re.sub(r"--xla_force_host_platform_device_count=\d+", "", base)
        base += " --xla_force_host_platform_device_count=4"
    else:
        # The parent process holds GPU memory of its own: take what the child needs, no more.
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env["XLA_FLAGS"] = f"{base} {flags}".strip()
    return env


def file_stem(name: str) -> str:
    """A variant's name as a file name (a raw flag's dashes and "=" replaced)."""
    return re.sub(r"[^\w.]+", "_", name).strip("_")


def run_child(name: str, flags: str, spec: dict, folder: str, dry: bool, timeout_s: float) -> dict:
    """One variant in a child process: its JSON, or a status saying why there is none."""
    spec_path = os.path.join(folder, f"exchange_{file_stem(name)}_spec.json")
    log_path = os.path.join(folder, f"exchange_{file_stem(name)}.log")
    write_json(spec_path, spec)
    cmd = [sys.executable, "-m", "experiments.gpu.exchange_child", spec_path]
    try:
        done = subprocess.run(
            cmd, env=_child_env(flags, dry), capture_output=True, text=True, timeout=timeout_s
        )
        log, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        log, rc = f"{e.stdout or ''}{e.stderr or ''}", None
        log = log.decode() if isinstance(log, bytes) else log
    with open(log_path, "w") as f:
        f.write(log)
    unknown = _UNKNOWN_FLAG.search(log)
    result = {}
    if os.path.exists(spec["out_json"]):
        with open(spec["out_json"]) as f:
            result = json.load(f)
    if unknown:
        status = f"flag not known to this jaxlib ({unknown.group(1).strip()})"
        return {"status": status, "xla_flags": flags}
    if rc is None:
        status = f"timed out after {timeout_s:g} s (parts done: {sorted(result)})"
    elif rc != 0:
        status = f"failed (exit {rc}): {log.strip().splitlines()[-1][:300] if log.strip() else ''}"
    else:
        status = "ok"
    return {**result, "status": status, "xla_flags": flags}


def section_exchange(device, dry: bool, run: ExchangeRun) -> dict:
    """Every variant of ``run`` in a child process (see the module docstring)."""
    del device  # the children use every GPU (or, dry, 4 CPU devices)
    setup = DRY if dry else run.setup
    out = {"setup": dataclasses.asdict(setup), "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = run.out_dir or tmp
        os.makedirs(folder, exist_ok=True)
        for name, flags in run.variants.items():
            stem = file_stem(name)
            spec = {
                "setup": dataclasses.asdict(setup),
                "dry": dry,
                "variant": name,
                "out_json": os.path.join(folder, f"exchange_{stem}.json"),
                "hlo_path": os.path.join(folder, f"replica_step_hlo_{stem}")
                if run.out_dir
                else None,
            }
            if os.path.exists(spec["out_json"]):
                os.remove(spec["out_json"])
            print(f"  exchange variant {name}: XLA_FLAGS += {flags!r}", flush=True)
            out["variants"][name] = run_child(name, flags, spec, folder, dry, run.timeout_s)
            print(f"  exchange variant {name}: {out['variants'][name]['status']}", flush=True)
    return out


def _rate_text(r) -> str:
    if isinstance(r, str):
        return r.split(":")[0]  # "skipped"
    if not isinstance(r, dict) or "gbps" not in r:
        return "-"
    return f"{r['ms']:.3g} ms {r['gbps']:.3g} GB/s ({r['x_copy']:.2f}x copy)"


def exchange_lines(d: dict) -> list[str]:
    """The exchange section's results as table lines."""
    s = d["setup"]
    lines = [
        f"(e) exchanges per rank: tokens {s['rows']} x D={s['d_model']} {s['dtype']}; replica "
        f"weights {s['slots']} slots x (D={s['d_model']}, F={s['d_ff']}); GB/s = payload bytes "
        "per rank / time; 'x copy' = throughput / a device copy's of the same bytes"
    ]
    for name, v in d["variants"].items():
        lines.append(f"   [{name}] {v.get('xla_flags') or '(XLA defaults)'}: {v['status']}")
        for part in ("tokens", "weights"):
            p = v.get(part)
            if isinstance(p, dict) and "copy" in p:
                ragged = _rate_text(p.get("ragged", v.get("ragged")))
                lines.append(
                    f"      {part:<8} copy {_rate_text(p['copy'])} | ragged {ragged} | "
                    f"padded {_rate_text(p.get('padded'))}"
                )
        g = v.get("grad_check")
        if isinstance(g, dict):
            lines.append(f"      gradients ragged vs padded: {g.get('status', g.get('error'))}")
        step = v.get("replica_step", {})
        for backend in ("ragged", "padded"):
            row = step.get(backend) if isinstance(step, dict) else None
            if row:
                first = row["verdicts"][0] if row["verdicts"] else "no collective in the schedule"
                lines.append(
                    f"      replica step {backend}: {row['ms']:.2f} ms; forward transfer: {first}"
                )
        if isinstance(step, dict) and "first_backward_ragged_vs_padded" in step:
            c = step["first_backward_ragged_vs_padded"]
            lines.append(
                f"      replica step first backward ragged vs padded: max rel diff "
                f"{c['max_rel_diff']:.2e} ({'ok' if c['ok'] else 'MISMATCH'})"
            )
    return lines
