"""Orchestrator: one run description becomes N processes joined by `jax.distributed`.

Three ways to run:

- one process (default): nothing to join;
- `--num-processes=N` alone: spawn N local processes, a coordinator on
  127.0.0.1 at a free port, `--cpu-devices` devices each; wait for all, forward
  Ctrl-C/SIGTERM, stop the rest as soon as one fails, exit with its status;
- `--coordinator=HOST:PORT --process-id=I --num-processes=N`: join a run started
  elsewhere (GPU clusters, any hosts); `--distributed=auto` on a TPU VM slice,
  where `jax.distributed.initialize()` finds everything by itself.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from podracer.bounds import POSITIVE, bounded, check_bounds
from podracer.errors import PodracerError

# Bounded waits: a peer that never shows up, or dies, ends the run with an error
# instead of a hang.
INIT_TIMEOUT_S = 60
HEARTBEAT_TIMEOUT_S = 20
STOP_GRACE_S = 10


@dataclasses.dataclass(frozen=True)
class DistConfig:
    """How many processes, and how they find each other."""

    num_processes: int = bounded(1, POSITIVE)
    """Processes in the run; alone, spawns them on this machine."""
    coordinator: str = ""
    """HOST:PORT of process 0's coordinator, to join a run started elsewhere."""
    process_id: int = -1
    """This process's index (0 .. num-processes - 1) when joining with --coordinator."""
    distributed: str = "off"
    """off, or auto: jax.distributed.initialize() detects the cluster (TPU VM slices)."""

    def __post_init__(self):
        check_bounds(self)
        if self.distributed not in ("off", "auto"):
            raise ValueError(f"--distributed must be off or auto, got {self.distributed!r}")
        if self.coordinator:
            host, _, port = self.coordinator.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--coordinator must be HOST:PORT, got {self.coordinator!r}")
            if not 0 <= self.process_id < self.num_processes:
                raise ValueError(f"--process-id must be in [0, {self.num_processes}) with "
                                 f"--coordinator, got {self.process_id}")
        elif self.process_id != -1:
            raise ValueError("--process-id needs --coordinator=HOST:PORT")

    @property
    def spawns(self) -> bool:
        return self.num_processes > 1 and not self.coordinator and self.distributed == "off"


def initialize(config: DistConfig) -> None:
    """Join the run described by `config` (a no-op for a single process)."""
    import jax

    if config.distributed == "auto":
        jax.distributed.initialize(initialization_timeout=INIT_TIMEOUT_S * 5)
    elif config.coordinator:
        try:
            jax.distributed.initialize(
                config.coordinator, config.num_processes, config.process_id,
                initialization_timeout=INIT_TIMEOUT_S, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
        except Exception as err:
            raise PodracerError(
                f"could not join the run at --coordinator={config.coordinator} as process "
                f"{config.process_id} of {config.num_processes} ({type(err).__name__}); "
                f"start every process within {INIT_TIMEOUT_S} s with the same flags") from None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_local(argv: Sequence[str], num_processes: int) -> int:
    """Run `python -m podracer argv` as `num_processes` joined processes on this machine."""
    coordinator = f"127.0.0.1:{free_port()}"
    # The children import this very copy of podracer, installed or not: the
    # directory that holds podracer/orchestrate/this file.
    package_root = str(Path(os.path.abspath(__file__)).parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)}
    children = [subprocess.Popen([sys.executable, "-m", "podracer", *argv,
                                  f"--coordinator={coordinator}", f"--process-id={index}",
                                  f"--num-processes={num_processes}"], env=env)
                for index in range(num_processes)]
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [child.poll() for child in children]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                index, code = failed[0]
                if not received:
                    print(f"error: process {index} of {num_processes} exited with status "
                          f"{_describe(code)}; stopping the others", file=sys.stderr, flush=True)
                _stop(children)
                return code if code > 0 else 128 - code
            if all(code == 0 for code in codes):
                return 0
            time.sleep(0.1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _describe(code: int) -> str:
    return f"{code}" if code >= 0 else f"{-code} (killed by signal {signal.Signals(-code).name})"


def _stop(children: list[subprocess.Popen]) -> None:
    """SIGTERM (they save and exit), then SIGKILL for any stuck in a collective with the dead."""
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
