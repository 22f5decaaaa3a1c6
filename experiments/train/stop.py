"""Stopping a run cleanly: SIGINT / SIGTERM become a request to stop after the current step, and
the loop runs off the main thread so that the request is answered at once."""

from __future__ import annotations

import os
import signal
import threading

import jax
import numpy as np


class StopRequest:
    """Turns SIGINT / SIGTERM into a request to stop after the current step.

    The first signal sets `signum` (the loop then saves a checkpoint, the metrics, the plot and
    the summary, and ends) and puts SIGINT back to its default action, so a second Ctrl-C ends
    the process at once, whatever it is doing. Later SIGTERMs are absorbed: `timeout` (and other
    supervisors) send SIGTERM to the process and then to its whole process group, so one request
    to stop often arrives twice, and the second must not kill the run while it saves.

    A SIGINT that was ignored when the process started stays ignored (a shell script starts its
    background jobs so, for the script's Ctrl-C not to reach them): stop such a run with SIGTERM.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        #: The step the loop is in (or last finished), for the message; None before the first.
        self.step: int | None = None
        self._previous: dict = {}
        # Held while the loop decides whether to run a step and while the handler reads `step`:
        # the loop runs in another thread, and a signal between its check and its update of
        # `step` would name a step the loop then runs past. Reentrant: a handler that runs in
        # the thread holding it must not deadlock.
        self._lock = threading.RLock()

    def __call__(self, signum, frame=None):
        del frame
        with self._lock:
            if self.signum is not None:  # a repeated SIGTERM: already stopping
                return
            self.signum = signum
            step = self.step
        if signal.SIGINT in self._previous:  # not if SIGINT is ignored (see the class doc)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        name = signal.Signals(signum).name
        # os.write, not print: a handler may run in the middle of another print.
        when = "before the first step" if step is None else f"after step {step}"
        os.write(
            2,
            f"\n{name}: stopping {when} to save a checkpoint, the metrics and the plot "
            f"(press Ctrl-C again to quit at once without saving)\n".encode(),
        )

    def install(self):
        """Installs the handler (only the main thread can; elsewhere this does nothing)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                    continue
                self._previous[sig] = signal.signal(sig, self)

    def restore(self):
        """Puts back the handlers that `install` replaced."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def begins(self, step: int) -> bool:
        """Whether the loop runs ``step``: no process was asked to stop (on several processes
        they all must stop at the same step, or the others would wait for it in the next one).
        If it runs, a signal's message names ``step`` from now on, decided atomically with the
        check."""
        with self._lock:
            local = self.signum is not None
            previous = self.step
            if not local:
                self.step = step
        if self._any(local):
            self.step = previous  # another process was asked: ``step`` is not run
            return False
        return True

    @staticmethod
    def _any(local: bool) -> bool:
        """Whether ``local`` holds on any process."""
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        return bool(np.max(multihost_utils.process_allgather(np.int32(local))))


def in_worker_thread(fn):
    """Calls ``fn`` in another thread while the main thread waits, and returns its result (or
    raises its exception).

    Python runs signal handlers in the main thread between bytecodes only: a main thread busy in
    a long XLA call (compiling a step can take a minute) would answer Ctrl-C only when the call
    returns. Waiting here instead, it answers at once (the message, and a second Ctrl-C ends the
    process). Off the main thread (no handlers there), ``fn`` simply runs here.
    """
    if threading.current_thread() is not threading.main_thread():
        return fn()
    outcome = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as err:  # noqa: BLE001 (re-raised in the caller's thread)
            outcome["error"] = err

    worker = threading.Thread(target=target, name="train-loop", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
