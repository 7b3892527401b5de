"""Reading a `jax.profiler` trace: where it was written, and how busy the devices were.

`jax.profiler.start_trace(dir)` writes `dir/plugins/profile/<run>/<host>.xplane.pb`,
the layout TensorBoard's profile plugin reads. Its XSpace holds one plane per
device on GPU and TPU (`/device:GPU:0`, ...), each with lines of timed events;
the CPU backend records only host planes. A device's busy share is the union of
its op intervals over the traced window, as XProf's duty cycle counts it.
"""

from __future__ import annotations

import glob
import os


def newest_trace(trace_dir: str) -> str | None:
    """The latest `<host>.xplane.pb` that `jax.profiler` wrote under `trace_dir`."""
    files = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.xplane.pb"))
    return max(files, key=os.path.getmtime) if files else None


# Lines of a device plane that hold the device's op executions, in order of
# preference: XLA's per-op line (TPU, and GPU once derived), else the raw GPU
# streams. Module- and step-level lines span idle gaps between ops.
_OP_LINES = ("XLA Ops",)
_STREAM_PREFIX = "Stream"


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of `(start, end)` intervals (same unit in and out)."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def device_planes_busy(space, window_s: float) -> tuple[float | None, str | None]:
    """Mean over device planes of the share of `window_s` with an op running; (None, why) if none."""
    planes = [plane for plane in space.planes if plane.name.startswith("/device:")]
    if not planes:
        return None, ("the trace has no device plane (the CPU backend runs XLA on host threads: "
                      "there is no separate device to be busy or idle)")
    shares = []
    for plane in planes:
        lines = list(plane.lines)
        chosen = ([line for line in lines if line.name in _OP_LINES]
                  or [line for line in lines if line.name.startswith(_STREAM_PREFIX)])
        intervals = [(event.start_ns, event.end_ns) for line in chosen for event in line.events]
        shares.append(busy_seconds(intervals) * 1e-9 / window_s)
    return sum(shares) / len(shares), None


def device_busy_share(trace_file: str, window_s: float) -> tuple[float | None, str | None]:
    """`device_planes_busy` of the `.xplane.pb` at `trace_file`."""
    from jax.profiler import ProfileData

    try:
        space = ProfileData.from_file(trace_file)
    except Exception as err:  # noqa: BLE001 - a trace we cannot read must not fail the run
        return None, f"could not read {trace_file}: {err}"
    return device_planes_busy(space, window_s)
