"""A TPU worker's boot, for real, on this machine.

The launcher (`python launch/tpu.py up`, against the test TPU API server) stages
its wheel and lock in an emulated bucket; the startup script it put in the
node's metadata is run by bash in a temporary home, with the metadata server
and Cloud Storage at local servers (their documented variables:
`GCE_METADATA_HOST`, `STORAGE_EMULATOR_HOST`). The worker installs `uv`, then
exactly the staged wheel and lock, from a local wheel directory (pip's and
uv's documented offline variables: this machine has no index), with `libtpu`
left out (`UV_EXCLUDE`: there is no TPU here), and trains; its outputs and its
log land in the bucket.
"""

import json
import os
import shutil
import subprocess

import pytest

pytest.importorskip("google.cloud.tpu_v2", reason="needs the tpu extra")

from emulated_pod import worker_environment  # noqa: E402
from metadata_server import MetadataServer, worker_endpoints  # noqa: E402
from systemd_run_standin import not_booted_with_systemd  # noqa: E402
from tpu_server import FakeTpuService, TpuServer  # noqa: E402

from podracer.provision import api_requests, staging  # noqa: E402
from podracer.command import main  # noqa: E402  (the front door)

BUCKET = "gs://podracer-runs"
STEPS = 4096
TRAINING = ["--arch=anakin", "--algo=ppo", "--env=CartPole-v1", f"--total-steps={STEPS}",
            "--num-envs=8", "--rollout-len=64", "--checkpoint-every=2048"]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("git") is None,
                                reason="needs bash and git")


@pytest.fixture(scope="module")
def launched(gcs_bucket, tmp_path_factory):
    """`up` against the test API server: the startup script it sent and the run directory."""
    service = FakeTpuService(workers=1)
    service.worker_states = [["running"]]
    with TpuServer(service) as server:
        status = main(["up", "--tpu=w1", "--zone=us-central2-b", "--project=proj",
                       "--accelerator-type=v4-8", f"--bucket={BUCKET}",
                       f"--api-endpoint={server.endpoint}", "--poll-interval=0.01", *TRAINING])
    assert status == 0
    (create,) = service.requests_of("CreateNode")
    return create.node.metadata["startup-script"], create.node.metadata[api_requests.RUN_DIR_KEY]


def _boot(script: str, home, metadata: MetadataServer, offline: dict, timeout=420):
    """The script in the foreground: `systemd-run` fails, so it runs the worker itself."""
    env = {**worker_environment(offline), "PODRACER_HOME": str(home), "GCE_METADATA_HOST": metadata.host}
    env["PATH"] = os.pathsep.join([not_booted_with_systemd(home.parent / "no-systemd"), env["PATH"]])
    return subprocess.run(["bash", "-c", script], env=env, cwd=home, capture_output=True,
                          text=True, timeout=timeout)


def _read(bucket, run_dir: str, name: str) -> str:
    return bucket.blob(f"{run_dir.removeprefix(BUCKET + '/')}/{name}").download_as_text()


def test_a_worker_installs_the_staged_code_trains_into_the_bucket_and_reboots_cleanly(
        launched, offline_install, gcs_bucket, tmp_path):
    script, run_dir = launched
    home = tmp_path / "worker home"
    home.mkdir()
    attributes = {"agent-worker-number": "0", "worker-network-endpoints": worker_endpoints(["127.0.0.1"])}
    with MetadataServer(attributes) as metadata:
        booted = _boot(script, home, metadata, offline_install)
        assert booted.returncode == 0, (booted.stdout, booted.stderr, (home / "worker.log").read_text())
        assert metadata.guest_attributes["podracer/state"] == "exit=0"

        # Every output is in the bucket, nothing under the worker's home but its venv and log.
        summary = json.loads(_read(gcs_bucket, run_dir, "summary.json"))
        assert summary["env_steps"] == STEPS and summary["config"]["run"]["run_dir"] == run_dir
        prefix = run_dir.removeprefix(BUCKET + "/") + "/"
        names = {blob.name.removeprefix(prefix) for blob in gcs_bucket.list_blobs(prefix=prefix)}
        assert {"metrics.jsonl", "logs/worker-0.log", "logs/worker-0.exit"} <= names
        assert any(name.startswith("checkpoints/") for name in names)
        assert any(name.startswith("tensorboard/events.out.tfevents") for name in names)
        assert _read(gcs_bucket, run_dir, "logs/worker-0.exit") == "0"
        log = _read(gcs_bucket, run_dir, "logs/worker-0.log")
        assert "uv pip install" in log and "new run in " + run_dir in log

        # It ran the staged wheel, version stamped with this checkout's commit: not this
        # checkout, and nothing installed by name from an index.
        python = home / "venv" / "bin" / "python"
        version = subprocess.run([str(python), "-c", "import podracer; print(podracer.__version__); print(podracer.__file__)"],
                                 capture_output=True, text=True, check=True, cwd=home,
                                 env={"PATH": os.environ["PATH"]}).stdout.splitlines()
        assert version[0] == staging.stamped_version(staging.REPO_ROOT)
        assert version[1].startswith(str(home / "venv"))

        # A reboot runs the script again: the finished run is not started over.
        again = _boot(script, home, metadata, offline_install, timeout=120)
        assert again.returncode == 0
        assert metadata.guest_attributes["podracer/state"] == "exit=0"
        assert (home / "worker.log").read_text().count("uv pip install") == 1


def test_a_worker_whose_install_fails_says_so_in_the_bucket(launched, offline_install, gcs_bucket,
                                                             tmp_path):
    script, run_dir = launched
    home = tmp_path / "home"
    home.mkdir()
    broken = {**offline_install, "UV_FIND_LINKS": str(tmp_path / "empty"),
              "UV_CACHE_DIR": str(tmp_path / "c")}
    (tmp_path / "empty").mkdir()
    attributes = {"agent-worker-number": "3", "worker-network-endpoints": worker_endpoints(["127.0.0.1"])}
    with MetadataServer(attributes) as metadata:
        booted = _boot(script, home, metadata, broken, timeout=120)
        state = metadata.guest_attributes["podracer/state"]
        number = metadata.guest_attributes["podracer/worker"]  # whose state it is, for the launcher
    assert booted.returncode != 0 and state.startswith("install-failed=") and number == "3"
    assert _read(gcs_bucket, run_dir, "logs/worker-3.exit") == state.split("=")[1]
    assert "uv pip install" in _read(gcs_bucket, run_dir, "logs/worker-3.log")
