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
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from podracer.bounds import NON_NEGATIVE, POSITIVE, bounded, check_bounds
from podracer.errors import PodracerError

# Bounded waits: a peer that never shows up, or dies, ends the run with an error
# instead of a hang.
INIT_TIMEOUT_S = 60
AUTO_INIT_TIMEOUT_S = 300  # a TPU VM slice's workers boot at their own pace
HEARTBEAT_TIMEOUT_S = 20
STOP_GRACE_S = 10
JOIN_MARGIN_S = 5


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
    join_timeout_s: float = bounded(0.0, NON_NEGATIVE)
    """Seconds a joining process waits for the coordinator to answer and for every process to join; then it stops with one line. 0: 60, or 300 with --distributed=auto."""

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
    """Join the run described by `config` (a no-op for a single process).

    A process other than 0 first waits up to `--join-timeout-s` for the
    coordinator's port to answer; then every process waits as long for the
    others. JAX's own wait ends in a C++ abort (a stack trace, status 134), so
    a watchdog ends the process first, with one line.
    """
    import jax

    if config.distributed == "off" and not config.coordinator:
        return
    timeout_s = config.join_timeout_s or (AUTO_INIT_TIMEOUT_S if config.distributed == "auto"
                                          else INIT_TIMEOUT_S)
    what = ("the processes of a TPU VM slice (--distributed=auto)" if config.distributed == "auto" else
            f"the run at --coordinator={config.coordinator} as process {config.process_id} of "
            f"{config.num_processes}")
    if config.coordinator and config.process_id != 0:
        wait_for_coordinator(config.coordinator, timeout_s)
    watchdog = threading.Timer(timeout_s, _give_up_joining, (what, timeout_s))
    watchdog.daemon = True
    watchdog.start()
    # JAX waits a little longer than the watchdog: the one line, not its abort, ends a failed join.
    timeout = math.ceil(timeout_s) + JOIN_MARGIN_S
    try:
        if config.distributed == "auto":
            jax.distributed.initialize(initialization_timeout=timeout)
        else:
            jax.distributed.initialize(
                config.coordinator, config.num_processes, config.process_id,
                initialization_timeout=timeout, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
    except Exception as err:
        raise PodracerError(f"could not join {what} ({type(err).__name__}); start every process within "
                            f"--join-timeout-s={timeout_s:g} s with the same flags") from None
    finally:
        watchdog.cancel()


def _give_up_joining(what: str, timeout_s: float) -> None:
    # Straight to the descriptor and out: the main thread is inside JAX's C++ wait.
    os.write(2, f"error: could not join {what} within --join-timeout-s={timeout_s:g} s: not every "
                f"process joined; start them all with the same flags, or raise --join-timeout-s\n".encode())
    os._exit(PodracerError.exit_code)


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Until a TCP connection to `address` (HOST:PORT) succeeds; one line after `timeout_s`."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)),
                                          timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise PodracerError(
                    f"no coordinator answered at --coordinator={address} within --join-timeout-s="
                    f"{timeout_s:g} s ({err.strerror or type(err).__name__}); start process 0 first, "
                    f"check the address and that the port is open, or raise --join-timeout-s") from None
            time.sleep(0.2)


def free_port() -> int:
    """A TCP port free now on every interface, for a coordinator that binds it later.

    Drawn below the kernel's ephemeral range: a port there is never handed to an
    outgoing connection, which could otherwise take it in the seconds between this
    choice and the coordinator's bind (its gRPC server then fails to start)."""
    lowest_ephemeral = _lowest_ephemeral_port()
    draw = random.Random()
    for _ in range(200 if lowest_ephemeral > 11_000 else 0):
        port = draw.randrange(10_000, lowest_ephemeral)
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:   # every draw taken: let the kernel choose
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _lowest_ephemeral_port() -> int:
    try:   # Linux; elsewhere the IANA range's start, what macOS and Windows use
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


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
