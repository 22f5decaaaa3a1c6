"""Prefill a batch of prompts with the model of a trained workdir, balanced against plain expert
parallelism, and show what the model predicts.

    python -m experiments.train                  # the main job: runs/default
    python -m experiments.serve --workdir=runs/default   # prompts: experiments/serve/prompts
    python -m experiments.serve --workdir=runs/default --prompts='my/*.txt' --balance=ultraep
    # EP=2 as two processes pinned to a core each (the prefill time is the busiest rank's):
    python -m experiments.serve --workdir=runs/default --prompts=experiments/serve/prompts \
        --pinned_ranks=2

``experiments/serve/prompts`` (the default ``--prompts``) holds 24 short prompts of Python
source (the default run's training text): padded into 24 x 93 tokens, 279 per rank on 8
devices, above the default ``--min_tokens_per_rank=256``, so the balanced prefill balances.

A workdir trained with ``--tensor_size=t`` (each expert's hidden width split over t devices) is
served on a (data, expert, tensor) mesh with the same t; ``--tensor_size`` chooses another (the
weights are the same, split over that many devices, and so are the predictions), and the report
says which it served with. ``--planner``, ``--max_fanout``, ``--transfer_chunks`` and
``--ranks_per_domain`` choose how the balanced prefill runs, as in experiments.train.

Each prompt file is one prompt (its bytes are the tokens, as in training). The prompts are padded
into one batch, at the end of each row and with empty rows up to a multiple of the devices that
split the tokens (all but the tensor axis's), and
the token mask routes the padding to no expert: it adds no load, takes no buffer row and changes
no prediction. For each mode (``--balance=both``: balanced, then plain EP, on the same batch) the
run prints per MoE layer the max/mean rank load before and after balancing, dropped pairs,
replicas and masked tokens, the prefill's compile time, median time and tokens/s (with
``--pinned_ranks`` the wall clock is the busiest rank's, and a calibration line says how close),
whether both modes predict the same next tokens, and a greedy continuation of every prompt
(``--new_tokens`` decode steps on the fallback path: plain EP, dropless).

Writes ``--output`` (default ``<workdir>/serve.json``): per prompt its file, length, next-token
prediction and log-probability in each mode, and the continuation; the figures above.

Problems with the flags, the workdir (missing, not a training run, no checkpoint) or the prompts
(none, an empty file, a prompt longer than the model's ``max_seq_len``) end with one line
``error: ...`` (exit code 2).
"""

from __future__ import annotations

import dataclasses
import sys
import time

from absl import flags, logging

from experiments.lab import cli, dataclass_flags
from experiments.lab.concurrency import concurrency_check
from experiments.lab.devices import force_cpu_devices
from experiments.lab.output_files import check_output_path, write_json
from experiments.lab.pinned_ranks import keep_freed_memory, launch_pinned_ranks, start_distributed
from experiments.lab.program import fail
from experiments.lab.training.config import balancer_options, execution_of
from experiments.lab.training.mesh_sizes import mesh_sizes
from experiments.lab.walltime import median_seconds
from experiments.serve.config import OUTPUT_FILE, ServeConfig
from experiments.serve.prompts import Prompt, as_text, pad_batch, read_prompts
from experiments.serve.report import report

_VALUES = dataclass_flags.define_flags(ServeConfig, {"capacity_factor": cli.parse_capacity_factor})
flags.DEFINE_integer(
    "cpu_devices", 8, "Simulated CPU devices per process when there is no accelerator."
)
flags.DEFINE_integer(
    "pinned_ranks",
    0,
    "Run as this many processes started by this command, one CPU device each, each pinned to a "
    "core of its own (so that the prefill time is the busiest rank's); 0: one process.",
)
cli.define_rank_flags()  # read as FLAGS.coordinator_address, ...

FLAGS = flags.FLAGS


def main(argv):
    """Prefills and reports; exits 2 with one line ``error: ...`` when the flags, the workdir or
    the prompts cannot be used."""
    logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
    if len(argv) > 1:
        fail(f"unexpected arguments: {' '.join(argv[1:])}")
    try:  # checked before starting any process: bad input ends with one line
        cfg = ServeConfig(**_VALUES())
        workdir, train_cfg = _engine().read_train_config(cfg.workdir)
        prompts = read_prompts(cfg.prompts, train_cfg.model.max_seq_len)
        output = cfg.output or str(workdir / OUTPUT_FILE)
        check_output_path(output, "--output")
    except ValueError as err:  # RunError included
        fail(err)
    if FLAGS.pinned_ranks and FLAGS.num_processes == 1:  # this process only starts the ranks
        try:
            sys.exit(launch_pinned_ranks(FLAGS.pinned_ranks, "experiments.serve", sys.argv[1:]))
        except ValueError as err:
            fail(err)
    if FLAGS.num_processes > 1:
        keep_freed_memory()  # a pinned rank: time the prefill, not the page faults
    try:
        force_cpu_devices(FLAGS.cpu_devices)
        start_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
        result = run(cfg, workdir, train_cfg, prompts, pinned=bool(FLAGS.pinned_ranks))
    except ValueError as err:
        fail(err)
    import jax

    if jax.process_index() == 0:
        print(report(result), flush=True)
        write_json(output, result)
        print(f"wrote {output}", flush=True)


def _engine():
    # Imported late: it imports JAX, which must not start before the devices are set up.
    from experiments.serve import engine

    return engine


def _serve_mesh(cfg: ServeConfig, train_cfg):
    """(mesh, (data, expert, tensor) sizes) the prefill runs on: ``cfg``'s EP and tensor sizes
    over every device (the trained tensor size by default)."""
    import jax

    from experiments.lab.training.build import make_mesh

    model_cfg = train_cfg.model
    sizes = mesh_sizes(
        jax.device_count(),
        ep_size=cfg.ep_size,
        tensor_size=cfg.tensor_size or train_cfg.tensor_size,
        num_experts=model_cfg.num_experts,
        d_ff=model_cfg.d_ff,
        ranks_per_domain=cfg.ranks_per_domain,
        transfer_chunks=cfg.transfer_chunks,
    )
    return make_mesh(*sizes), sizes


def _balancer(cfg: ServeConfig, train_cfg):
    """The balanced prefill's `uep.BalancerConfig` (the trained slots per rank by default)."""
    import ultraep_jax as uep

    return uep.BalancerConfig(
        slots_per_rank=cfg.slots_per_rank or train_cfg.slots_per_rank,
        min_tokens_per_replica=cfg.min_tokens_per_replica,
        balance_eps=cfg.balance_eps,
        min_tokens_per_rank=cfg.min_tokens_per_rank,
        **balancer_options(cfg.max_fanout, cfg.ranks_per_domain),
    )


def _prefill_run(model, mesh, args, repeats: int, num_prompts: int, real: int) -> dict:
    """One mode's prefill of ``args`` (tokens, mask, lengths on ``mesh``): its first call's
    seconds (compiling), the median of ``repeats`` more, the next token and its log-probability
    of each of the ``num_prompts`` prompts (``real`` tokens in all), and the layers' stats."""
    import jax
    import numpy as np

    prefill = _engine().prefill_step(model, mesh)
    start = time.perf_counter()
    ids, logp, stats = jax.device_get(jax.block_until_ready(prefill(*args)))
    compile_s = time.perf_counter() - start
    seconds = median_seconds(lambda prefill=prefill: prefill(*args), repeats)
    return {
        "compile_s": compile_s,
        "prefill_ms": seconds * 1e3,
        "tokens_per_s": real / seconds,
        "next_token": ids[:num_prompts].tolist(),
        "next_logprob": logp[:num_prompts].tolist(),
        "imbalance_before": np.asarray(stats.imbalance_before).tolist(),
        "imbalance_after": np.asarray(stats.imbalance_after).tolist(),
        "dropped": np.asarray(stats.dropped).tolist(),
        "replicas": np.asarray(stats.replicas).tolist(),
        "masked": np.asarray(stats.masked).tolist(),
    }


def _balancer_record(balancer) -> dict:
    """The balancer's fields as the result records them."""
    return {
        "slots_per_rank": balancer.slots_per_rank,
        "min_tokens_per_replica": balancer.min_tokens_per_replica,
        "balance_eps": balancer.balance_eps,
        "min_tokens_per_rank": balancer.min_tokens_per_rank,
        "max_fanout": balancer.max_fanout,
        "ranks_per_domain": balancer.ranks_per_domain,
    }


def _model_record(model_cfg) -> dict:
    """The served model's shape as the result records it."""
    return {
        "d_model": model_cfg.d_model,
        "num_layers": model_cfg.num_layers,
        "num_experts": model_cfg.num_experts,
        "top_k": model_cfg.top_k,
        "max_seq_len": model_cfg.max_seq_len,
    }


def _prompt_records(prompts: list[Prompt], runs: dict, continuations: list[str]) -> list[dict]:
    """Each prompt's file, length, next token and log-probability per mode, and continuation."""
    return [
        {
            "file": str(p.path),
            "tokens": len(p.tokens),
            "next_token": {m: as_text([r["next_token"][i]]) for m, r in runs.items()},
            "next_logprob": {m: r["next_logprob"][i] for m, r in runs.items()},
            "continuation": continuations[i],
        }
        for i, p in enumerate(prompts)
    ]


def _mode_run(mode: str, cfg: ServeConfig, train_cfg, served, args, prompts, real: int) -> dict:
    """One mode's prefill (`_prefill_run`) of the model built for it: plain, or balanced with
    ``cfg``'s buffer. ``served``: (mesh, restored state, plain settings, balancer)."""
    mesh, state, plain, balancer = served
    balanced = mode == "ultraep"
    settings = plain
    if balanced:
        settings = dataclasses.replace(
            plain, balancer=balancer, capacity_factor=cfg.capacity_factor
        )
    model = _engine().build(train_cfg, mesh, state, settings)
    return {
        "capacity_factor": cfg.capacity_factor if balanced else None,
        **_prefill_run(model, mesh, args, cfg.repeats, len(prompts), real),
    }


def run(cfg: ServeConfig, workdir, train_cfg, prompts: list[Prompt], pinned: bool) -> dict:
    """Prefills ``prompts`` in every mode of ``cfg``, then decodes; the results (see the module
    doc; every process returns them)."""
    import jax

    from experiments.lab.training.build import TENSOR_AXIS
    from models.moe_lm import MoESettings

    engine = _engine()
    model_cfg = train_cfg.model
    mesh, (data_size, ep, tensor) = _serve_mesh(cfg, train_cfg)
    token_devices = data_size * ep  # the tensor ranks of an EP rank see the same tokens
    plain = MoESettings(
        tensor_axis=TENSOR_AXIS if tensor > 1 else None,
        execution=execution_of(cfg.planner, cfg.transfer_chunks),
    )
    calibration = None
    if pinned:
        rows = model_cfg.top_k * sum(len(p.tokens) for p in prompts) // token_devices
        calibration = concurrency_check(rows, model_cfg.d_model, model_cfg.d_ff // tensor)
    state, step = engine.restore(train_cfg, workdir, mesh, plain)
    tokens, mask, lengths = pad_batch(prompts, token_devices)
    B, T = tokens.shape
    per_rank = B * T // token_devices
    balancer = _balancer(cfg, train_cfg)
    args = (
        engine.on_mesh(mesh, tokens, split=True),
        engine.on_mesh(mesh, mask, split=True),
        engine.on_mesh(mesh, lengths, split=False),
    )
    real = int(lengths.sum())
    runs = {
        mode: _mode_run(mode, cfg, train_cfg, (mesh, state, plain, balancer), args, prompts, real)
        for mode in cfg.modes
    }
    result = {
        "workdir": str(workdir),
        "checkpoint_step": step,
        "model": _model_record(model_cfg),
        "devices": jax.device_count(),
        "device": str(jax.devices()[0].device_kind),
        "mesh": {"data": data_size, "expert": ep, "tensor": tensor},
        "tensor_size": {"served": tensor, "trained": train_cfg.tensor_size},
        "execution": {"planner": cfg.planner, "transfer_chunks": cfg.transfer_chunks},
        "pinned_ranks": FLAGS.pinned_ranks,
        "batch": [B, T],
        "prompt_tokens": real,
        "balancer": _balancer_record(balancer),
        "tokens_per_rank": per_rank,
        # The balanced prefill compiled plain EP (too few tokens per rank to pay).
        "fallback": "ultraep" in cfg.modes and not balancer.applies(per_rank),
        "runs": runs,
    }
    if calibration is not None:
        result["calibration"] = calibration
    result["decode"], continuations = _decode(cfg, train_cfg, mesh, state, prompts, balancer, plain)
    result["prompts"] = _prompt_records(prompts, runs, continuations)
    return result


def _decode(cfg, train_cfg, mesh, state, prompts, balancer, plain) -> tuple[dict, list[str]]:
    """``cfg.new_tokens`` greedy decode steps on the fallback path (``plain``'s tensor axis and
    execution): (figures, continuations)."""
    import jax

    engine = _engine()
    if not cfg.new_tokens:
        return {"steps": 0}, [""] * len(prompts)
    devices = mesh.shape["data"] * mesh.shape["expert"]  # those that split the tokens
    longest = max(len(p.tokens) for p in prompts)
    window = min(train_cfg.model.max_seq_len, longest + cfg.new_tokens)
    tokens, _, lengths = pad_batch(prompts, devices, length=window)
    per_rank = tokens.size // devices
    use = balancer if "ultraep" in cfg.modes else None
    settings = dataclasses.replace(plain, balancer=engine.decode_balancer(use, per_rank))
    model = engine.build(train_cfg, mesh, state, settings)
    generate = engine.greedy_step(model, mesh, cfg.new_tokens)
    args = (engine.on_mesh(mesh, tokens, split=False), engine.on_mesh(mesh, lengths, split=False))
    start = time.perf_counter()
    out, ends = jax.device_get(jax.block_until_ready(generate(*args)))
    seconds = time.perf_counter() - start  # compile included: one call
    texts = [as_text(out[i, lengths[i] : ends[i]]) for i in range(len(prompts))]
    figures = {
        "steps": cfg.new_tokens,
        "window": [tokens.shape[0], window],
        "tokens_per_rank": per_rank,
        "seconds_with_compile": seconds,
        "path": "fallback (plain EP, dropless)",
    }
    return figures, texts
