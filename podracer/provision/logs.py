"""Workers' logs, read from the run's bucket: `python launch/tpu.py logs NAME [--worker=I] [--follow]`.

Each worker copies its log to `RUN_DIR/logs/worker-I.log` as it grows and
writes its exit status to `RUN_DIR/logs/worker-I.exit` when it ends
(`podracer.provision.worker`), so the logs outlive the slice and nothing needs
SSH access to a worker.
"""

from __future__ import annotations

import re
import time
from typing import Callable

from podracer.errors import PodracerError
from podracer import storage

Say = Callable[[str], None]
LOGS_FOLDER = "logs"


def log_path(run_dir: str, worker: int) -> str:
    return storage.join(run_dir, LOGS_FOLDER, f"worker-{worker}.log")


def exit_path(run_dir: str, worker: int) -> str:
    return storage.join(run_dir, LOGS_FOLDER, f"worker-{worker}.exit")


def workers_with_logs(run_dir: str) -> list[int]:
    """The workers that have copied a log to `run_dir` so far."""
    names = storage.listdir(storage.join(run_dir, LOGS_FOLDER))
    return sorted(int(found.group(1)) for name in names
                  if (found := re.fullmatch(r"worker-(\d+)\.log", name)))


def exit_status(run_dir: str, worker: int) -> int | None:
    """The worker's exit status once it has ended, else None."""
    path = exit_path(run_dir, worker)
    if not storage.exists(path):
        return None
    text = storage.read_text(path).strip()
    return int(text) if text.lstrip("-").isdigit() else None


def finished(run_dir: str) -> bool:
    """Every worker that ran has exited 0, by the exit statuses they left in the bucket."""
    workers = workers_with_logs(run_dir)
    return bool(workers) and all(exit_status(run_dir, worker) == 0 for worker in workers)


def _read(run_dir: str, worker: int) -> str:
    path = log_path(run_dir, worker)
    return storage.read_text(path) if storage.exists(path) else ""


def show(run_dir: str, worker: int | None, follow: bool, say: Say,
         poll_interval: float = 5.0) -> int:
    """Prints the logs of `worker` (every worker if None); with `follow`, until they end.

    Lines of several workers are prefixed with `[worker I]`. Returns 0, or 1 if
    a followed worker ended with a non-zero status.
    """
    workers = [worker] if worker is not None else workers_with_logs(run_dir)
    if not workers and not follow:
        raise PodracerError(f"no worker has copied a log to {storage.join(run_dir, LOGS_FOLDER)} "
                            "yet; its workers may still be booting (try again, or add --follow)")
    if not workers:
        workers = [0]
    shown = {index: 0 for index in workers}
    prefix = len(workers) > 1 or worker is None

    def print_new() -> None:
        for index in workers:
            text = _read(run_dir, index)
            # A log is only ever appended to; print what came after the last time.
            new, shown[index] = text[shown[index]:], len(text)
            for line in new.splitlines():
                say(f"[worker {index}] {line}" if prefix else line)

    while True:
        ended = {index: exit_status(run_dir, index) for index in workers}
        print_new()
        if not follow or all(status is not None for status in ended.values()):
            break
        time.sleep(poll_interval)
        if worker is None:  # workers that boot later join in
            for index in workers_with_logs(run_dir):
                if index not in shown:
                    workers.append(index)
                    shown[index] = 0
                    prefix = True
    failed = {index: status for index, status in ended.items() if status}
    if follow and failed:
        index, status = next(iter(failed.items()))
        say(f"worker {index} exited with status {status}")
        return 1
    return 0
