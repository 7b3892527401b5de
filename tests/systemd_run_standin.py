"""`systemd-run` as the emulated pod's workers find it on their PATH (tests/emulated_pod.py).

    systemd-run --unit=NAME [--collect] [-p KEY=VALUE ...] [--setenv=NAME=VALUE ...] COMMAND...

starts COMMAND as a transient service of its own, as systemd does: a process session of
its own (not the caller's process group, which a shutdown does not reach the same way),
only the `--setenv` environment (PATH the manager's where not set), `WorkingDirectory`,
output to the console (`StandardOutput=journal+console`: the caller's), and returns once
it has started. It records the unit in `$EMULATED_SYSTEMD_UNITS/NAME.json` (its main
pid, `KillMode`, `TimeoutStopSec`) for the emulated shutdown, which stops it as systemd
stops units at shutdown. A unit of that name still running, or an option systemd-run
would not take this way, fails as systemd-run does: a message and exit 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MANAGER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def not_booted_with_systemd(folder: Path) -> str:
    """A folder holding a `systemd-run` that fails as it does on a machine not booted with
    systemd, whatever this machine has: put it first on PATH where the startup script
    must run the worker itself."""
    folder.mkdir(parents=True, exist_ok=True)
    failing = folder / "systemd-run"
    failing.write_text("#!/bin/sh\necho 'System has not been booted with systemd as init "
                       "system (PID 1). Can'\\''t operate.' >&2\nexit 1\n")
    failing.chmod(0o755)
    return str(folder)


def _session_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main(argv: list[str]) -> int:
    unit, properties, environment = None, {}, {}
    args = list(argv)
    while args and args[0].startswith("-"):
        option = args.pop(0)
        if option.startswith("--unit="):
            unit = option.split("=", 1)[1]
        elif option == "--collect":
            pass  # a failed unit is forgotten once it has stopped: this stand-in keeps none
        elif option in ("-p", "--property") and args:
            key, _, value = args.pop(0).partition("=")
            properties[key] = value
        elif option.startswith("--setenv="):
            name, _, value = option.split("=", 1)[1].partition("=")
            environment[name] = value
        else:
            print(f"systemd-run (emulated): unknown option {option}", file=sys.stderr)
            return 1
    if not unit or not args:
        print("systemd-run (emulated): needs --unit=NAME and a command", file=sys.stderr)
        return 1
    units = Path(os.environ["EMULATED_SYSTEMD_UNITS"])
    units.mkdir(parents=True, exist_ok=True)
    record = units / f"{unit}.json"
    if record.exists() and _session_alive(json.loads(record.read_text())["pid"]):
        print(f"Failed to start transient service unit: Unit {unit}.service already exists.",
              file=sys.stderr)
        return 1
    environment.setdefault("PATH", MANAGER_PATH)
    process = subprocess.Popen(args, env=environment, cwd=properties.get("WorkingDirectory", "/"),
                               stdin=subprocess.DEVNULL, start_new_session=True)
    record.write_text(json.dumps({
        "pid": process.pid, "kill_mode": properties.get("KillMode", "control-group"),
        "timeout_stop_s": float(properties.get("TimeoutStopSec", 90))}))
    print(f"Running as unit: {unit}.service", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
