"""While a run compiles, a line says what, and it shows that it is alive until training starts.

XLA can take a minute over a program (a large population's, Craftax's), and a
silent minute reads as a hang. On a terminal the line ends in the seconds
elapsed, rewritten every second; in a pipe (a log file, CI, a notebook) the
line is printed whole, then a dot follows every second, with the seconds and
a new line every ten, so that a reader that waits for whole lines sees one
every ten seconds. `end()` finishes the line before anything else is printed.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

DOTS_PER_LINE = 10


class Heartbeat:
    """A thread that prints `what` and then, every `interval_s`, that it is still at it."""

    def __init__(self, what: str, stream: TextIO, interval_s: float = 1.0):
        self.what, self.stream, self.interval_s = what, stream, interval_s
        self.interactive = hasattr(stream, "isatty") and stream.isatty()
        self.started = time.perf_counter()
        self._stopped = threading.Event()
        self._open_line = False  # something is on the current line, not yet ended
        self._lock = threading.Lock()
        self._write(f"{what}" if self.interactive else f"{what}\n")
        self._open_line = self.interactive
        self._thread = threading.Thread(target=self._beat, name="podracer-heartbeat", daemon=True)
        self._thread.start()

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _beat(self) -> None:
        beats = 0
        while not self._stopped.wait(self.interval_s):
            with self._lock:
                if self._stopped.is_set():
                    return
                elapsed = time.perf_counter() - self.started
                if self.interactive:
                    self._write(f"\r{self.what} {elapsed:.0f} s")
                    continue
                # A dot per interval elapsed: a wake-up that came late (a busy CPU) catches up.
                while beats < int(elapsed / self.interval_s):
                    beats += 1
                    self._write(". " + f"{beats * self.interval_s:.0f} s\n" if beats % DOTS_PER_LINE == 0
                                else ".")
                    self._open_line = beats % DOTS_PER_LINE != 0

    def end(self) -> None:
        """Stop, and end the line it was writing."""
        with self._lock:
            self._stopped.set()
            if self._open_line:
                self._write("\n")
                self._open_line = False
        self._thread.join()


_current: Heartbeat | None = None


def begin(what: str, stream: TextIO | None = None, interval_s: float = 1.0) -> None:
    """Print `what` and keep showing that it goes on, until `end()`."""
    global _current
    end()
    _current = Heartbeat(what, stream or sys.stdout, interval_s)


def end() -> None:
    """Finish the heartbeat `begin` started, if any (training starts, or the run failed)."""
    global _current
    current, _current = _current, None
    if current is not None:
        current.end()
