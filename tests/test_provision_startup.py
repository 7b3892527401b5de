"""The worker startup script: bash that writes the worker program and its
configuration, then runs it (the full boot, install and training, is
tests/test_provision_worker.py). Here: what the user gives it cannot escape
into the shell, and the worker program's own paths without an install."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from metadata_server import MetadataServer, worker_endpoints
from systemd_run_standin import not_booted_with_systemd
from podracer.provision import worker
from podracer.provision.startup import (WorkerState, make_startup_script, parse_worker_state,
                                        worker_config)

BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")

HOSTILE_FLAGS = [
    "--arch=sebulba",
    "--note=; rm -rf / ;",
    "--name=$(touch PWNED_SUBSHELL)",
    "--tag=`touch PWNED_BACKTICK`",
    "--quote=it's \"quoted\"",
    "--multi=line one\nline two; touch PWNED_NEWLINE\nPODRACER_CONFIG_EOF\ntouch PWNED_HEREDOC",
    "--var=$HOME ${PATH} $((1+1))",
    "--glob=*",
    "&& touch PWNED_AND",
    "--empty=",
    "",
]


def _config(flags, bucket="gs://no-such-bucket-here/run"):
    return worker_config(bucket, bucket + "/code", {"wheel": "w.whl", "lock": "l.lock",
                                                    "launcher": "launcher.py"},
                         flags, "0.13.9", "3.11", log_interval_s=0.2)


def _boot(tmp_path, script, metadata, storage_url) -> subprocess.CompletedProcess:
    """The script run here, where `systemd-run` fails as it does on a machine not booted
    with systemd: the script runs the worker itself (tests/test_provision_pod.py runs
    it as a unit)."""
    home = tmp_path / "po dracer's home"  # a space and a quote: paths must be quoted too
    bin_dir = not_booted_with_systemd(tmp_path / "bin")
    return subprocess.run(
        [BASH, "-c", script], cwd=tmp_path, timeout=60, capture_output=True, text=True,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin:" + str(Path(shutil.which("python3")).parent),
             "HOME": str(tmp_path), "PODRACER_HOME": str(home),
             "GCE_METADATA_HOST": metadata.host, "STORAGE_EMULATOR_HOST": storage_url})


def test_hostile_flags_reach_the_worker_verbatim_and_nothing_escapes(tmp_path, gcs_emulator):
    config = _config(HOSTILE_FLAGS)
    script = make_startup_script(config)
    attributes = {"agent-worker-number": "0", "worker-network-endpoints": worker_endpoints(["127.0.0.1"])}

    with MetadataServer(attributes) as metadata:
        done = _boot(tmp_path, script, metadata, gcs_emulator.url)
        state = metadata.guest_attributes.get("podracer/state")

    home = tmp_path / "po dracer's home"
    assert json.loads((home / "worker.json").read_text()) == config
    assert (home / "worker.py").read_text() == Path(worker.__file__).read_text()
    pwned = list(tmp_path.rglob("PWNED*")) + list(Path("/").glob("PWNED*"))
    assert pwned == []
    # The bucket does not exist here: the worker cannot fetch the code, and says so.
    assert (done.returncode, state) == (1, "install-failed=1")
    assert "the worker runs under this script" in done.stdout
    assert "cannot download the staged code" in (home / "worker.log").read_text()
    assert (home / "exit_code").read_text() == "1"


def test_a_reboot_after_the_run_ended_reports_it_and_starts_nothing(tmp_path, gcs_emulator):
    script = make_startup_script(_config(["--arch=anakin"]))
    home = tmp_path / "po dracer's home"
    home.mkdir()
    (home / "exit_code").write_text("3")
    with MetadataServer({"agent-worker-number": "0"}) as metadata:
        done = _boot(tmp_path, script, metadata, gcs_emulator.url)
        assert metadata.guest_attributes["podracer/state"] == "exit=3"
    assert done.returncode == 0 and not (home / "worker.log").exists()


def test_the_training_command_joins_a_slice_of_several_workers(tmp_path):
    with MetadataServer({"agent-worker-number": "2", "worker-network-endpoints":
                         worker_endpoints(["10.0.0.2", "10.0.0.3", "10.0.0.4"])}) as metadata:
        import os

        previous = os.environ.get("GCE_METADATA_HOST")
        os.environ["GCE_METADATA_HOST"] = metadata.host
        try:
            several = worker.Worker(_config(["--arch=anakin"]), str(tmp_path))
            metadata.attributes["worker-network-endpoints"] = worker_endpoints(["10.0.0.2"])
            alone = worker.Worker(_config(["--arch=anakin"]), str(tmp_path))
        finally:
            if previous is None:
                os.environ.pop("GCE_METADATA_HOST")
            else:
                os.environ["GCE_METADATA_HOST"] = previous
    files = {"launcher": "L.py"}
    assert several.training_command(files)[1:] == [
        "L.py", "--arch=anakin", "--run-dir=gs://no-such-bucket-here/run",
        "--coordinator=10.0.0.2:8476", "--num-processes=3", "--process-id=2"]
    assert alone.training_command(files)[1:] == [
        "L.py", "--arch=anakin", "--run-dir=gs://no-such-bucket-here/run"]


def test_script_is_valid_bash():
    script = make_startup_script(_config([]))
    done = subprocess.run([BASH, "-n"], input=script, text=True, capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert script.startswith("#!/bin/bash\n")


@pytest.mark.parametrize("value, expected", [
    (None, WorkerState("booting")),
    ("installing", WorkerState("installing")),
    ("running", WorkerState("running")),
    ("exit=0", WorkerState("exited", 0)),
    ("exit=137", WorkerState("exited", 137)),
    ("install-failed=1", WorkerState("install-failed", 1)),
    ("exit=garbage", WorkerState("unknown (exit=garbage)")),
])
def test_parse_worker_state(value, expected):
    assert parse_worker_state(value) == expected


def test_worker_state_outcomes():
    assert WorkerState("exited", 0).finished and not WorkerState("exited", 0).failed
    assert WorkerState("exited", 2).failed
    assert WorkerState("install-failed", 1).failed
    assert not WorkerState("running").finished
    assert WorkerState("install-failed", 1).describe() == "install failed (exit 1)"


def test_workers_meet_at_a_barrier_in_the_bucket_and_a_rebooted_one_joins_the_next_attempt(
        tmp_path, gcs_bucket, monkeypatch):
    run_dir = f"gs://{gcs_bucket.name}/barrier-run"
    config = {**_config(["--arch=anakin"], bucket=run_dir), "barrier_timeout_s": 0.5}
    endpoints = worker_endpoints(["10.0.0.2", "10.0.0.3"])
    with MetadataServer({"agent-worker-number": "0", "worker-network-endpoints": endpoints,
                         "podracer-launch": "l1"}) as zero, \
            MetadataServer({"agent-worker-number": "1", "worker-network-endpoints": endpoints,
                            "podracer-launch": "l1"}) as one:
        monkeypatch.setenv("GCE_METADATA_HOST", zero.host)
        for home in ("w0", "w1"):
            (tmp_path / home).mkdir()
        first = worker.Worker(config, str(tmp_path / "w0"))
        assert first.first_attempt() == 0
        assert first.barrier(0) is False  # alone: the other worker never came
        monkeypatch.setenv("GCE_METADATA_HOST", one.host)
        second = worker.Worker(config, str(tmp_path / "w1"))
        assert second.barrier(0) is True  # both are there now
        # Worker 1 reboots mid-run: it joins the attempt after the one it was in.
        assert worker.Worker(config, str(tmp_path / "w1")).first_attempt() == 1
    names = sorted(blob.name for blob in gcs_bucket.list_blobs(prefix="barrier-run/barrier/"))
    assert names == ["barrier-run/barrier/l1/0/worker-0", "barrier-run/barrier/l1/0/worker-1"]
