"""Runs on an emulated pod slice: `python launch/tpu.py` against the test TPU API
server, whose nodes' workers boot for real on this machine (tests/emulated_pod.py):
each runs the startup script the launcher sent, installs the staged code offline,
and trains as one process of a `jax.distributed` run on 127.0.0.1, into the
emulated bucket.
"""

import json
import shutil

import pytest

pytest.importorskip("google.cloud.tpu_v2", reason="needs the tpu extra")

from emulated_pod import EmulatedPod, worker_environment  # noqa: E402
from tpu_server import FakeTpuService, TpuServer  # noqa: E402

from podracer.provision import api_requests  # noqa: E402
from podracer.provision.cli import main  # noqa: E402

BUCKET = "gs://podracer-runs"
NAME, ZONE = "pod", "us-central2-b"
STEPS = 4096
TRAINING = ["--arch=anakin", "--algo=ppo", "--env=CartPole-v1", f"--total-steps={STEPS}",
            "--num-envs=8", "--rollout-len=64", "--checkpoint-every=2048"]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("git") is None,
                                reason="needs bash and git")


@pytest.fixture
def pod(offline_install, gcs_bucket, tmp_path):
    """A test TPU API whose slices have 2 workers (a v4-16), booted here: (pod, server)."""
    service = FakeTpuService(workers=2)
    with EmulatedPod(service, tmp_path, worker_environment(offline_install)) as emulated, \
            TpuServer(service) as server:
        yield emulated, server


def _launch(server, *argv) -> int:
    return main([*argv, f"--tpu={NAME}", f"--zone={ZONE}", "--project=proj",
                 "--accelerator-type=v4-16", f"--bucket={BUCKET}",
                 f"--api-endpoint={server.endpoint}", "--poll-interval=0.5",
                 "--run-timeout=400", *TRAINING])


def _bucket_text(bucket, run_dir: str, name: str) -> str:
    return bucket.blob(f"{run_dir.removeprefix(BUCKET + '/')}/{name}").download_as_text()


def _logs(bucket, run_dir: str, workers: int) -> str:
    """Every worker's log from the bucket, for a failure's message."""
    texts = []
    for index in range(workers):
        try:
            texts.append(_bucket_text(bucket, run_dir, f"logs/worker-{index}.log")[-3000:])
        except Exception as error:  # noqa: BLE001 - a message, not a check
            texts.append(f"(no log for worker {index}: {error!r})")
    return "\n".join(texts)


def test_a_two_worker_slice_trains_to_its_summary_and_leaves_nothing_running(
        pod, gcs_bucket, capsys):
    emulated, server = pod

    status = _launch(server)

    out, err = capsys.readouterr()
    (create,) = emulated.service.requests_of("CreateNode")
    run_dir = create.node.metadata[api_requests.RUN_DIR_KEY]
    if status != 0:
        print(out, err, _logs(gcs_bucket, run_dir, 2), emulated.consoles(), sep="\n")
    assert status == 0, err
    summary = json.loads(_bucket_text(gcs_bucket, run_dir, "summary.json"))
    assert summary["env_steps"] == STEPS and summary["processes"] == 2
    assert summary["config"]["run"]["run_dir"] == run_dir
    for index in range(2):
        assert _bucket_text(gcs_bucket, run_dir, f"logs/worker-{index}.exit") == "0"
    # The launcher read the summary back from the bucket, then deleted the slice.
    assert f"results in {run_dir}:" in out
    assert f"{STEPS:,} env steps" in out and "over 2 processes" in out
    assert f"deleted TPU {NAME}" in out
    emulated.assert_nothing_left()
