"""What every TPU worker runs at boot: install the staged code, train, report, keep the log in the bucket.

This file is the worker's program, not a module the library imports: the
startup script carries its source and runs it with the VM's own `python3`
before podracer exists there, so it uses the standard library alone (Python
3.8+, as TPU VM images ship). Its configuration is a JSON file beside it (see
`podracer.provision.startup`).

On the worker it:

1. reads its number and its peers from the metadata server (`agent-worker-number`,
   `worker-network-endpoints`), and an access token for Cloud Storage; on a
   multislice (`num_slices` > 1), its slice and the run's coordinator from the
   slice's `tpu-env` (`MEGASCALE_*`): the run's processes are numbered slice by
   slice, and worker 0 of slice 0 coordinates;
2. downloads the staged wheel, lock and launcher from `RUN_DIR/code/`;
3. installs them into a venv with `uv` (pinned), unless this very code is
   installed there already (a rebooted worker does not install again);
4. waits until every worker of the slice has installed (a barrier of objects in
   the bucket, so install times may differ by any amount), then runs the
   launcher with the training flags, `--run-dir=RUN_DIR`, and on a slice of
   several workers `--coordinator`, `--num-processes`, `--process-id` (with the
   `MEGASCALE_*` variables in its environment on a multislice); if
   training fails (a worker rebooted, a peer was lost), every worker starts it
   again together, from the last checkpoint, up to `max_restarts` times (a worker
   that sees another at a later attempt's barrier stops its own training, which
   waits on a lost peer, and joins it); `max_run_time_s` after training first
   started on this worker (a reboot keeps that time) it is stopped with SIGTERM
   (it saves a checkpoint);
5. copies its log to `RUN_DIR/logs/worker-I.log` every `log_interval_s` seconds
   and at the end, with the exit status in `RUN_DIR/logs/worker-I.exit`;
6. reports its phase as the guest attribute `podracer/state`: installing,
   running, restarting, install-failed=CODE, exit=CODE;
7. on worker 0, once the run has ended and `delete_when_done` names the slice,
   deletes it (`launch.py down`, with the service account's credentials) after
   the other workers have left their exit status in the bucket.

Endpoints are the clients' documented ones: the metadata server at
`GCE_METADATA_HOST` (google-auth's variable; metadata.google.internal by
default), Cloud Storage at `STORAGE_EMULATOR_HOST` (google-cloud-storage's;
https://storage.googleapis.com by default). The worker's home is
`PODRACER_HOME` (default /opt/podracer); worker 0's `jax.distributed`
coordinator listens on `PODRACER_COORDINATOR_PORT` (default 8476, the port JAX
uses on TPU slices).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

if __package__:  # imported, as podracer.provision.worker
    from podracer.provision.worker_io import (MEGASCALE_COORDINATOR, MEGASCALE_SLICE_ID,
                                              WORKER_ATTRIBUTE, Storage, metadata, multislice,
                                              publish_state)
else:  # run on the VM, where the startup script writes worker_io.py beside this file
    from worker_io import (MEGASCALE_COORDINATOR, MEGASCALE_SLICE_ID,  # type: ignore
                           WORKER_ATTRIBUTE, Storage, metadata, multislice, publish_state)

COORDINATOR_PORT = 8476  # the port jax.distributed uses on TPU slices


# -- the worker ----------------------------------------------------------------


class Worker:
    def __init__(self, config: dict, home: str):
        self.config = config
        self.home = home
        self.storage = Storage()
        self.worker = int(metadata("instance/attributes/agent-worker-number", "0") or 0)
        endpoints = metadata("instance/attributes/worker-network-endpoints", "") or ""
        # Each entry is `ID:PROCESS:IP`; worker i of this slice is entry i.
        self.peers = [entry.split(":")[-1] for entry in endpoints.split(",") if entry.strip()]
        self.megascale, self.not_a_slice = multislice(int(config.get("num_slices", 1)))
        per_slice = max(1, len(self.peers))
        self.processes = per_slice * int(config.get("num_slices", 1))
        # The run's process number: slice by slice, as JAX numbers a multislice's processes.
        self.index = int(self.megascale.get(MEGASCALE_SLICE_ID, 0)) * per_slice + self.worker
        self.log_path = os.path.join(home, "worker.log")
        self.log_url = f"{config['run_dir']}/logs/worker-{self.index}.log"
        self.code = os.path.join(home, "code")
        self.venv = os.path.join(home, "venv")
        self._stop_copying = threading.Event()
        self._stopped = False  # by a signal to this worker, or by the deadline
        self._out_of_time = False

    def say(self, line: str) -> None:
        with open(self.log_path, "a") as log:
            log.write(f"[podracer worker {self.index} {time.strftime('%H:%M:%S')}] {line}\n")

    # Logs -------------------------------------------------------------------

    def copy_log(self) -> None:
        try:
            with open(self.log_path, "rb") as log:
                self.storage.upload(log.read(), self.log_url)
        except (OSError, urllib.error.URLError):
            pass  # the next copy, or the last one, carries it

    def _copy_log_every(self, interval: float) -> None:
        while not self._stop_copying.wait(interval):
            self.copy_log()

    # Install ----------------------------------------------------------------

    def _fetch_code(self) -> dict:
        os.makedirs(self.code, exist_ok=True)
        files = {}
        for role, name in self.config["files"].items():
            path = os.path.join(self.code, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)  # a py: env's package, beside the launcher
            self.storage.download(f"{self.config['code_dir']}/{name}", path)
            files[role] = path
        return files

    def _installed_marker(self, files: dict) -> str:
        digest = hashlib.sha256(self.config["uv_version"].encode())
        for role in ("wheel", "lock"):
            with open(files[role], "rb") as f:
                digest.update(f.read())
        return digest.hexdigest()

    def _run(self, command: list) -> int:
        self.say("$ " + " ".join(command))
        with open(self.log_path, "a") as log:
            return subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.home)

    def install(self, files: dict) -> int:
        """0 once the staged code is installed in the venv (at once if it already is)."""
        marker_path = os.path.join(self.venv, "podracer-installed")
        marker = self._installed_marker(files)
        python = os.path.join(self.venv, "bin", "python")
        if os.path.exists(python) and _read(marker_path) == marker:
            self.say("the staged code is installed already (a reboot): not installing again")
            return 0
        tools = os.path.join(self.home, "tools")
        uv = os.path.join(tools, "bin", "uv")
        steps = [
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "--upgrade", "--target", tools, f"uv=={self.config['uv_version']}"],
            # --clear: a worker that boots again mid-install makes the venv anew.
            [uv, "venv", "--clear", "--python", self.config["python"], self.venv],
            [uv, "pip", "install", "--python", python, "-r", files["lock"], files["wheel"]],
        ]
        for command in steps:
            status = self._run(command)
            if status != 0:
                return status
        with open(marker_path, "w") as f:
            f.write(marker)
        return 0

    # Train ------------------------------------------------------------------

    def training_command(self, files: dict) -> list:
        command = [os.path.join(self.venv, "bin", "python"), files["launcher"],
                   *self.config["training_flags"], f"--run-dir={self.config['run_dir']}"]
        if self.processes > 1:
            port = int(os.environ.get("PODRACER_COORDINATOR_PORT", COORDINATOR_PORT))
            # Worker 0 of the slice, or of slice 0: the address JAX itself would take.
            host = (self.megascale[MEGASCALE_COORDINATOR].split(":")[0] if self.megascale
                    else self.peers[0])
            command += [f"--coordinator={host}:{port}",
                        f"--num-processes={self.processes}", f"--process-id={self.index}"]
        return command

    # The barrier ------------------------------------------------------------

    def _barrier_url(self, attempt: int) -> str:
        launch = metadata("instance/attributes/podracer-launch", "launch") or "launch"
        return f"{self.config['run_dir']}/barrier/{launch}/{attempt}/"

    def first_attempt(self) -> int:
        """0, or after a reboot mid-run one more than the last attempt this worker joined."""
        names = self.storage.list(self._barrier_url(0).rsplit("/", 2)[0] + "/")
        mine = [int(name.split("/")[0]) for name in names
                if name.endswith(f"/worker-{self.index}") and name.split("/")[0].isdigit()]
        return max(mine) + 1 if mine else 0

    def barrier(self, attempt: int) -> bool:
        """Waits until every worker has reached `attempt`; False after `barrier_timeout_s`."""
        url = self._barrier_url(attempt)
        self.storage.upload(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()).encode(),
                            f"{url}worker-{self.index}")
        workers = self.processes
        deadline = time.monotonic() + float(self.config.get("barrier_timeout_s", 1800))
        while time.monotonic() < deadline:
            if len(self.storage.list(url)) >= workers:
                return True
            time.sleep(2)
        self.say(f"not every worker of {workers} reached attempt {attempt} in time")
        return False

    # Train ------------------------------------------------------------------

    def train(self, files: dict) -> int:
        """Trains; on a failure, again from the last checkpoint with every worker, while allowed."""
        attempt = self.first_attempt()
        restarts = int(self.config.get("max_restarts", 0))
        while True:
            if not self.barrier(attempt):
                return 1
            status = self._train_once(files, attempt)
            if status == 0 or self._stopped or attempt >= restarts:
                return status
            attempt += 1
            self.say(f"training exited with status {status}; starting it again from the last "
                     f"checkpoint with every worker (attempt {attempt} of {restarts})")
            publish_state("restarting")

    def _deadline(self) -> float | None:
        """--max-run-time from this worker's first training start: time queued is not the run's."""
        seconds = self.config.get("max_run_time_s")
        if not seconds:
            return None
        path = os.path.join(self.home, "training_started")
        if _read(path) is None:
            with open(path, "w") as f:
                f.write(str(time.time()))
        return float(_read(path) or time.time()) + float(seconds)

    def _peer_started_again(self, attempt: int) -> bool:
        """Whether a worker has reached the barrier of a later attempt: it booted again (a
        reboot) or its training failed, so this worker's training waits on a dead peer."""
        try:
            return bool(self.storage.list(self._barrier_url(attempt + 1)))
        except (OSError, urllib.error.URLError):
            return False  # the bucket is slow to answer: look again next time

    def _train_once(self, files: dict, attempt: int) -> int:
        run_dir = os.path.join(self.home, "run")
        os.makedirs(run_dir, exist_ok=True)
        command = self.training_command(files)
        self.say("$ " + " ".join(command))
        publish_state("running")
        with open(self.log_path, "a") as log:
            child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir,
                                     env={**os.environ, **self.megascale})

        def stop(signum, _frame):  # a preempted or stopped VM: let training save and exit
            self._stopped = True
            if child.poll() is None:
                child.send_signal(signum)

        # Passed on to training while it runs; the process's own handlers come back after.
        previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT)}
        deadline = self._deadline()
        timer = None
        if deadline:
            def out_of_time():
                self.say("--max-run-time reached: stopping training (it saves a checkpoint)")
                self._out_of_time = True
                stop(signal.SIGTERM, None)
            timer = threading.Timer(max(0.0, float(deadline) - time.time()), out_of_time)
            timer.daemon = True
            timer.start()
        poll = float(self.config.get("peer_poll_s", 5))
        try:
            while True:
                try:
                    return child.wait(timeout=poll)
                except subprocess.TimeoutExpired:
                    pass
                if self.processes > 1 and self._peer_started_again(attempt):
                    # Its collectives wait on a process that is gone: nothing can be saved,
                    # the checkpoint in the bucket is where every worker starts again.
                    self.say(f"another worker started attempt {attempt + 1} (it rebooted, or its "
                             "training failed): stopping this one to start again with it")
                    child.terminate()
                    try:
                        child.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        child.kill()
                    child.wait()
                    return 1
        finally:
            if timer is not None:
                timer.cancel()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    # The end ----------------------------------------------------------------

    def delete_slice(self) -> None:
        """Worker 0 deletes its own slice once every worker has left its exit status."""
        address = self.config.get("delete_when_done")
        if not address or self.index != 0:
            return
        logs = f"{self.config['run_dir']}/logs/"
        workers = self.processes
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                ended = [name for name in self.storage.list(logs) if name.endswith(".exit")]
            except (OSError, urllib.error.URLError):
                ended = []
            if len(ended) >= workers:
                break
            time.sleep(2)
        command = [os.path.join(self.venv, "bin", "python"), "-m", "podracer.provision.cli",
                   "down", address["name"], f"--zone={address['zone']}",
                   f"--project={address['project']}"]
        if address.get("api_endpoint"):
            command.append(f"--api-endpoint={address['api_endpoint']}")
        self.say("the run has ended: deleting this slice")
        self.copy_log()
        self._run(command)

    def main(self) -> int:
        exit_file = os.path.join(self.home, "exit_code")
        finished = _read(exit_file)
        # Before any state: whose states they are (the API lists a slice's workers unnamed).
        publish_state(str(self.worker), WORKER_ATTRIBUTE)
        if finished is not None:  # a reboot after the run ended must not start it over
            publish_state(f"exit={finished}")
            return 0
        copier = threading.Thread(target=self._copy_log_every,
                                  args=(float(self.config.get("log_interval_s", 10)),), daemon=True)
        copier.start()
        try:
            publish_state("installing")
            self.say(f"worker {self.index} of {self.processes}; run directory "
                     f"{self.config['run_dir']}")
            if self.not_a_slice:
                self.say(self.not_a_slice)
                return self._finish(exit_file, "exit", 1)
            try:
                files = self._fetch_code()
            except (OSError, urllib.error.URLError) as error:
                self.say(f"cannot download the staged code from {self.config['code_dir']}: {error}")
                return self._finish(exit_file, "install-failed", 1)
            status = self.install(files)
            if status != 0:
                return self._finish(exit_file, "install-failed", status)
            status = self.train(files)
            self.say(f"training exited with status {status}")
            if self._stopped and not self._out_of_time:
                # The VM is going down (a reboot, a preemption): training saved and stopped,
                # it did not end. No exit status is kept, so the next boot of this disk resumes.
                publish_state("stopping")
                return status
            status = self._finish(exit_file, "exit", status)
            # A finished run, or one out of time; not one stopped by a reboot or a preemption.
            if status == 0 or self._out_of_time:
                self.delete_slice()
            return status
        finally:
            self._stop_copying.set()
            self.copy_log()

    def _finish(self, exit_file: str, phase: str, status: int) -> int:
        status = status if status >= 0 else 128 - status  # killed by a signal
        with open(exit_file, "w") as f:
            f.write(str(status))
        try:
            self.storage.upload(str(status).encode(),
                                f"{self.config['run_dir']}/logs/worker-{self.index}.exit")
        except (OSError, urllib.error.URLError):
            pass
        publish_state(f"{phase}={status}")
        return status


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def main(argv: list) -> int:
    with open(argv[1]) as f:
        config = json.load(f)
    home = os.environ.get("PODRACER_HOME", os.path.dirname(os.path.abspath(argv[1])))
    os.makedirs(home, exist_ok=True)
    return Worker(config, home).main()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
