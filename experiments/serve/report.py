"""The readable report of a prefill run's results (`experiments.serve.main.run`); a module of
its own, without flags, so that tests can import it."""

from __future__ import annotations

from experiments.lab.concurrency import concurrency_line
from experiments.lab.program import fallback_note

MODE_NAMES = {"ultraep": "balanced (ultraep)", "none": "plain EP (none)"}


def _clock_note(res: dict) -> str:
    """What the prefill ratio measures where it is not the busiest rank's clock."""
    if res["pinned_ranks"] or res["device"] != "cpu" or res["devices"] < 2:
        return ""
    return (
        f"(the prefill times on {res['devices']} simulated CPU devices in one process are the "
        "total work of every rank, not the busiest rank's time: --pinned_ranks=2 measures that)"
    )


def _mesh_text(res: dict) -> str:
    """``EP=8 x data=1``, and ``x tensor=t`` where a tensor axis splits the experts."""
    mesh = res["mesh"]
    text = f"EP={mesh['expert']} x data={mesh['data']}"
    return text + (f" x tensor={mesh['tensor']}" if mesh.get("tensor", 1) > 1 else "")


def _tensor_note(res: dict) -> str:
    """How a workdir trained with a tensor axis is served: with its own size, or another."""
    sizes = res.get("tensor_size")
    if not sizes or sizes["served"] == sizes["trained"] == 1:
        return ""
    served, trained = sizes["served"], sizes["trained"]
    split = "whole on each EP rank" if served == 1 else f"split over {served} devices"
    if served == trained:
        return (
            f"each expert's hidden width {split}, as trained (the workdir's --tensor_size="
            f"{trained}; --tensor_size chooses another)"
        )
    return (
        f"note: trained with --tensor_size={trained}, served with --tensor_size={served}: the "
        f"same weights, each expert's hidden width {split}: the same predictions, to float "
        "rounding"
    )


def _mode_lines(mode: str, r: dict, clock: str) -> list[str]:
    """One mode's prefill line and its per-layer table."""
    cf = r["capacity_factor"]
    lines = [
        f"\n{MODE_NAMES[mode]}, capacity {'dropless' if cf is None else f'{cf:g}'}: prefill "
        f"{r['prefill_ms']:.2f} ms ({clock}median), {r['tokens_per_s']:,.0f} tokens/s, "
        f"compile {r['compile_s']:.1f} s",
        f"{'layer':>7} {'max/mean before':>16} {'after':>7} {'dropped':>8} {'replicas':>9} "
        f"{'masked':>7}",
    ]
    for i in range(len(r["dropped"])):
        lines.append(
            f"{i:7d} {r['imbalance_before'][i]:16.3f} {r['imbalance_after'][i]:7.3f} "
            f"{r['dropped'][i]:8d} {r['replicas'][i]:9d} {r['masked'][i]:7d}"
        )
    return lines


def _comparison_lines(res: dict, n: int) -> list[str]:
    """Balanced against plain (when both ran): the time ratio, and how many of the ``n``
    prompts' next-token predictions agree."""
    bal, plain = res["runs"]["ultraep"], res["runs"]["none"]
    same = sum(a == b for a, b in zip(bal["next_token"], plain["next_token"], strict=True))
    diff = max(abs(a - b) for a, b in zip(bal["next_logprob"], plain["next_logprob"], strict=True))
    # On the fallback both modes ran plain EP: a ratio of two identical programs says nothing.
    timing = (
        "balanced / plain prefill time: not compared (the balanced prefill ran plain EP)"
        if res["fallback"]
        else f"balanced / plain prefill time: {bal['prefill_ms'] / plain['prefill_ms']:.3f}"
    )
    lines = [
        f"\n{timing}; next-token predictions the same for {same} of {n} prompts (largest "
        f"log-probability difference {diff:.2g})"
    ]
    if not res["fallback"] and _clock_note(res):
        lines.append(_clock_note(res))
    return lines


def _decode_lines(res: dict) -> list[str]:
    """The greedy decode's line (when it ran) and each prompt's next tokens and continuation."""
    dec = res["decode"]
    lines = []
    if dec["steps"]:
        lines.append(
            f"\ngreedy continuations: {dec['steps']} decode steps on the {dec['path']} path "
            f"({dec['tokens_per_rank']} tokens per rank per step: no KV cache, each step runs the "
            f"{dec['window'][1]}-token window), {dec['seconds_with_compile']:.1f} s with compile"
        )
    for p in res["prompts"]:
        nxt = " / ".join(f"{m}: {t!r}" for m, t in p["next_token"].items())
        continues = f"; continues {p['continuation']!r}" if dec["steps"] else ""
        lines.append(f"  {p['file']} ({p['tokens']} tokens): next {nxt}{continues}")
    return lines


def report(res: dict) -> str:
    """The readable report of `run`'s results."""
    m = res["model"]
    B, T = res["batch"]
    n = len(res["prompts"])
    lines = [
        f"prefill of {n} prompts ({res['prompt_tokens']} tokens; batch padded to {B} x {T}, "
        f"{B * T - res['prompt_tokens']} padding tokens masked) with the step-"
        f"{res['checkpoint_step']} checkpoint of {res['workdir']}: {m['num_layers']} layers, "
        f"D={m['d_model']}, E={m['num_experts']} top-{m['top_k']}, {_mesh_text(res)} on "
        f"{res['devices']} {res['device']} devices"
        + (" (pinned processes)" if res["pinned_ranks"] else "")
    ]
    if _tensor_note(res):
        lines.append(_tensor_note(res))
    if "calibration" in res:
        lines.append(concurrency_line(res["calibration"]))
    clock = "busiest rank's " if res["pinned_ranks"] else ""
    if res["fallback"]:
        threshold = res["balancer"]["min_tokens_per_rank"]
        subject = "the balanced prefill runs"
        lines.append(fallback_note(res["tokens_per_rank"], threshold, subject))
    for mode, r in res["runs"].items():
        lines += _mode_lines(mode, r, clock)
    if len(res["runs"]) == 2:
        lines += _comparison_lines(res, n)
    lines += _decode_lines(res)
    return "\n".join(lines)
