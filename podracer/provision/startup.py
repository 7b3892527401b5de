"""The startup script every TPU worker runs, and the state it reports back.

The script writes three files into the worker's home and runs the first with
the VM's own `python3`: `worker.py` and `worker_io.py` (the sources of
`podracer.provision.worker` and `worker_io`, standard library only, since
podracer is not installed yet) and `worker.json`, its configuration: where the run directory and the staged code
are, the file names, the pinned `uv` and Python, and the training flags. The
worker reports its progress through the guest attribute `podracer/state`,
which the provisioner reads with `GetGuestAttributes`, and copies its log to
`RUN_DIR/logs/worker-I.log`: nothing needs SSH access to know how a run went.

Both files go in quoted heredocs, which the shell does not expand; the
configuration is one line of JSON, so no value can end its heredoc early.

Training runs as a systemd unit of its own (`podracer-worker`), not as a child of
the script. The guest agent runs startup scripts in a oneshot service with
`KillMode=process`: at shutdown (a preemption, a stop, a maintenance event)
systemd sends SIGTERM to the script runner alone, and whatever the script started
is killed only at the very end, after the network is down, with no chance to save.
systemd stops units in the reverse order of their start: a unit ordered
`After=network-online.target` is stopped, with SIGTERM, before the network goes
(systemd.special(7)); `KillMode=mixed` sends that SIGTERM to the worker program
alone (it passes it on to training, which saves a checkpoint) and SIGKILL to what
is left after `TimeoutStopSec`. The unit gets the script's environment. Where
`systemd-run` is missing or cannot start the unit (a machine not booted with
systemd), the script runs the worker itself, as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from podracer.provision import worker, worker_io

GUEST_ATTRIBUTE_NAMESPACE, GUEST_ATTRIBUTE_KEY = worker_io.GUEST_ATTRIBUTE.split("/")
WORKER_KEY = worker_io.WORKER_ATTRIBUTE.split("/")[1]
WORKER_HOME = "/opt/podracer"
_WORKER_DELIMITER = "PODRACER_WORKER_EOF"
_WORKER_IO_DELIMITER = "PODRACER_WORKER_IO_EOF"
_CONFIG_DELIMITER = "PODRACER_CONFIG_EOF"
WORKER_UNIT = "podracer-worker"
# Time to save a checkpoint to Cloud Storage once stopped (a preemption gives 30 s in all).
UNIT_STOP_TIMEOUT_S = 120


def worker_config(run_dir: str, code_dir: str, files: dict[str, str], training_flags,
                  uv_version: str, python: str, log_interval_s: float = 10.0,
                  max_restarts: int = 0, max_run_time_s: float | None = None,
                  delete_when_done: dict | None = None, num_slices: int = 1) -> dict:
    """What `worker.py` reads: the run, the staged code, and the flags to train with.

    `max_restarts`: how often the workers start training again, together, from
    the last checkpoint after it failed (a worker rebooted, a peer lost);
    `max_run_time_s`: how long after it first started training on this slice
    training is stopped (saving a checkpoint) whatever its progress, so that
    time spent queued for capacity does not count; `delete_when_done`: the slice worker 0 deletes once the run
    has ended (`name`, `zone`, `project`, `api_endpoint`), or None; `num_slices`:
    the slices of a multislice, whose workers join one run (the slice's own
    metadata says which slice a worker is on).
    """
    return {"run_dir": run_dir, "code_dir": code_dir, "files": dict(files),
            "uv_version": uv_version, "python": python,
            "training_flags": list(training_flags), "log_interval_s": log_interval_s,
            "max_restarts": max_restarts, "max_run_time_s": max_run_time_s,
            "delete_when_done": delete_when_done, "num_slices": num_slices}


def worker_source(module=worker) -> str:
    source = Path(module.__file__).read_text()
    return source if source.endswith("\n") else source + "\n"


def make_startup_script(config: dict) -> str:
    """Bash that writes the worker program and its configuration, then runs it."""
    return f"""#!/bin/bash
# podracer worker: install the code staged in the run's bucket, then train.
# Progress: guest attribute {worker_io.GUEST_ATTRIBUTE} (installing, running,
# install-failed=CODE, exit=CODE); log: RUN_DIR/logs/worker-I.log.
home="${{PODRACER_HOME:-{WORKER_HOME}}}"
mkdir -p "$home" || exit 1
cat >"$home/worker_io.py" <<'{_WORKER_IO_DELIMITER}'
{worker_source(worker_io)}{_WORKER_IO_DELIMITER}
cat >"$home/worker.py" <<'{_WORKER_DELIMITER}'
{worker_source(worker)}{_WORKER_DELIMITER}
cat >"$home/worker.json" <<'{_CONFIG_DELIMITER}'
{json.dumps(config, sort_keys=True)}
{_CONFIG_DELIMITER}
export PODRACER_HOME="$home"
# Training as a unit of its own, which a shutdown stops with SIGTERM before the
# network goes (the script runner's own children would be killed after it).
if command -v systemd-run >/dev/null 2>&1; then
  unit_environment=()
  while IFS= read -r name; do
    unit_environment+=("--setenv=$name=${{!name}}")
  done < <(compgen -e)
  if systemd-run --unit={WORKER_UNIT} --collect -p KillMode=mixed \\
      -p TimeoutStopSec={UNIT_STOP_TIMEOUT_S} -p After=network-online.target \\
      -p Wants=network-online.target -p StandardOutput=journal+console \\
      -p StandardError=journal+console -p WorkingDirectory="$home" \\
      "${{unit_environment[@]}}" "$(command -v python3)" "$home/worker.py" "$home/worker.json"; then
    exit 0
  fi
  echo "podracer: systemd-run could not start unit {WORKER_UNIT}; the worker runs under this script"
fi
exec python3 "$home/worker.py" "$home/worker.json"
"""


@dataclass(frozen=True)
class WorkerState:
    """What one worker last published: a phase and, once finished, an exit code."""

    phase: str
    exit_code: int | None = None

    @property
    def finished(self) -> bool:
        return self.exit_code is not None

    @property
    def failed(self) -> bool:
        return self.exit_code not in (None, 0)

    def describe(self) -> str:
        if self.phase == "install-failed":
            return f"install failed (exit {self.exit_code})"
        if self.phase == "exited":
            return f"exited {self.exit_code}"
        return self.phase


def parse_worker_state(value: str | None) -> WorkerState:
    """Reads a `podracer/state` value; None means the worker has not reported yet."""
    if value is None:
        return WorkerState("booting")
    phase, _, code = value.strip().partition("=")
    if code:
        try:
            exit_code = int(code)
        except ValueError:
            return WorkerState(f"unknown ({value.strip()[:40]})")
        return WorkerState("exited" if phase == "exit" else phase, exit_code)
    return WorkerState(phase or "booting")
