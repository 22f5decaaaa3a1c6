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

Each prompt file is one prompt (its bytes are the tokens, as in training). The prompts are padded
into one batch, at the end of each row and with empty rows up to a multiple of the devices, and
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

import sys
import time

from absl import flags, logging

from experiments import cli
from experiments.concurrency import concurrency_check
from experiments.devices import force_cpu_devices
from experiments.output_files import check_output_path, write_json
from experiments.pinned_ranks import keep_freed_memory, launch_pinned_ranks, start_distributed
from experiments.serve.config import OUTPUT_FILE, ServeConfig
from experiments.serve.prompts import Prompt, as_text, pad_batch, read_prompts
from experiments.serve.report import report
from experiments.walltime import median_seconds

_VALUES = cli.define_flags(ServeConfig, {"capacity_factor": cli.parse_capacity_factor})
flags.DEFINE_integer(
    "cpu_devices", 8, "Simulated CPU devices per process when there is no accelerator."
)
flags.DEFINE_integer(
    "pinned_ranks",
    0,
    "Run as this many processes started by this command, one CPU device each, each pinned to a "
    "core of its own (so that the prefill time is the busiest rank's); 0: one process.",
)
flags.DEFINE_string("coordinator_address", None, "Set by --pinned_ranks.")
flags.DEFINE_integer("num_processes", 1, "Set by --pinned_ranks.")
flags.DEFINE_integer("process_id", 0, "Set by --pinned_ranks.")

FLAGS = flags.FLAGS


def _fail(message) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def main(argv):
    """Prefills and reports; exits 2 with one line ``error: ...`` when the flags, the workdir or
    the prompts cannot be used."""
    logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
    if len(argv) > 1:
        _fail(f"unexpected arguments: {' '.join(argv[1:])}")
    try:  # checked before starting any process: bad input ends with one line
        cfg = ServeConfig(**_VALUES())
        workdir, train_cfg = _engine().read_train_config(cfg.workdir)
        prompts = read_prompts(cfg.prompts, train_cfg.model.max_seq_len)
        output = cfg.output or str(workdir / OUTPUT_FILE)
        check_output_path(output, "--output")
    except ValueError as err:  # RunError included
        _fail(err)
    if FLAGS.pinned_ranks and FLAGS.num_processes == 1:  # this process only starts the ranks
        try:
            sys.exit(launch_pinned_ranks(FLAGS.pinned_ranks, "experiments.serve", sys.argv[1:]))
        except ValueError as err:
            _fail(err)
    if FLAGS.num_processes > 1:
        keep_freed_memory()  # a pinned rank: time the prefill, not the page faults
    try:
        force_cpu_devices(FLAGS.cpu_devices)
        start_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
        result = run(cfg, workdir, train_cfg, prompts, pinned=bool(FLAGS.pinned_ranks))
    except ValueError as err:
        _fail(err)
    import jax

    if jax.process_index() == 0:
        print(report(result), flush=True)
        write_json(output, result)
        print(f"wrote {output}", flush=True)


def _engine():
    # Imported late: it imports JAX, which must not start before the devices are set up.
    from experiments.serve import engine

    return engine


def mesh_shape(num_devices: int, ep_size: int, num_experts: int) -> tuple[int, int]:
    """(data, ep) sizes for ``num_devices``; ValueError when the EP size does not fit."""
    ep = ep_size or num_devices
    if num_devices % ep:
        raise ValueError(f"--ep_size={ep} does not divide the {num_devices} devices")
    if num_experts % ep:
        raise ValueError(f"the model's {num_experts} experts are not divisible by the EP size {ep}")
    return num_devices // ep, ep


def run(cfg: ServeConfig, workdir, train_cfg, prompts: list[Prompt], pinned: bool) -> dict:
    """Prefills ``prompts`` in every mode of ``cfg``, then decodes; the results (see the module
    doc; every process returns them)."""
    import jax
    import numpy as np

    import ultraep_jax as uep
    from experiments.train.trainer import make_mesh

    engine = _engine()
    model_cfg = train_cfg.model
    devices = jax.device_count()
    data_size, ep = mesh_shape(devices, cfg.ep_size, model_cfg.num_experts)
    mesh = make_mesh(data_size, ep, 1)
    calibration = None
    if pinned:
        rows = model_cfg.top_k * sum(len(p.tokens) for p in prompts) // devices
        calibration = concurrency_check(rows, model_cfg.d_model, model_cfg.d_ff)
    state, step = engine.restore(train_cfg, workdir, mesh)
    tokens, mask, lengths = pad_batch(prompts, devices)
    B, T = tokens.shape
    per_rank = B * T // devices
    balancer = uep.BalancerConfig(
        slots_per_rank=cfg.slots_per_rank or train_cfg.slots_per_rank,
        min_tokens_per_replica=cfg.min_tokens_per_replica,
        balance_eps=cfg.balance_eps,
        min_tokens_per_rank=cfg.min_tokens_per_rank,
    )
    args = (
        engine.on_mesh(mesh, tokens, split=True),
        engine.on_mesh(mesh, mask, split=True),
        engine.on_mesh(mesh, lengths, split=False),
    )
    real = int(lengths.sum())
    runs = {}
    for mode in cfg.modes:
        balanced = mode == "ultraep"
        model = engine.build(
            train_cfg,
            mesh,
            state,
            balancer if balanced else None,
            cfg.capacity_factor if balanced else None,
        )
        prefill = engine.prefill_step(model, mesh)
        start = time.perf_counter()
        ids, logp, stats = jax.device_get(jax.block_until_ready(prefill(*args)))
        compile_s = time.perf_counter() - start
        seconds = median_seconds(lambda prefill=prefill: prefill(*args), cfg.repeats)
        runs[mode] = {
            "capacity_factor": cfg.capacity_factor if balanced else None,
            "compile_s": compile_s,
            "prefill_ms": seconds * 1e3,
            "tokens_per_s": real / seconds,
            "next_token": ids[: len(prompts)].tolist(),
            "next_logprob": logp[: len(prompts)].tolist(),
            "imbalance_before": np.asarray(stats.imbalance_before).tolist(),
            "imbalance_after": np.asarray(stats.imbalance_after).tolist(),
            "dropped": np.asarray(stats.dropped).tolist(),
            "replicas": np.asarray(stats.replicas).tolist(),
            "masked": np.asarray(stats.masked).tolist(),
        }
    result = {
        "workdir": str(workdir),
        "checkpoint_step": step,
        "model": {
            "d_model": model_cfg.d_model,
            "num_layers": model_cfg.num_layers,
            "num_experts": model_cfg.num_experts,
            "top_k": model_cfg.top_k,
            "max_seq_len": model_cfg.max_seq_len,
        },
        "devices": devices,
        "device": str(jax.devices()[0].device_kind),
        "mesh": {"data": data_size, "expert": ep},
        "pinned_ranks": FLAGS.pinned_ranks,
        "batch": [B, T],
        "prompt_tokens": real,
        "balancer": {
            "slots_per_rank": balancer.slots_per_rank,
            "min_tokens_per_replica": balancer.min_tokens_per_replica,
            "balance_eps": balancer.balance_eps,
            "min_tokens_per_rank": balancer.min_tokens_per_rank,
        },
        "tokens_per_rank": per_rank,
        # The balanced prefill compiled plain EP (too few tokens per rank to pay).
        "fallback": "ultraep" in cfg.modes and not balancer.applies(per_rank),
        "runs": runs,
    }
    if calibration is not None:
        result["calibration"] = calibration
    result["decode"], continuations = _decode(cfg, train_cfg, mesh, state, prompts, balancer)
    result["prompts"] = [
        {
            "file": str(p.path),
            "tokens": len(p.tokens),
            "next_token": {m: as_text([r["next_token"][i]]) for m, r in runs.items()},
            "next_logprob": {m: r["next_logprob"][i] for m, r in runs.items()},
            "continuation": continuations[i],
        }
        for i, p in enumerate(prompts)
    ]
    return result


def _decode(cfg, train_cfg, mesh, state, prompts, balancer) -> tuple[dict, list[str]]:
    """``cfg.new_tokens`` greedy decode steps on the fallback path: (figures, continuations)."""
    import jax

    engine = _engine()
    if not cfg.new_tokens:
        return {"steps": 0}, [""] * len(prompts)
    devices = mesh.size
    longest = max(len(p.tokens) for p in prompts)
    window = min(train_cfg.model.max_seq_len, longest + cfg.new_tokens)
    tokens, _, lengths = pad_batch(prompts, devices, length=window)
    per_rank = tokens.size // devices
    use = balancer if "ultraep" in cfg.modes else None
    model = engine.build(train_cfg, mesh, state, engine.decode_balancer(use, per_rank), None)
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
