"""Where the time goes: per-operation wall-time totals, safe to share between threads.

    timings = Timings()
    with timings.measure("env_step"):
        envs.step(action)
    timings.totals()  # {"env_step": 12.3}

Totals add up over every thread that measures the same name, so a name measured
by four actor threads reports thread-seconds, which can exceed the wall time.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator


class Timings:
    """Accumulated seconds and call counts per operation name."""

    def __init__(self):
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def add(self, name: str, seconds: float, count: int = 1) -> None:
        with self._lock:
            self._seconds[name] = self._seconds.get(name, 0.0) + seconds
            self._counts[name] = self._counts.get(name, 0) + count

    @contextlib.contextmanager
    def measure(self, name: str) -> Iterator[None]:
        """Time the body of a `with` block under `name` (also when it raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def totals(self) -> dict[str, float]:
        """Seconds per name, in the order the names were first measured."""
        with self._lock:
            return dict(self._seconds)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def as_metrics(totals: dict[str, float], prefix: str = "time_") -> dict[str, float]:
    """`{"env_step": 1.2}` -> `{"time_env_step_s": 1.2}`: flat keys for metrics and summaries."""
    return {f"{prefix}{name}_s": round(seconds, 4) for name, seconds in totals.items()}


def format_breakdown(totals: dict[str, float], wall_s: float) -> str:
    """A small table of totals, largest first, with each as a share of `wall_s`."""
    if not totals:
        return ""
    width = max(len(name) for name in totals)
    lines = ["time breakdown (thread-seconds; % of wall time)"]
    for name, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        share = 100.0 * seconds / wall_s if wall_s > 0 else float("nan")
        lines.append(f"  {name:<{width}}  {seconds:>9.3f} s  {share:>6.1f} %")
    return "\n".join(lines) + "\n"
