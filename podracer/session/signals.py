"""SIGINT and SIGTERM before training starts: one line, exit 128 + signal, at once.

While a run starts (imports, building, compiling) there is nothing to save, and
the main thread may sit in XLA's compiler for many seconds, where a Python
signal handler cannot run until it returns. So the C-level handler's wake-up
byte (`signal.set_wakeup_fd`) is read by a small thread, which ends the
process at once, without unwinding through native code (a KeyboardInterrupt
raised there once ended in a segmentation fault). Once training starts,
`podracer.session.checkpoint.stop_on_signals` takes over: the loop saves, then stops.
A signal after training (while the summary is written) is remembered and the
run exits with its status once its results are written.

Whatever the run is doing when a signal arrives, it ends within the stop
timeout (`--stop-timeout-s`): the same thread, which runs even while the main
thread is blocked in native code (a save to a disk or a bucket that does not
answer), ends the process with one line once that time has passed. A
checkpoint is complete or absent, never half-written, so the last complete
one is what a resumed run starts from.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_lock = threading.Lock()
_training = False
_nothing_saved = "nothing was saved"
_late_signal: int | None = None
_release = None  # run before a signal ends the process at once: gives up the run directory
_stop_timeout_s = 30.0
_overdue: threading.Timer | None = None  # armed by the first signal once training started


@contextlib.contextmanager
def exit_at_once_until_training() -> Iterator[None]:
    """Within the block, until `training_started()`, a signal ends the process with one line.

    For the command line only: a notebook's kernel also receives SIGINT (its
    interrupt button) and must survive it. Outside the main thread, where
    handlers cannot be set, the block changes nothing. The previous handlers
    come back when the block ends.
    """
    global _training, _nothing_saved, _late_signal
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _training, _nothing_saved, _late_signal = False, "nothing was saved", None
    _disarm()
    previous = {sig: signal.signal(sig, _handler) for sig in SIGNALS}
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read_fd,), name="podracer-signals", daemon=True).start()
    try:
        yield
    finally:
        _disarm()
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(write_fd)  # the watcher reads the end of its pipe and returns


def set_stop_timeout(seconds: float) -> None:
    """How long a signalled run may take to save and write its results before it ends at once."""
    global _stop_timeout_s
    _stop_timeout_s = seconds


def set_nothing_saved(text: str) -> None:
    """What the line says was kept, e.g. which checkpoint of a resumed run is untouched."""
    global _nothing_saved
    _nothing_saved = text


def release_before_exit(release) -> None:
    """Call `release()` (giving up the run directory) if a signal ends the process at once; None: nothing."""
    global _release
    _release = release


def training_started() -> None:
    """From now on signals are the training loop's (it saves, then stops)."""
    global _training
    with _lock:
        _training = True


def late_signal() -> int | None:
    """A signal received after training ended, while results were being written."""
    return _late_signal


def _handler(signum: int, _frame) -> None:
    global _late_signal
    with _lock:
        if not _training:
            _exit_now(signum)
        _late_signal = _late_signal or signum


def _watch(read_fd: int) -> None:
    global _overdue
    try:
        while data := os.read(read_fd, 1):
            with _lock:
                if not _training:
                    _exit_now(data[0])
                if _overdue is None and data[0] in SIGNALS:
                    _overdue = threading.Timer(_stop_timeout_s, _stop_overdue, (data[0],))
                    _overdue.daemon = True
                    _overdue.start()
    finally:
        os.close(read_fd)


def _disarm() -> None:
    global _overdue
    if _overdue is not None:
        _overdue.cancel()
        _overdue = None


def _stop_overdue(signum: int) -> None:
    _give_up_run_dir()
    os.write(2, f"stopped by {signal.Signals(signum).name}: the run did not end within --stop-timeout-s="
                f"{_stop_timeout_s:g} s of it (a save or a write is blocked); the last complete checkpoint "
                f"is kept: run the same command to resume from it\n".encode())
    os._exit(128 + signum)


# A bucket that does not answer must not hold up the exit: the lease then goes stale by itself.
RELEASE_WAIT_S = 2.0


def _give_up_run_dir() -> None:
    if _release is None:
        return

    def release():
        try:
            _release()
        except Exception:  # noqa: BLE001 - ending now matters more
            pass

    releasing = threading.Thread(target=release, name="podracer-release", daemon=True)
    releasing.start()
    releasing.join(RELEASE_WAIT_S)


def _exit_now(signum: int) -> None:
    # Straight to the descriptor: the main thread may hold sys.stderr's lock.
    name = signal.Signals(signum).name
    _give_up_run_dir()
    os.write(2, f"interrupted by {name} before training started; {_nothing_saved}\n".encode())
    os._exit(128 + signum)
