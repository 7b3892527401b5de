"""The run's growing files, written so that a failure stops the run rather than tearing or hanging it.

- `append_line`: a metrics row reaches `metrics.jsonl` whole or not at all (a
  full disk midway cuts the file back), so no reader finds half a row.
- tensorboardX writes its events on a thread of its own, which a failed write
  (a full disk) ends silently; every later event then waited for it forever.
  `watch_event_writers` records that thread's error and `raise_writer_failure`
  raises it on the logging thread, where the run stops with one line.
"""

from __future__ import annotations

import os
import threading
from typing import BinaryIO

from podracer.errors import PodracerError
from podracer import storage

# Events queued for tensorboardX's writer thread; a put blocks beyond them.
EVENT_QUEUE = 1000
_writer_failures: list[BaseException] = []  # errors that ended a tensorboardX writer thread


def watch_event_writers() -> None:
    """From now on, the error that ends a tensorboardX writer thread is recorded for
    `raise_writer_failure`, not printed (other threads' errors are printed as before)."""
    _writer_failures.clear()
    previous = threading.excepthook
    if getattr(previous, "records_event_writers", False):
        return

    def hook(args):
        if type(args.thread).__module__.startswith("tensorboardX"):
            _writer_failures.append(args.exc_value)
        else:
            previous(args)

    hook.records_event_writers = True
    threading.excepthook = hook


def raise_writer_failure(where: str) -> None:
    """Raise what ended a tensorboardX writer thread writing to `where`, if one did."""
    if not _writer_failures:
        return
    failure = _writer_failures[-1]
    if storage.disk_full(failure):
        raise failure
    raise PodracerError(f"writing TensorBoard events to {where} failed ({type(failure).__name__}: {failure}); "
                        f"check that disk, then run the same command to resume")


def append_line(file: BinaryIO, line: str) -> None:
    """Append `line` to an unbuffered file whole, or not at all: an error midway (a full disk)
    cuts the file back to where it was, so no reader ever finds half a row."""
    data = line.encode()
    start = file.seek(0, os.SEEK_END)
    try:
        written = 0
        while written < len(data):
            written += file.write(data[written:])
    except BaseException:
        file.truncate(start)
        raise
