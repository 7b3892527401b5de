"""The startup script every TPU worker runs, and the state it reports back.

The script is the only code that runs on the slice on podracer's behalf: it
installs podracer, writes the launcher that started the slice, and runs that
launcher with the user's training flags. It reports progress through the
guest attribute `podracer/state`, which the provisioner reads with
`GetGuestAttributes`, so nothing needs SSH access to know how the run went.

Every value that comes from the user goes through `shlex.quote`; the launcher's
own source goes in a quoted heredoc, which the shell does not expand.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from podracer.errors import PodracerError
from podracer.provision.spec import WorkerLayout

GUEST_ATTRIBUTE_NAMESPACE = "podracer"
GUEST_ATTRIBUTE_KEY = "state"
# podracer needs Python 3.11; TPU VM images ship an older one, so uv brings its own.
WORKER_PYTHON = "3.11"
_LAUNCHER_DELIMITER = "PODRACER_LAUNCHER_EOF"
_METADATA_URL = (
    "http://metadata.google.internal/computeMetadata/v1/instance/guest-attributes/"
    f"{GUEST_ATTRIBUTE_NAMESPACE}/{GUEST_ATTRIBUTE_KEY}"
)


def make_startup_script(
    install_spec: str,
    launcher_source: str,
    training_flags: list[str] | tuple[str, ...],
    layout: WorkerLayout = WorkerLayout(),
) -> str:
    """Bash that installs `install_spec` and runs `python launch/tpu.py <training_flags>`."""
    if any(line == _LAUNCHER_DELIMITER for line in launcher_source.splitlines()):
        raise PodracerError(
            f"the launcher contains the line {_LAUNCHER_DELIMITER}, which would end "
            "its copy in the startup script early; remove that line")
    if not launcher_source.endswith("\n"):
        launcher_source += "\n"
    q = shlex.quote
    # Every worker of a slice is one process of the run: jax.distributed.initialize()
    # finds the others from the TPU metadata.
    command = " \\\n  ".join(
        ['"$VENV/bin/python" launch/tpu.py', *(q(flag) for flag in training_flags),
         "--distributed=auto"])
    return f"""#!/bin/bash
# podracer worker: install podracer, then run the training launcher.
# Progress goes to the guest attribute {GUEST_ATTRIBUTE_NAMESPACE}/{GUEST_ATTRIBUTE_KEY}:
# installing, running, install-failed=CODE, exit=CODE.
set -uo pipefail

RUN_DIR={q(layout.run_dir)}
VENV={q(layout.venv)}
LOG={q(layout.log_path)}
EXIT_CODE_FILE={q(layout.exit_code_path)}

publish_state() {{
  curl --silent --fail --max-time 10 -X PUT --data "$1" \\
    -H 'Metadata-Flavor: Google' {q(_METADATA_URL)} >/dev/null || true
}}

# A reboot runs this script again; a run that has finished must not start over.
if [ -e "$EXIT_CODE_FILE" ]; then
  publish_state "exit=$(cat "$EXIT_CODE_FILE")"
  exit 0
fi
mkdir -p "$RUN_DIR/launch" || exit 1
cd "$RUN_DIR" || exit 1
exec >>"$LOG" 2>&1

publish_state installing
python3 -m pip install --quiet --upgrade uv \\
  && python3 -m uv venv --python {WORKER_PYTHON} "$VENV" \\
  && python3 -m uv pip install --python "$VENV/bin/python" 'jax[tpu]' {q(install_spec)}
status=$?
if [ "$status" -ne 0 ]; then
  echo "$status" >"$EXIT_CODE_FILE"
  publish_state "install-failed=$status"
  exit "$status"
fi

cat >launch/tpu.py <<'{_LAUNCHER_DELIMITER}'
{launcher_source}{_LAUNCHER_DELIMITER}

publish_state running
{command}
status=$?
echo "$status" >"$EXIT_CODE_FILE"
publish_state "exit=$status"
exit "$status"
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
