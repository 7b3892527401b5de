"""Where the time goes, thread by thread: the scoped profiler behind `--profile`.

    profiler = Profiler(trace_dir="runs/x/profile")
    profiler.start()                 # trace on, overhead calibrated, wall clock started
    with profiler.measure("env_step"):
        envs.step(action)
    report = profiler.stop()         # {"operations": [...], "wall_s": ..., ...}

In the manner of RL-Scope (Gleeson et al., MLSys 2021):

- Time is attributed to named operations, and each thread's operations plus
  `other (unmeasured)` add up to that thread's share of the wall time. Threads
  named `role-<n>` (the Sebulba actors) are one role: their thread-seconds are
  summed and each share is of `threads x wall`, the mean over those threads.
  Every row says which role it belongs to, so no share is of an unstated whole.
- The instrumentation's own cost is measured at start-up (empty `measure`
  calls, annotations on when tracing) and subtracted: from each operation,
  the part of that cost its own clock saw (`calls x inside`); from the thread
  time, the whole of it (`calls x per call`). The report says how large the
  correction was.
- Every `measure` is also a `jax.profiler.TraceAnnotation` of the same name, so
  the trace written under `trace_dir` (TensorBoard's layout,
  `plugins/profile/<run>/<host>.xplane.pb`) shows the same operations. The
  share of the window in which each device ran XLA ops is read from that trace
  where the backend records a device plane (GPU, TPU); on CPU, where XLA runs on
  host threads, it is reported as None with the reason.

Operations must not nest on one thread (a nested one would be counted twice);
`measure` raises if they do.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import statistics
import threading
import time
from typing import Any, Iterator, NamedTuple

import jax

from podracer.session.timing import Timings
from podracer.session.trace import device_busy_share, newest_trace

# The clock every measurement reads; a module attribute so that tests can drive it.
clock = time.perf_counter

OTHER = "other (unmeasured)"
TRACE_WRITE = "profiler_trace_write"  # the profiler's own: writing the trace once it is long enough


class Overhead(NamedTuple):
    """What one `measure` call costs, in seconds."""

    inside_s: float  # the part its own clock sees, so the operation's total includes it
    per_call_s: float  # all of it: what the thread spends on instrumentation per call


def thread_role(thread_name: str) -> str:
    """`sebulba-actor-3` -> `sebulba-actor`: numbered threads of one kind are reported together."""
    if thread_name == "MainThread":
        return "main"
    return re.sub(r"-\d+$", "", thread_name)


class Profiler(Timings):
    """`Timings` that also keeps time per thread role, annotates the trace and calibrates its overhead.

    Its `totals()` stay the raw thread-seconds per name (what metrics.jsonl
    rows carry); `stop()` returns the corrected, per-role report.

    The trace covers the first `trace_s` seconds of the profiled window, and
    longer where an operation begun in it has not yet ended once (a first
    learner update that compiles, on a busy machine): every operation in the
    trace is there whole at least once. On CPU every XLA kernel is a trace
    event, so a trace grows by tens of megabytes a second and takes long to
    write and to open. The thread whose operation ends past that point writes
    it, timed as the operation `TRACE_WRITE`.
    """

    def __init__(self, trace_dir: str | None = None, trace_s: float = 5.0):
        super().__init__()
        self.trace_dir = trace_dir
        self.trace_s = trace_s
        self.overhead = Overhead(0.0, 0.0)
        self._annotate = False  # True while the trace runs
        self._local = threading.local()
        self._records: dict[tuple[str, str], list] = {}  # (role, name) -> [seconds, calls]
        self._threads: dict[str, set[str]] = {}  # role -> names of the threads seen
        self._start: float | None = None
        self._trace_lock = threading.Lock()
        self._trace_start = 0.0
        self._trace_deadline = math.inf
        self._trace_window_s: float | None = None
        self._traced_begun: set[str] = set()  # names of the operations begun in the trace
        self._traced_ended: set[str] = set()  # ... and of those ended in it at least once
        self._traced_lock = threading.Lock()  # apart from _trace_lock, held while a trace is written

    @contextlib.contextmanager
    def measure(self, name: str) -> Iterator[None]:
        local = self._local
        if getattr(local, "inside", None) is not None:
            raise RuntimeError(f"profiled operation {name!r} nested inside {local.inside!r}; "
                               f"measured operations must not nest")
        local.inside = name
        traced = self._annotate
        if traced:
            with self._traced_lock:  # another thread may be comparing the two sets
                self._traced_begun.add(name)
        start = clock()
        try:
            if self._annotate:
                with jax.profiler.TraceAnnotation(name):
                    yield
            else:
                yield
        finally:
            end = clock()
            local.inside = None
            self._record(name, end - start)
            if traced:
                with self._traced_lock:
                    self._traced_ended.add(name)
            if end >= self._trace_deadline and self._whole_once():
                self._stop_trace(record=True)

    def _record(self, name: str, seconds: float) -> None:
        local = self._local
        if not hasattr(local, "role"):  # once per thread: names are fixed when threads start
            local.thread = threading.current_thread().name
            local.role = thread_role(local.thread)
        thread, role = local.thread, local.role
        self.add(name, seconds)
        with self._lock:
            record = self._records.setdefault((role, name), [0.0, 0])
            record[0] += seconds
            record[1] += 1
            self._threads.setdefault(role, set()).add(thread)

    def start(self) -> None:
        """Start the trace (if `trace_dir`), calibrate the overhead, then start the wall clock."""
        if self.trace_dir is not None:
            os.makedirs(self.trace_dir, exist_ok=True)
            options = jax.profiler.ProfileOptions()
            # Python's tracer hooks every Python call: it would slow the host
            # loops it is meant to explain by several times.
            options.python_tracer_level = 0
            jax.profiler.start_trace(self.trace_dir, profiler_options=options)
            self._annotate = True
            self._trace_start = clock()
        self.overhead = calibrate(self._annotate)
        self._start = clock()
        if self._annotate:
            self._trace_deadline = self._start + self.trace_s

    def _whole_once(self) -> bool:
        """Whether every operation begun in the trace has ended in it at least once."""
        with self._traced_lock:
            return self._traced_begun <= self._traced_ended

    def _stop_trace(self, record: bool) -> None:
        """Stop the trace (once, whichever thread gets here first); `record` its writing time."""
        with self._trace_lock:
            if not self._annotate:
                return
            self._annotate = False
            self._trace_deadline = math.inf
            start = clock()
            self._trace_window_s = start - self._trace_start
            jax.profiler.stop_trace()
            seconds = clock() - start
        if record:
            self._record(TRACE_WRITE, seconds)

    def stop(self, note: str | None = None) -> dict[str, Any]:
        """Stop the wall clock and the trace; the report (see `breakdown`) with the trace's findings."""
        if self._start is None:
            raise RuntimeError("Profiler.stop() before start()")
        wall_s = clock() - self._start
        with self._lock:
            records = {key: (seconds, calls) for key, (seconds, calls) in self._records.items()}
            threads = {role: len(names) for role, names in self._threads.items()}
        self._stop_trace(record=False)  # after the window: its writing time is not the run's
        report = breakdown(records, threads, wall_s, self.overhead)
        busy, reason, trace_file = None, "no trace was taken", None
        if self._trace_window_s is not None:
            trace_file = newest_trace(self.trace_dir)
            if trace_file is None:
                reason = f"the profiler wrote no .xplane.pb under {self.trace_dir}"
            else:
                busy, reason = device_busy_share(trace_file, self._trace_window_s)
        report.update(device_busy_share=busy, device_busy_note=reason, trace_dir=self.trace_dir,
                      trace_file=trace_file, trace_window_s=self._trace_window_s)
        if note:
            report["note"] = note
        return report


def make_profiler(config, run_dir: str) -> Profiler | None:
    """The run's profiler when `config` (a `LogConfig`) asks for `--profile`, else None."""
    if not config.profile:
        return None
    trace_dir = run_trace_dir(run_dir) if config.profile_trace_s > 0 else None
    return Profiler(trace_dir, config.profile_trace_s)


def run_trace_dir(run_dir: str) -> str:
    """Where a run's trace goes: `RUN_DIR/profile` (`RUN_DIR/profile/process<k>` with several processes)."""
    if jax.process_count() > 1:  # each process traces itself; one host's would overwrite another's
        return os.path.join(run_dir, "profile", f"process{jax.process_index()}")
    return os.path.join(run_dir, "profile")


def calibrate(annotate: bool, calls: int = 1000, repeats: int = 5) -> Overhead:
    """The cost of one `Profiler.measure` call, as the median of `repeats` runs of `calls` empty ones.

    `annotate`: measure with trace annotations on (the trace must be running,
    or they cost less than they will). The median resists the odd run slowed
    by another process on a shared CPU.
    """
    inside, per_call = [], []
    for _ in range(repeats):
        scratch = Profiler()
        scratch._annotate = annotate
        start = clock()
        for _ in range(calls):
            pass
        loop_s = clock() - start  # the loop itself is not instrumentation
        start = clock()
        for _ in range(calls):
            with scratch.measure("calibration"):
                pass
        elapsed = clock() - start - loop_s
        per_call.append(elapsed / calls)
        inside.append(scratch.totals()["calibration"] / calls)
    inside_s = statistics.median(inside)
    return Overhead(inside_s, max(inside_s, statistics.median(per_call)))


def breakdown(records: dict[tuple[str, str], tuple[float, int]], threads: dict[str, int],
              wall_s: float, overhead: Overhead) -> dict[str, Any]:
    """The per-role report, corrected for `overhead`; pure.

    Args:
      records: `(role, operation) -> (raw seconds, calls)`, summed over the role's threads.
      threads: `role -> number of threads` that measured anything.
      wall_s: the profiled window.
      overhead: from `calibrate`.

    Returns a dict with `operations`: one row per (role, operation), largest
    first within a role, then the role's `other (unmeasured)` row. `seconds` are
    corrected thread-seconds; `share` is of the role's corrected thread time
    (`threads x wall_s` less its instrumentation), so a role's shares sum to 1.
    `roles` gives, per role, its thread count, corrected thread-seconds,
    instrumentation overhead and `measured_share` (1 minus its `other` share).
    """
    operations, roles = [], {}
    total_overhead = 0.0
    for role in sorted(threads):
        rows = [(name, seconds, calls) for (r, name), (seconds, calls) in records.items() if r == role]
        calls_total = sum(calls for _, _, calls in rows)
        overhead_s = calls_total * overhead.per_call_s
        total_overhead += overhead_s
        available = max(threads[role] * wall_s - overhead_s, 1e-12)
        measured = 0.0
        role_rows = []
        for name, seconds, calls in rows:
            corrected = max(0.0, seconds - calls * overhead.inside_s)
            measured += corrected
            role_rows.append({"thread": role, "operation": name, "seconds": corrected,
                              "share": corrected / available, "calls": calls,
                              "mean_s": corrected / calls, "raw_seconds": seconds})
        role_rows.sort(key=lambda row: -row["seconds"])
        other = available - measured
        role_rows.append({"thread": role, "operation": OTHER, "seconds": other,
                          "share": other / available, "calls": None, "mean_s": None,
                          "raw_seconds": None})
        operations += role_rows
        roles[role] = {"threads": threads[role], "thread_seconds": available,
                       "overhead_s": overhead_s, "measured_share": measured / available}
    thread_seconds = sum(threads.values()) * wall_s
    return {
        "wall_s": wall_s,
        "operations": operations,
        "roles": roles,
        "overhead_per_call_s": overhead.per_call_s,
        "overhead_inside_s": overhead.inside_s,
        "overhead_correction_s": total_overhead,
        # Of the thread time profiled (threads x wall), the share that was instrumentation.
        "overhead_share": total_overhead / thread_seconds if thread_seconds > 0 else 0.0,
    }


def format_profile(report: dict[str, Any]) -> str:
    """The profile as a table: role, operation, seconds, share of wall, calls, mean per call."""
    rows = [("thread", "operation", "seconds", "share", "calls", "mean/call")]
    for row in report["operations"]:
        threads = report["roles"][row["thread"]]["threads"]
        role = row["thread"] if threads == 1 else f"{row['thread']} x{threads}"
        rows.append((role, row["operation"], f"{row['seconds']:.3f}", f"{100 * row['share']:.1f} %",
                     "" if row["calls"] is None else f"{row['calls']:,}",
                     "" if row["mean_s"] is None else _duration(row["mean_s"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"where the time went: {report['wall_s']:.2f} s of training (wall time); each share is of its "
             f"thread's wall time (xN: the mean over N threads), seconds are thread-seconds"]
    for row in rows:
        lines.append(("  " + "  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                                       for i, (cell, w) in enumerate(zip(row, widths)))).rstrip())
    lines.append(f"instrumentation overhead subtracted: {report['overhead_correction_s']:.3f} "
                 f"thread-seconds ({100 * report['overhead_share']:.2f} % of the thread time; "
                 f"{_duration(report['overhead_per_call_s'])} per call)")
    if "device_busy_share" in report:
        busy = report["device_busy_share"]
        lines.append("device busy: " + (f"{100 * busy:.1f} % of the traced window "
                                        f"({report['trace_window_s']:.1f} s)" if busy is not None
                                        else f"n/a, {report['device_busy_note']}"))
    if report.get("trace_file"):
        lines.append(f"trace: {report['trace_file']} (tensorboard --logdir {report['trace_dir']})")
    if report.get("note"):
        lines.append(f"note: {report['note']}")
    return "\n".join(lines) + "\n"


def _duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"
