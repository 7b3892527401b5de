"""What every TPU worker runs at boot: install the staged code, train, report, keep the log in the bucket.

This file is the worker's program, not a module the library imports: the
startup script carries its source and runs it with the VM's own `python3`
before podracer exists there, so it uses the standard library alone (Python
3.8+, as TPU VM images ship). Its configuration is a JSON file beside it (see
`podracer.provision.startup`).

On the worker it:

1. reads its number and its peers from the metadata server (`agent-worker-number`,
   `worker-network-endpoints`), and an access token for Cloud Storage;
2. downloads the staged wheel, lock and launcher from `RUN_DIR/code/`;
3. installs them into a venv with `uv` (pinned), unless this very code is
   installed there already (a rebooted worker does not install again);
4. runs the launcher with the training flags, `--run-dir=RUN_DIR`, and on a
   slice of several workers `--coordinator`, `--num-processes`, `--process-id`;
5. copies its log to `RUN_DIR/logs/worker-I.log` every `log_interval_s` seconds
   and at the end, with the exit status in `RUN_DIR/logs/worker-I.exit`;
6. reports its phase as the guest attribute `podracer/state`: installing,
   running, install-failed=CODE, exit=CODE.

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

GUEST_ATTRIBUTE = "podracer/state"
COORDINATOR_PORT = 8476  # the port jax.distributed uses on TPU slices
HTTP_TIMEOUT_S = 60


# -- endpoints -----------------------------------------------------------------


def _metadata_root() -> str:
    host = os.environ.get("GCE_METADATA_HOST", "metadata.google.internal")
    return f"http://{host}/computeMetadata/v1/"


def metadata(path: str, default: str | None = None, attempts: int = 8) -> str | None:
    """A metadata value (`instance/attributes/agent-worker-number`), or `default` if absent.

    Early in a boot the metadata server may not answer yet: connection errors and
    5xx answers are retried, 1, 2, 4 ... s apart (about 4 minutes in all).
    """
    request = urllib.request.Request(_metadata_root() + path, headers={"Metadata-Flavor": "Google"})
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as answer:
                return answer.read().decode()
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return default
            if error.code < 500 or attempt == attempts - 1:
                raise
        except (OSError, urllib.error.URLError):
            if attempt == attempts - 1:
                raise
        time.sleep(2 ** attempt)
    return default


def publish_state(value: str) -> None:
    """Sets the guest attribute the launcher reads; a metadata hiccup must not stop the run."""
    request = urllib.request.Request(
        _metadata_root() + "instance/guest-attributes/" + GUEST_ATTRIBUTE, data=value.encode(),
        method="PUT", headers={"Metadata-Flavor": "Google"})
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except (OSError, urllib.error.URLError):
        pass


class Storage:
    """Cloud Storage's JSON API with the worker's service-account token."""

    def __init__(self):
        self.base = os.environ.get("STORAGE_EMULATOR_HOST", "https://storage.googleapis.com")
        if "://" not in self.base:
            self.base = "http://" + self.base
        self.base = self.base.rstrip("/")
        self._token, self._expires = "", 0.0

    def _authorization(self) -> dict:
        if time.monotonic() > self._expires:
            answer = json.loads(metadata("instance/service-accounts/default/token") or "{}")
            self._token = answer.get("access_token", "")
            self._expires = time.monotonic() + max(0, int(answer.get("expires_in", 0)) - 60)
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    @staticmethod
    def split(url: str) -> tuple[str, str]:
        bucket, _, name = url[len("gs://"):].partition("/")
        return bucket, name

    def download(self, url: str, path: str) -> None:
        bucket, name = self.split(url)
        request = urllib.request.Request(
            f"{self.base}/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}?alt=media",
            headers=self._authorization())
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as answer, \
                open(path + ".part", "wb") as out:
            while True:
                chunk = answer.read(1 << 20)
                if not chunk:
                    break
                out.write(chunk)
        os.replace(path + ".part", path)

    def upload(self, data: bytes, url: str) -> None:
        bucket, name = self.split(url)
        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
        request = urllib.request.Request(
            f"{self.base}/upload/storage/v1/b/{bucket}/o?{query}", data=data, method="POST",
            headers={**self._authorization(), "Content-Type": "application/octet-stream"})
        urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S).close()


# -- the worker ----------------------------------------------------------------


class Worker:
    def __init__(self, config: dict, home: str):
        self.config = config
        self.home = home
        self.storage = Storage()
        self.index = int(metadata("instance/attributes/agent-worker-number", "0") or 0)
        endpoints = metadata("instance/attributes/worker-network-endpoints", "") or ""
        # Each entry is `ID:PROCESS:IP`; worker i is entry i.
        self.peers = [entry.split(":")[-1] for entry in endpoints.split(",") if entry.strip()]
        self.log_path = os.path.join(home, "worker.log")
        self.log_url = f"{config['run_dir']}/logs/worker-{self.index}.log"
        self.code = os.path.join(home, "code")
        self.venv = os.path.join(home, "venv")
        self._stop_copying = threading.Event()

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
        if len(self.peers) > 1:
            port = int(os.environ.get("PODRACER_COORDINATOR_PORT", COORDINATOR_PORT))
            command += [f"--coordinator={self.peers[0]}:{port}",
                        f"--num-processes={len(self.peers)}", f"--process-id={self.index}"]
        return command

    def train(self, files: dict) -> int:
        run_dir = os.path.join(self.home, "run")
        os.makedirs(run_dir, exist_ok=True)
        command = self.training_command(files)
        self.say("$ " + " ".join(command))
        with open(self.log_path, "a") as log:
            child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir)

        def forward(signum, _frame):  # a preempted or stopped VM: let training save and exit
            if child.poll() is None:
                child.send_signal(signum)

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, forward)
        return child.wait()

    def main(self) -> int:
        exit_file = os.path.join(self.home, "exit_code")
        finished = _read(exit_file)
        if finished is not None:  # a reboot after the run ended must not start it over
            publish_state(f"exit={finished}")
            return 0
        copier = threading.Thread(target=self._copy_log_every,
                                  args=(float(self.config.get("log_interval_s", 10)),), daemon=True)
        copier.start()
        try:
            publish_state("installing")
            self.say(f"worker {self.index} of {max(1, len(self.peers))}; run directory "
                     f"{self.config['run_dir']}")
            try:
                files = self._fetch_code()
            except (OSError, urllib.error.URLError) as error:
                self.say(f"cannot download the staged code from {self.config['code_dir']}: {error}")
                return self._finish(exit_file, "install-failed", 1)
            status = self.install(files)
            if status != 0:
                return self._finish(exit_file, "install-failed", status)
            publish_state("running")
            status = self.train(files)
            self.say(f"training exited with status {status}")
            return self._finish(exit_file, "exit", status)
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
