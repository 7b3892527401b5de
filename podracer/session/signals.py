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
"""

from __future__ import annotations

import os
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_lock = threading.Lock()
_watching = False
_training = False
_nothing_saved = "nothing was saved"
_late_signal: int | None = None


def exit_at_once_until_training() -> None:
    """From now until `training_started()`, a signal ends the process with one line.

    For the command line only: a notebook's kernel also receives SIGINT (its
    interrupt button) and must survive it. Call from the main thread.
    """
    global _watching
    if _watching or threading.current_thread() is not threading.main_thread():
        return  # handlers belong to the main thread; elsewhere signals keep their owner's
    for sig in SIGNALS:
        signal.signal(sig, _handler)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read_fd,), name="podracer-signals", daemon=True).start()
    _watching = True


def set_nothing_saved(text: str) -> None:
    """What the line says was kept, e.g. which checkpoint of a resumed run is untouched."""
    global _nothing_saved
    _nothing_saved = text


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
    while True:
        data = os.read(read_fd, 1)
        if not data:
            return
        with _lock:
            if not _training:
                _exit_now(data[0])


def _exit_now(signum: int) -> None:
    # Straight to the descriptor: the main thread may hold sys.stderr's lock.
    name = signal.Signals(signum).name
    os.write(2, f"interrupted by {name} before training started; {_nothing_saved}\n".encode())
    os._exit(128 + signum)
