"""Stopping a run of many threads: one stop flag, the first failure, a bounded wait.

Ctrl-C, SIGTERM, the end of training and an exception in any thread all end
the same way: the stop flag is set, every thread notices it within one
environment step or update (every blocking wait polls it), and the main thread
waits a bounded time for them before returning or raising.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from typing import Callable, Iterator, Sequence

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
                     deadline_s: float = JOIN_DEADLINE_S) -> None:
    """Wait until `main` ends or the run stops; then stop and join every thread.

    Runs on the main thread, which stays responsive to signals: KeyboardInterrupt
    (and SIGTERM, see `sigterm_raises`) interrupts the wait, stops the run and is
    re-raised. A failure in any thread is re-raised here, with its traceback.
    """
    try:
        while main.is_alive() and not control.stop.is_set():
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


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into `SystemExit(143)` in the main thread, so a run unwinds and stops cleanly."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum, frame):
        print("terminated", file=sys.stderr)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
