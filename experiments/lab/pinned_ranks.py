"""Ranks as pinned processes: `launch_pinned_ranks` runs one process per rank, each with one CPU
device on a core of its own, joined by `start_distributed`; `keep_freed_memory` keeps the host
allocator from handing memory back between calls. The concurrency check that tells whether their
wall clock is the busiest rank's is `experiments.lab.concurrency`.
"""

from __future__ import annotations

import os
import re

from absl import flags

from experiments.lab.devices import DEVICE_FLAG

#: Every program that starts pinned ranks takes it (off by default: a rank at real-time priority
#: starves the machine's other work, a niced test run included).
REALTIME_RANKS = flags.DEFINE_bool(
    "realtime_ranks",
    False,
    "With --pinned_ranks: run the ranks at round-robin real-time priority where the system allows "
    "it (as root), so that other programs barely move the clock; it starves them. Off: the "
    "calibration line says the ranks ran at normal priority.",
)


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


def _pin(core: int, realtime: bool):
    """A child's set-up: run on ``core`` only; with ``realtime``, under round-robin real-time
    scheduling where the system allows it (other programs on the machine then barely disturb the
    clock; the kernel still keeps a share of every second for them), else at normal priority."""

    def setup():
        os.sched_setaffinity(0, {core})
        if not realtime:
            return
        try:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
        except (PermissionError, OSError):
            pass

    return setup


def realtime_requested(realtime: bool | None = None) -> bool:
    """``realtime``, or where None the ``--realtime_ranks`` flag's value once flags are parsed
    (False before)."""
    if realtime is not None:
        return realtime
    return flags.FLAGS.is_parsed() and REALTIME_RANKS.value


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


def launch_pinned_ranks(
    num_ranks: int, module: str, argv: list[str], verbose: bool = False, realtime=None
) -> int:
    """Runs ``python -m module *argv`` as ``num_ranks`` processes, process i pinned to core i with
    one CPU device (at real-time priority where allowed only when asked: ``realtime``, None for
    the ``--realtime_ranks`` flag, `realtime_requested`; see `_pin`), joined by
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
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {DEVICE_FLAG}=1")
    env["JAX_PLATFORMS"] = "cpu"
    realtime = realtime_requested(realtime)
    procs, readers, lock = [], [], threading.Lock()
    for i in range(num_ranks):
        cmd = [sys.executable, "-m", module, *argv, f"--num_processes={num_ranks}"]
        cmd += [f"--process_id={i}", f"--coordinator_address={address}"]
        pipe = subprocess.PIPE
        proc = subprocess.Popen(
            cmd, env=env, preexec_fn=_pin(cores[i], realtime), stdout=pipe, stderr=pipe
        )
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
