"""Helpers every experiment shares: simulated CPU devices, the batched planner and its timing,
the batched replica-transfer schedule and its counts, the ``--json_out`` file, and `run_main`
(the programs' command-line conventions; their flags are made in `experiments.cli`).

``force_cpu_devices`` must run before JAX initialises a backend; it is the only place the
experiments touch ``XLA_FLAGS``. JAX, absl and ultraep_jax are imported inside the functions, so
importing this module initialises nothing.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import statistics
import sys
import time
from collections.abc import Callable

_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def force_cpu_devices(count: int, *, cpu_only: bool = False) -> None:
    """Asks XLA's host platform for ``count`` devices (a no-op if ``XLA_FLAGS`` already names a
    count, so a caller's choice wins). ``cpu_only`` also pins JAX to the CPU platform unless
    ``JAX_PLATFORMS`` is set. Only the host platform reads the flag: on a GPU it changes nothing."""
    if count < 1:
        raise ValueError(f"cpu device count must be >= 1, got {count}")
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={count}".strip()
    if cpu_only:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


@functools.cache
def batched_planner(cfg, capacity: int | None = None):
    """``jax.jit(jax.vmap(uep.plan))`` for one ``BalancerConfig`` and receive buffer of
    ``capacity`` rows (None: unbounded): plans ``[N, R, E]`` int32 loads in one call, on the
    device the loads are on. Cached per config and capacity."""
    import jax

    import ultraep_jax as uep

    return jax.jit(jax.vmap(lambda loads: uep.plan(loads, cfg, capacity=capacity)))


@functools.cache
def batched_transfer(ep_size: int, experts_per_rank: int, max_fanout: int):
    """``jit(vmap(...))`` of the replica transfer of held-expert matrices ``[N, R, C]`` (each
    rank's instances of experts it does not master, -1 elsewhere: a plan's ``slot_expert``)
    under the relay bound ``max_fanout`` (0: direct; `replicas.relay`). Returns int32 [N]
    each: the busiest rank's copies sent, the transfer's length in copies (each hop as long as
    its busiest link, sending or receiving, summed over hops) and the hops it took."""
    import jax
    import jax.numpy as jnp

    from ultraep_jax import tools

    hops = tools.static_hops(ep_size, max_fanout)

    def one(held_RC):
        schedule = tools.relay_schedule(held_RC, experts_per_rank, max_fanout)
        sent_HR, received_HR = tools.hop_copies(schedule, hops)
        length = jnp.sum(jnp.maximum(sent_HR.max(axis=1), received_HR.max(axis=1)))
        return jnp.max(tools.send_copies(schedule)), length, jnp.max(schedule.hop_RS)

    return jax.jit(jax.vmap(one))


@functools.cache
def batched_schedule(ep_size: int, experts_per_rank: int, max_fanout: int, domain_size=None):
    """``jit(vmap(...))`` of the relay schedule (`replicas.relay.relay_schedule`) of held-expert
    matrices ``[N, R, C]`` (as `batched_transfer` takes them) under the relay bound
    ``max_fanout`` and fast domains of ``domain_size`` ranks (None: one domain). Returns its
    ``hop_RS`` and ``sender_RS``, int32 [N, R, C] each."""
    import jax

    from ultraep_jax import tools

    def one(held_RC):
        schedule = tools.relay_schedule(held_RC, experts_per_rank, max_fanout, domain_size)
        return schedule.hop_RS, schedule.sender_RS

    return jax.jit(jax.vmap(one))


def summary(values, stats=("median", "p90", "max", "min", "mean")) -> dict:
    """The ``stats`` (median, p90, max, min, mean) of per-layer ``values``, as floats."""
    import numpy as np

    v = np.asarray(values, np.float64)
    every = {
        "median": np.median,
        "p90": lambda a: np.percentile(a, 90),
        "max": np.max,
        "min": np.min,
        "mean": np.mean,
    }
    return {k: float(every[k](v)) for k in stats}


def median_seconds(fn: Callable[[], object], repeats: int, inner: int = 1) -> float:
    """Median seconds per call of ``fn()`` over ``repeats`` samples, each ``inner`` back-to-back
    calls blocked on once (so the host's dispatch overlaps the device's work), after one warm-up
    call that compiles."""
    import jax

    if repeats < 1 or inner < 1:
        raise ValueError(f"repeats and inner must be >= 1, got {repeats} and {inner}")
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready([fn() for _ in range(inner)])
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def time_batched_plan(loads, cfg, repeats: int = 5, device=None, capacity=None) -> float:
    """Median seconds of one ``batched_planner(cfg, capacity)`` call on ``loads`` [N, R, E],
    placed on ``device`` (default: JAX's default device), over ``repeats`` calls after a warm-up.
    The one planner timing of experiments/: every program that charges a planner takes it from
    here (per plan: divide by N, or `seconds_per_plan`)."""
    import jax
    import numpy as np

    fn = batched_planner(cfg, capacity)
    data = jax.device_put(np.asarray(loads, dtype=np.int32), device)
    return median_seconds(lambda: fn(data), repeats)


def seconds_per_plan(loads_RE, cfg, repeats: int, batch: int = 32, capacity=None) -> float:
    """Seconds per plan of one load matrix [R, E] within ``capacity``: `time_batched_plan` on
    ``batch`` copies of it (so that the call's dispatch is amortised, as inside a jitted step),
    divided by ``batch``. Caches are warm: in a step the planner reads loads just gathered."""
    import numpy as np

    copies = np.repeat(np.asarray(loads_RE, np.int32)[None], batch, axis=0)
    return time_batched_plan(copies, cfg, repeats, capacity=capacity) / batch


def write_json(path: str | os.PathLike | None, obj) -> None:
    """Writes ``obj`` to ``path`` as indented JSON, creating its folder, atomically (a reader
    never sees half a file); nothing when ``path`` is None (the ``--json_out`` flags' default)."""
    if path:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(obj, indent=2) + "\n")
        os.replace(tmp, path)


def check_output_path(path: str | os.PathLike, flag: str) -> None:
    """Checks, before a long run, that `write_json` can write ``path`` (given by ``flag``): it is
    no folder, and its nearest existing folder is a writable folder, not a file.

    Raises:
      ValueError: one line naming ``flag`` and the problem.
    """
    path = pathlib.Path(path)
    if path.is_dir():
        raise ValueError(f"{flag}={path} is a folder; name a file")
    parent = next(p for p in path.absolute().parents if p.exists())
    if not parent.is_dir():
        raise ValueError(f"{flag}={path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag}={path}: the folder {parent} is not writable")


_HELP_ARGS = ("--help", "-help", "--helpshort", "-helpshort", "-?")


def short_help() -> str:
    """What ``--help`` prints: the program's module doc (its usage line and examples), then the
    flags of the program with their help, without absl's header naming the module's file."""
    from absl import flags

    doc = (sys.modules["__main__"].__doc__ or "").strip()
    # absl's listing opens with the file path of the module that defines the flags.
    listing = [line for line in flags.FLAGS.main_module_help().splitlines() if line[:1].isspace()]
    return f"{doc}\n\nflags:\n" + "\n".join(listing) + "\n\n--helpfull lists every flag.\n"


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing with the experiments' conventions: a flag that cannot be parsed ends
    with one line ``error: ...`` (exit code 2, as for any other unusable flag); ``--help`` or
    ``--helpshort`` print `short_help` and ``--helpfull`` absl's full help, and exit 0 (absl
    exits 1)."""
    from absl import flags

    args = argv[1 : argv.index("--")] if "--" in argv else argv[1:]
    if any(arg in _HELP_ARGS for arg in args):
        sys.stdout.write(short_help())
        sys.exit(0)
    try:
        return flags.FLAGS(argv)
    except flags.Error as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        sys.exit(2)
    except SystemExit as stop:
        # While parsing, only absl's help flags exit, with 1, after printing the help.
        if stop.code == 1:
            sys.exit(0)
        raise


#: JAX's logger that reports, at INFO, each backend it tried and skipped quietly (on a CPU
#: machine: "Unable to initialize backend 'tpu': ... libtpu.so ..."). Python's own logging shows
#: only warnings, but absl's handler, which `absl.app.run` installs, shows INFO (``--verbosity``
#: defaults to 0), so that line opened the output of every program. A backend that is asked
#: for (``JAX_PLATFORMS``) and fails still raises.
_BACKEND_PROBE_LOGGER = "jax._src.xla_bridge"


def run_main(main: Callable[[list[str]], object]) -> None:
    """``absl.app.run(main)`` with `parse_flags`, without JAX's INFO lines about the backends it
    probed and skipped (`_BACKEND_PROBE_LOGGER`)."""
    import logging

    from absl import app

    logging.getLogger(_BACKEND_PROBE_LOGGER).setLevel(logging.WARNING)
    app.run(main, flags_parser=parse_flags)


# --- Ranks as pinned processes -------------------------------------------------------------------
# Simulated devices of one process share its cores (XLA:CPU spreads one dot over all of them), so
# their wall clock is the total work of every rank. One process per rank, each with one CPU
# device and pinned to a core of its own, makes the wall clock the busiest rank's.


def keep_freed_memory() -> None:
    """Tells glibc's malloc to keep freed memory in one arena instead of handing large blocks back
    to the OS: XLA:CPU allocates each call's buffers afresh, and blocks handed back page-fault in
    again on the next call (11,600 page faults and 25 ms of system time per call of a 50 ms
    training-step expert program at the replay's cpu shape), a cost of the host allocator that a
    GPU's pooled allocator does not have. Call before JAX allocates; a no-op without glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold, m_arena_max = -1, -2, -3, -8
    libc.mallopt(m_arena_max, 1)
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 2**31 - 1)
    libc.mallopt(m_top_pad, 1 << 29)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pin(core: int):
    """A child's set-up: run on ``core`` only, under round-robin real-time scheduling where the
    system allows it (other programs on the machine then barely disturb the clock; the kernel
    still keeps a share of every second for them), else at normal priority."""

    def setup():
        os.sched_setaffinity(0, {core})
        try:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
        except (PermissionError, OSError):
            pass

    return setup


#: What the ranks' libraries print as they join (gloo's "[Gloo] Rank 0 is connected to 1 peer
#: ranks..." on stdout, JAX's distributed-service INFO log on stderr): hidden unless verbose.
_RANK_LIBRARY_LINE = re.compile(r"\[Gloo\] |I\d{4} [\d:.]+ +\d+ distributed\.py:\d+\] ")


def is_rank_library_line(line: str) -> bool:
    """Whether ``line``, printed by a pinned rank, is one of its libraries' joining lines."""
    return _RANK_LIBRARY_LINE.match(line) is not None


def _forward_lines(source, sink, verbose: bool, lock) -> None:
    """Copies the lines of the pipe ``source`` to ``sink`` (a text stream) as they come, but the
    ranks' library lines unless ``verbose``."""
    for raw in iter(source.readline, b""):
        line = raw.decode(errors="replace")
        if verbose or not is_rank_library_line(line):
            with lock:
                sink.write(line)
                sink.flush()
    source.close()


def launch_pinned_ranks(num_ranks: int, module: str, argv: list[str], verbose: bool = False) -> int:
    """Runs ``python -m module *argv`` as ``num_ranks`` processes, process i pinned to core i with
    one CPU device (and real-time priority where allowed, see `_pin`), joined by
    `jax.distributed` over 127.0.0.1 (each gets ``--num_processes``,
    ``--process_id`` and ``--coordinator_address``). Forwards SIGINT / SIGTERM to them, passes
    on what they print, but their libraries' joining lines unless ``verbose``
    (`is_rank_library_line`), waits for all, and returns the first non-zero exit code (0 when all
    succeeded).

    Raises:
      ValueError: fewer usable cores than ``num_ranks``.
    """
    import signal
    import subprocess
    import sys
    import threading

    cores = sorted(os.sched_getaffinity(0))
    if not 1 <= num_ranks <= len(cores):
        raise ValueError(
            f"--pinned_ranks={num_ranks} needs that many cores; this process may use "
            f"{len(cores)} ({cores})"
        )
    address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}=1")
    env["JAX_PLATFORMS"] = "cpu"
    procs, readers, lock = [], [], threading.Lock()
    for i in range(num_ranks):
        cmd = [sys.executable, "-m", module, *argv, f"--num_processes={num_ranks}"]
        cmd += [f"--process_id={i}", f"--coordinator_address={address}"]
        pipe = subprocess.PIPE
        proc = subprocess.Popen(cmd, env=env, preexec_fn=_pin(cores[i]), stdout=pipe, stderr=pipe)
        procs.append(proc)
        for source, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            reader = threading.Thread(
                target=_forward_lines, args=(source, sink, verbose, lock), daemon=True
            )
            reader.start()
            readers.append(reader)

    def forward(signum, frame):
        del frame
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = [p.wait() for p in procs]
        for reader in readers:
            reader.join()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return next((c for c in codes if c), 0)


def start_distributed(coordinator_address: str | None, num_processes: int, process_id: int):
    """Joins ``num_processes`` JAX processes (gloo collectives between CPU devices); nothing for
    one process. Call before JAX first touches a backend."""
    import jax

    if num_processes <= 1:
        return
    if not coordinator_address:
        raise ValueError("--coordinator_address is required with --num_processes > 1")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)


_CALIBRATION_ROWS = 32768


def concurrency_calibration(rows: int, d_model: int, d_ff: int, repeats: int = 7) -> dict:
    """How far the wall clock is from the busiest rank's, across this run's processes.

    Every process times the same local SwiGLU-shaped matmul work (``rows`` x D x F, forward; at
    least 32768 rows),
    first process 0 alone while the others wait, then all at once. ``ratio`` (all at once / alone,
    medians of process 0) is 1.0 when the ranks truly run concurrently and the process count
    when they share one core. Must be called by every process.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    device = jax.local_devices()[0]
    rows = max(rows, _CALIBRATION_ROWS)  # long enough for the clock to see it
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.normal(size=(rows, d_model)).astype(np.float32), device)
    w = jax.device_put(rng.normal(size=(d_model, d_ff)).astype(np.float32) * 0.05, device)
    work = jax.jit(lambda x, w: (jax.nn.silu(x @ w) * (x @ w)) @ w.T + jnp.float32(0))
    jax.block_until_ready(work(x, w))

    def timed():
        return median_seconds(lambda: work(x, w), repeats)

    multihost_utils.sync_global_devices("calibration:alone")
    alone = timed() if jax.process_index() == 0 else float("nan")
    multihost_utils.sync_global_devices("calibration:together")
    together = timed()
    multihost_utils.sync_global_devices("calibration:done")
    return {
        "processes": jax.process_count(),
        "realtime": os.sched_getscheduler(0) == os.SCHED_RR,
        "alone_ms": alone * 1e3,
        "together_ms": together * 1e3,
        "ratio": together / alone if jax.process_index() == 0 else float("nan"),
    }


def fallback_note(tokens_per_rank: int, threshold: int, subject: str) -> str:
    """The programs' note when their balanced layers fall back to plain EP: ``tokens_per_rank``
    below ``threshold`` (``--min_tokens_per_rank``); "" otherwise. ``subject`` names what runs
    plain EP, with its verb ("the MoE layers run")."""
    if tokens_per_rank >= threshold:
        return ""
    return (
        f"note: {tokens_per_rank} tokens per rank is below --min_tokens_per_rank={threshold}: "
        f"{subject} plain expert parallelism with a buffer for every pair (nothing dropped); "
        f"--min_tokens_per_rank=0 balances anyway"
    )


def calibration_line(cal: dict) -> str:
    """One line that tells a reader whether the clock is the busiest rank's."""
    return (
        f"calibration: {cal['processes']} pinned ranks with equal work take "
        f"{cal['together_ms']:.1f} ms, one rank alone {cal['alone_ms']:.1f} ms: "
        f"ratio {cal['ratio']:.2f} (1.00 = truly concurrent, {cal['processes']:.2f} = one core)"
        + ("" if cal.get("realtime") else "; not at real-time priority: other load counts")
    )
