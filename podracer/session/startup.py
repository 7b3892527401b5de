"""Start-up: when a run began, and what its compilation took from JAX's persistent cache.

Two summary keys come from here, the same for every (architecture, algorithm) pair:

- `time_to_first_step_s`: seconds from the start of the process (from the
  command line) or of the `podracer.train` call (from Python) to the start of
  training, when the compiled program is about to take its first step: Python's
  and podracer's imports, set-up, building and compiling.
- `compile_cache`: JAX's persistent compilation cache (`jax_compilation_cache_dir`)
  as this run found it: `dir` (null when off), `hits` and `misses`, the programs
  compiled during start-up that were and were not read from it, and `hit`, true
  when every one was. JAX reports both through `jax.monitoring` events.

The command line chooses the cache directory (`podracer.orchestrate.compile_cache`);
the session only reports what JAX was set to.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import jax

REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"  # a compilation that asked the cache
HITS = "/jax/compilation_cache/cache_hits"  # ... and was answered from it

_IMPORTED = time.time()  # the fallback start of a process whose /proc cannot be read
_lock = threading.Lock()
_counts = {REQUESTS: 0, HITS: 0}
_listening = False
_pending: StartUp | None = None  # begun by the caller, taken by the run's session


def process_start_time() -> float:
    """When this process started (seconds since the epoch).

    Linux gives its start in clock ticks since boot (`/proc/self/stat`, field
    22), on the clock `CLOCK_BOOTTIME` reads; elsewhere, the import of this
    module (a little after the interpreter's start).
    """
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED
    started = time.time() - age
    return started if 0 <= age and started <= _IMPORTED else _IMPORTED


def _on_event(event: str, **_: Any) -> None:
    if event in _counts:
        with _lock:
            _counts[event] += 1


def _listen() -> None:
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            _listening = True


def cache_dir() -> str | None:
    """The persistent compilation cache JAX uses now; None when it has none."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    return jax.config.jax_compilation_cache_dir or None


class StartUp:
    """One run's start-up: from its start to training's, and the compilations in between."""

    def __init__(self, started: float):
        _listen()
        self.started = started
        self._before = dict(_counts)
        self._after: dict[str, int] | None = None
        self.time_to_first_step_s: float | None = None

    def training_starts(self) -> None:
        """Start-up is over; compilations from now on (during training) are not counted."""
        self.time_to_first_step_s = time.time() - self.started
        with _lock:
            self._after = dict(_counts)

    def summary(self) -> dict[str, Any]:
        """The summary's `time_to_first_step_s` and `compile_cache`.

        `compile_cache`: `dir`, `hits` and `misses` (JAX's cache) and `hit`,
        true when some program was asked of it and none was compiled.
        """
        after = self._after if self._after is not None else dict(_counts)
        requests = after[REQUESTS] - self._before[REQUESTS]
        hits = after[HITS] - self._before[HITS]
        return {"time_to_first_step_s": self.time_to_first_step_s,
                "compile_cache": {"dir": cache_dir(), "hit": requests > 0 and hits == requests,
                                  "hits": hits, "misses": requests - hits}}


def begin(started: float) -> None:
    """The next run this process opens started at `started` (seconds since the epoch)."""
    global _pending
    _pending = StartUp(started)


def take() -> StartUp:
    """The start-up `begin` opened for this run (once), else one that starts now."""
    global _pending
    pending, _pending = _pending, None
    return pending if pending is not None else StartUp(time.time())
