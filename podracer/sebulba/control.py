"""Stopping a run of many threads: one stop flag, the first failure, a bounded wait.

Ctrl-C, SIGTERM, the end of training and an exception in any thread all end
the same way: the stop flag is set, every thread notices it within one
environment step or update (every blocking wait polls it), and the main thread
waits a bounded time for them before returning or raising.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Sequence

# How long the main thread waits for the other threads once a run is stopping.
JOIN_DEADLINE_S = 8.0


class Control:
    """The stop flag and the first failure, shared by every thread of a run."""

    def __init__(self):
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def fail(self, error: BaseException, where: str) -> None:
        """Record `error` (the first one wins) and stop every thread."""
        with self._lock:
            if self._error is None:
                error.add_note(f"(raised in the {where})")
                self._error = error
        self.stop.set()

    @property
    def error(self) -> BaseException | None:
        with self._lock:
            return self._error

    def guard(self, body: Callable, where: str) -> Callable:
        """`body`, reporting any exception it raises through `fail` instead of losing it."""

        def guarded(*args, **kwargs):
            try:
                return body(*args, **kwargs)
            except BaseException as error:  # noqa: BLE001 - every failure must stop the run
                self.fail(error, where)

        return guarded


def wait_for_threads(control: Control, main: threading.Thread, threads: Sequence[threading.Thread],
                     interrupted: Callable[[], bool] = lambda: False,
                     deadline_s: float = JOIN_DEADLINE_S) -> None:
    """Wait until `main` ends, the run stops or `interrupted()`; then stop and join every thread.

    Runs on the main thread, where signal handlers run, polling every 50 ms. An
    exception raised by a handler (KeyboardInterrupt) also stops every thread
    before it propagates. A failure in any thread is re-raised here, with its
    traceback and a note naming the thread.
    """
    try:
        while main.is_alive() and not control.stop.is_set() and not interrupted():
            main.join(0.05)
    finally:
        control.stop.set()
        deadline = time.monotonic() + deadline_s
        for thread in (main, *threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [thread.name for thread in (main, *threads) if thread.is_alive()]
        if stuck:
            print(f"warning: {', '.join(stuck)} still busy after {deadline_s:.0f} s; leaving them",
                  file=sys.stderr)
    if control.error is not None:
        raise control.error
