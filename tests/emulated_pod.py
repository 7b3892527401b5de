"""An emulated TPU pod slice: every worker of a node the test TPU API server creates
boots for real, as a process group on this machine.

    service = FakeTpuService(workers=2)
    with EmulatedPod(service, tmp_path, worker_environment(offline_install)) as pod, \\
            TpuServer(service) as server:
        status = main(["--tpu=pod", ..., f"--api-endpoint={server.endpoint}", ...])
        pod.assert_nothing_left()

Opting in (constructing an `EmulatedPod` for a `FakeTpuService`) changes what
the server does with a node; everything else it scripts stays as it was:

- on create (CreateNode, or a queued resource found ACTIVE), each worker I of the
  node boots: a disk of its own (`root/disks/NODE/worker-I`, the worker's
  `PODRACER_HOME`), a metadata server of its own (tests/metadata_server.py) with
  the node's metadata plus `agent-worker-number` and `worker-network-endpoints`
  (every worker on 127.0.0.1), and on a multislice's nodes (`NAME-0`, `NAME-1`,
  ...: every node of the queued resource boots at once, one coordinator port for
  all) `tpu-env` with the `MEGASCALE_*` values, and the startup script, run by a stand-in for the
  guest agent's script runner (`bash -c STARTUP_SCRIPT` under it) in a new session, in
  `environment` (the bucket's and the offline installers' variables) with
  `GCE_METADATA_HOST`/`GCE_METADATA_IP` and `PODRACER_COORDINATOR_PORT` (a free
  port per node); its output goes to `root/consoles/NODE-worker-I.log` (the
  serial console), which outlives the disk;
- first on the workers' PATH, a stand-in `systemd-run` (tests/systemd_run_standin.py)
  starts a command as a unit of its own: a process session of its own, recorded
  under `root/units/NODE-worker-I/`;
- a worker's shutdown is the guest agent's: SIGTERM to the script runner alone (its
  service has `KillMode=process`) and to each unit (as systemd stops units), SIGKILL
  to a unit after its `TimeoutStopSec`, and to everything left after the grace;
  what got no SIGTERM stays as it was (running, or paused) until then;
- GetGuestAttributes answers what each worker's metadata server holds;
- DeleteNode (or deleting the queued resource) shuts the workers down (SIGKILL
  after `delete_grace_s`), removes their disks and metadata servers; the
  node is DELETING until then, and its operation done after.

What a test scripts, all of it thread-safe (run it from a thread, or with
`when`, while the launcher waits in the test's own thread):

- `preempt(node)`: shuts every worker down (a preemption's ACPI shutdown), SIGKILL
  after `grace_s`; the node is PREEMPTED (its queued resource SUSPENDED) and
  stays listed until deleted;
- `pause(node)`: freeze every worker (SIGSTOP) where it is; a later preemption,
  reboot or delete wakes what it sends SIGTERM to, `resume(node)` all as it was;
- `reboot(node, worker)`: shut that worker down the same way, then run
  its startup script again on the same disk with the same metadata server;
- `set_state(node, state)`: the node's state from now on (REPAIRING, READY, ...);
- `phase(node, worker)`: the worker's `podracer/state` (None before it reports);
  `wait_for_phase(node, worker, "running")` until it starts with that, failing at
  once, with the console's tail, if the worker is gone without it;
  `wait_until(condition, timeout, what)` for anything else (an object in the bucket);
- `when(condition, action)`: run `action()` in a thread once `condition()` holds;
- `assert_nothing_left()`: no worker process alive, no node, no queued resource.

Nodes are named by their id (`pod`) or full name. `close()` (the `with` block's
end) kills whatever is still running and stops the metadata servers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil
from google.cloud import tpu_v2

from metadata_server import MetadataServer, worker_endpoints
from podracer.orchestrate.distributed import free_port

GUEST_ATTRIBUTE = "podracer/state"
UNITS_VARIABLE = "EMULATED_SYSTEMD_UNITS"  # where tests/systemd_run_standin.py records units
_STANDIN = Path(__file__).with_name("systemd_run_standin.py")
# The guest agent's script runner: runs the startup script and waits for it. A SIGTERM
# ends the runner alone (Python's default action), not what the script started.
_SCRIPT_RUNNER = "import subprocess, sys; sys.exit(subprocess.call(['bash', '-c', sys.argv[1]]))"


def worker_environment(*overlays: dict) -> dict:
    """This process's environment (the bucket emulator's variables with it), less this
    checkout, plus `overlays` (the offline install's variables).

    As on a TPU VM, `python3` is an interpreter, first on PATH (`python_folders()`), not
    a version manager's shim (pyenv's are rewritten while other programs install).
    """
    env = dict(os.environ)
    # Nothing of this checkout leaks into a worker, nor this machine's choice to write no
    # bytecode (a TPU VM's Python writes it).
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE"):
        env.pop(name, None)
    env["PATH"] = os.pathsep.join([*python_folders(), env.get("PATH", "")])
    for overlay in overlays:
        env.update(overlay)
    return env


def python_folders(python: str = sys.executable, base_prefix: str = sys.base_prefix) -> list[str]:
    """Where the workers find Python: the folder of `python` (this interpreter; its
    `python3` runs the worker program), then, if it is a venv's, that of the interpreter
    the venv was made from (`base_prefix`), which the workers' `uv venv --python X.Y`
    takes: uv passes over virtual environments' interpreters and, with downloads off,
    would find none. `base_prefix`, not the build's own folder: a relocated Python (uv's
    own, for one) is not where it was built."""
    return list(dict.fromkeys([os.path.dirname(python), os.path.join(base_prefix, "bin")]))


def multislice_tpu_env(coordinator: str, num_slices: int, slice_id: int) -> str:
    """The `tpu-env` metadata of a worker of slice `slice_id` of a multislice: one
    `KEY: 'value'` a line, as JAX's TPU cluster detection parses it; the coordinator is
    worker 0 of slice 0 (given with the Megascale port, which its readers strip)."""
    values = {"MEGASCALE_COORDINATOR_ADDRESS": f"{coordinator}:8080",
              "MEGASCALE_NUM_SLICES": str(num_slices), "MEGASCALE_SLICE_ID": str(slice_id),
              "MEGASCALE_PORT": "8080"}
    return "".join(f"{key}: '{value}'\n" for key, value in values.items())


def wait_until(condition: Callable[[], object], timeout: float, what: str,
               interval: float = 0.1, check: Callable[[], None] = lambda: None):
    """`condition()`'s first true value, polled until `timeout` s; `check()` may fail early."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        check()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


@dataclass
class _Worker:
    index: int
    home: Path
    console: Path
    metadata: MetadataServer
    environment: dict
    process: subprocess.Popen | None = None
    boots: int = 0
    rebooting: bool = False  # between its shutdown and its next boot: down, not stopped

    def start(self) -> None:
        script = self.metadata.attributes.get("startup-script")
        if script is None:
            return  # a node without a startup script runs nothing
        self.home.mkdir(parents=True, exist_ok=True)
        self.boots += 1
        with open(self.console, "ab") as console:
            console.write(f"--- boot {self.boots} ---\n".encode())
            console.flush()
            self.process = subprocess.Popen(
                [sys.executable, "-c", _SCRIPT_RUNNER, script], env=self.environment,
                cwd=self.home, stdin=subprocess.DEVNULL, stdout=console,
                stderr=subprocess.STDOUT, start_new_session=True)

    def _units(self) -> list[dict]:
        """The systemd units its startup script started (tests/systemd_run_standin.py)."""
        units = Path(self.environment[UNITS_VARIABLE])
        return [json.loads(path.read_text()) for path in sorted(units.glob("*.json"))]

    def _groups(self) -> list[int]:
        """Its process groups: the script runner's, then each unit's session."""
        runner = [self.process.pid] if self.process is not None else []
        return runner + [unit["pid"] for unit in self._units()]

    def alive(self) -> list[int]:
        """The pids of its processes that still run (zombies are dead): the script
        runner's process group and its units' sessions."""
        if self.process is not None:
            self.process.poll()  # reaps the leader
        return [pid for group in self._groups() for pid in _group_members(group)]

    def signal(self, signum: int) -> None:
        for group in self._groups():
            _signal_group(group, signum)

    def stop(self, grace_s: float) -> None:
        """A shutdown as systemd and the guest agent do it: SIGTERM to the script runner
        alone (its service has `KillMode=process`) and to each unit (its main process
        with `KillMode=mixed`, its whole session otherwise); SIGKILL to a unit still
        running after its `TimeoutStopSec`, and to everything left after `grace_s`."""
        if not self.alive():
            return
        units = self._units()
        _signal_pid(self.process.pid, signal.SIGTERM)
        for unit in units:
            if unit["kill_mode"] in ("mixed", "process"):
                _signal_pid(unit["pid"], signal.SIGTERM)
            else:
                _signal_group(unit["pid"], signal.SIGTERM)
        # What was signalled wakes (a paused worker takes its SIGTERM as it wakes); what
        # was not stays as it was until it is killed.
        _signal_pid(self.process.pid, signal.SIGCONT)
        for unit in units:
            _signal_group(unit["pid"], signal.SIGCONT)
        start = time.monotonic()
        while self.alive() and time.monotonic() < start + grace_s:
            for unit in units:
                if time.monotonic() > start + unit["timeout_stop_s"]:
                    _signal_group(unit["pid"], signal.SIGKILL)
            time.sleep(0.05)
        self.signal(signal.SIGKILL)
        self.process.wait(timeout=30)
        wait_until(lambda: not self.alive(), 30, f"worker {self.index}'s processes to die")
        for path in Path(self.environment[UNITS_VARIABLE]).glob("*.json"):
            path.unlink()  # a shutdown ends every unit


def _tail(path: Path, lines: int) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def _signal_pid(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(group: int, signum: int) -> None:
    try:
        os.killpg(group, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _group_members(group: int) -> list[int]:
    members = []
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == group and process.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(process.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return members


@dataclass
class _Node:
    name: str
    workers: list[_Worker]
    disk: Path
    deleting: bool = False  # a delete has started (the launcher's and the workers' may race)
    gone: threading.Event = field(default_factory=threading.Event)


class EmulatedPod:
    """Boots the workers of `service`'s nodes on this machine (see the module's docstring)."""

    def __init__(self, service, root: str | os.PathLike, environment: dict, *,
                 grace_s: float = 5.0, delete_grace_s: float = 1.0, systemd_run: bool = True):
        self.service = service
        self.root = Path(root)
        self.environment = dict(environment)
        if systemd_run:  # first on the workers' PATH, before any real one
            folder = self.root / "bin"
            folder.mkdir(parents=True, exist_ok=True)
            standin = folder / "systemd-run"
            standin.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{_STANDIN}" "$@"\n')
            standin.chmod(0o755)
            self.environment["PATH"] = os.pathsep.join([str(folder), self.environment.get("PATH", "")])
        self.grace_s = grace_s
        self.delete_grace_s = delete_grace_s
        self._nodes: dict[str, _Node] = {}  # by full name, until deleted
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self._closed = threading.Event()
        service.pod = self

    def __enter__(self) -> "EmulatedPod":
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(raise_errors=kind is None)  # never hides the error that ends the block

    # -- what the server calls (under its lock) --------------------------------

    def runs(self, node: str) -> bool:
        """Whether the node (by id or full name) has booted and is not deleted."""
        return any(node in (name, name.rsplit("/", 1)[-1]) for name in list(self._nodes))

    def boot(self, *nodes) -> None:
        """Boots every worker of `nodes` (tpu_v2.Nodes, endpoints set) on this machine: one
        node, or the slices of a multislice in slice order, which share a coordinator port
        and whose metadata has the `tpu-env` a multislice's has (`multislice_tpu_env`)."""
        consoles = self.root / "consoles"
        consoles.mkdir(parents=True, exist_ok=True)
        port = str(free_port())
        booted = []
        for slice_id, node in enumerate(nodes):
            node_id = node.name.rsplit("/", 1)[-1]
            disk = self.root / "disks" / node_id
            endpoints = worker_endpoints([endpoint.ip_address for endpoint in node.network_endpoints])
            own = {"worker-network-endpoints": endpoints}
            if len(nodes) > 1:
                own["tpu-env"] = multislice_tpu_env(
                    nodes[0].network_endpoints[0].ip_address, len(nodes), slice_id)
            workers = []
            for index in range(len(node.network_endpoints)):
                metadata = MetadataServer({**dict(node.metadata), **own,
                                           "agent-worker-number": str(index)}).start()
                environment = {**self.environment, "PODRACER_HOME": str(disk / f"worker-{index}"),
                               "GCE_METADATA_HOST": metadata.host, "GCE_METADATA_IP": metadata.host,
                               "PODRACER_COORDINATOR_PORT": port,
                               UNITS_VARIABLE: str(self.root / "units" / f"{node_id}-worker-{index}")}
                workers.append(_Worker(index, disk / f"worker-{index}",
                                       consoles / f"{node_id}-worker-{index}.log", metadata,
                                       environment))
            self._nodes[node.name] = _Node(node.name, workers, disk)
            booted += workers
        for worker in booted:
            worker.start()

    def guest_attributes(self, name: str) -> list[dict[str, str]]:
        """Every guest attribute each worker of node `name` published, by path (`podracer/state`)."""
        return [dict(worker.metadata.guest_attributes) for worker in self._nodes[name].workers]

    def delete_nodes(self, names: list[str], then: Callable[[], None]) -> Callable[[], bool]:
        """Removes the nodes from the service: an emulated one is DELETING while, in a thread,
        its workers stop (SIGTERM, SIGKILL after `delete_grace_s`) and their disks go. Once
        all are gone, `then()` (under the service's lock); returns whether that is done."""
        service = self.service
        pending = {name for name in names if name in self._nodes}
        for name in names:
            if name in pending:
                service.nodes[name].script = []
                service.nodes[name].set_state(tpu_v2.Node.State.DELETING)
            else:
                del service.nodes[name]

        def delete(node: _Node, first: bool) -> None:
            if first:
                self._stop_workers(node.workers, self.delete_grace_s)
                self._discard(node)
                node.gone.set()
            elif not node.gone.wait(timeout=120):  # a second delete ends with the first
                raise AssertionError(f"{node.name} was not deleted in 120 s")
            with service._lock:
                service.nodes.pop(node.name, None)
                pending.discard(node.name)
                if not pending:
                    then()

        if not pending:
            then()
        for name in list(pending):
            node = self._nodes[name]
            first, node.deleting = not node.deleting, True
            self._background(lambda node=node, first=first: delete(node, first), f"deleting {name}")
        return lambda: not pending

    # -- scripting ---------------------------------------------------------------

    def preempt(self, node: str, grace_s: float | None = None) -> None:
        """A preemption: SIGTERM to every worker, SIGKILL after the grace; then PREEMPTED."""
        found = self._node(node)
        self._stop_workers(found.workers, self.grace_s if grace_s is None else grace_s)
        with self.service._lock:
            slot = self.service.nodes.get(found.name)
            if slot is None:
                return
            slot.script = []
            slot.set_state(tpu_v2.Node.State.PREEMPTED)
            queued = self.service.queued.get(slot.message.queued_resource)
            if queued is not None:
                queued.script = []
                queued.set_state(tpu_v2.QueuedResourceState.State.SUSPENDED)

    def pause(self, node: str) -> None:
        """Freezes every worker of the node (SIGSTOP) until it is stopped: the run cannot
        get further than it is, whatever the test does next."""
        for worker in self._node(node).workers:
            worker.signal(signal.SIGSTOP)

    def resume(self, node: str) -> None:
        """Wakes the node's paused workers (SIGCONT)."""
        for worker in self._node(node).workers:
            worker.signal(signal.SIGCONT)

    def reboot(self, node: str, worker: int, grace_s: float | None = None) -> None:
        """Worker `worker` shuts down (as `preempt`) and boots again: same disk, same metadata."""
        target = self._node(node).workers[worker]
        target.rebooting = True
        try:
            target.stop(self.grace_s if grace_s is None else grace_s)
            target.start()
        finally:
            target.rebooting = False

    def set_state(self, node: str, state) -> None:
        """The node's state from now on (its scripted states dropped)."""
        name = self._node(node).name
        with self.service._lock:
            slot = self.service.nodes[name]
            slot.script = []
            slot.set_state(state)

    def phase(self, node: str, worker: int) -> str | None:
        return self._node(node).workers[worker].metadata.guest_attributes.get(GUEST_ATTRIBUTE)

    def wait_for_phase(self, node: str, worker: int, phase: str, timeout: float = 300) -> str:
        """Until the worker's `podracer/state` starts with `phase`; its value."""
        target = self._node(node).workers[worker]

        def reached():
            value = target.metadata.guest_attributes.get(GUEST_ATTRIBUTE)
            return value if value is not None and value.startswith(phase) else None

        def running():
            # A node is listed (`runs`) just before its workers boot, and a rebooting worker
            # is down for a while: neither has stopped.
            if target.process is None or target.rebooting:
                return
            if not target.alive() and not reached():
                raise AssertionError(
                    f"worker {worker} of {node} stopped at {self.phase(node, worker)!r} before "
                    f"{phase!r}; its console:\n{_tail(target.console, 30)}")

        return wait_until(reached, timeout, f"worker {worker} of {node} to be {phase!r}",
                          check=running)

    def when(self, condition: Callable[[], object], action: Callable[[], None],
             timeout: float = 300) -> None:
        """Runs `action()` in a thread once `condition()` holds; a failure or timeout fails `close()`."""
        def watch():
            wait_until(lambda: self._closed.is_set() or condition(), timeout, "a `when` condition")
            if not self._closed.is_set():
                action()

        self._background(watch, "a `when` action")

    def consoles(self, lines: int = 40) -> str:
        """The last lines of every worker's console, deleted nodes' too: for a failure's message."""
        return "\n".join(f"--- console of {path.stem} ---\n{_tail(path, lines)}"
                         for path in sorted((self.root / "consoles").glob("*.log")))

    def alive(self) -> dict[str, list[int]]:
        """`{"NODE worker I": pids}` of every worker with a process still running."""
        found = {}
        for node in list(self._nodes.values()):
            for worker in node.workers:
                pids = worker.alive()
                if pids:
                    found[f"{node.name} worker {worker.index}"] = pids
        return found

    def assert_nothing_left(self, timeout: float = 30) -> None:
        """No worker process alive, no node, no queued resource (once deletes in flight end)."""
        def clean():
            with self.service._lock:
                return not self.service.nodes and not self.service.queued and not self.alive()

        try:
            wait_until(clean, timeout, "nothing to be left")
        except AssertionError:
            with self.service._lock:
                left = (sorted(self.service.nodes), sorted(self.service.queued), self.alive())
            raise AssertionError(f"left behind: nodes {left[0]}, queued resources {left[1]}, "
                                 f"worker processes {left[2]}") from None
        self._raise_errors()

    def close(self, raise_errors: bool = True) -> None:
        """Kills every worker, stops their metadata servers, ends the threads."""
        self._closed.set()
        for node in list(self._nodes.values()):
            self._stop_workers(node.workers, 0)
            self._discard(node)
        for thread in self._threads:
            thread.join(timeout=60)
        if raise_errors:
            self._raise_errors()

    # -- plumbing ------------------------------------------------------------------

    def _node(self, node: str) -> _Node:
        for name, found in list(self._nodes.items()):
            if node in (name, name.rsplit("/", 1)[-1]):
                return found
        raise KeyError(f"no emulated node {node!r}; there are {sorted(self._nodes)}")

    def _stop_workers(self, workers: list[_Worker], grace_s: float) -> None:
        with ThreadPoolExecutor(max(1, len(workers))) as pool:  # all at once, as a shutdown
            list(pool.map(lambda worker: worker.stop(grace_s), workers))

    def _discard(self, node: _Node) -> None:
        """Stops its metadata servers, takes its disks away (moved at once, then removed by a
        background `rm -rf`: two venvs take tens of seconds on a busy machine), forgets it."""
        for worker in node.workers:
            worker.metadata.stop()
        if node.disk.exists():
            gone = Path(tempfile.mkdtemp(dir=self.root, prefix="deleted-"))
            node.disk.rename(gone / node.disk.name)
            subprocess.Popen(["rm", "-rf", str(gone)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        self._nodes.pop(node.name, None)

    def _background(self, fn: Callable[[], object], what: str) -> None:
        def run():
            try:
                fn()
            except BaseException as error:  # surfaced by close() and assert_nothing_left()
                self._errors.append(AssertionError(f"{what} failed: {error!r}"))

        thread = threading.Thread(target=run, name=what, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _raise_errors(self) -> None:
        if self._errors:
            errors, self._errors[:] = list(self._errors), []
            raise errors[0]
