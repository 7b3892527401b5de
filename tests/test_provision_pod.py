"""Runs on an emulated pod slice: `python launch/tpu.py` against the test TPU API
server, whose nodes' workers boot for real on this machine (tests/emulated_pod.py):
each runs the startup script the launcher sent, installs the staged code offline,
and trains as one process of a `jax.distributed` run on 127.0.0.1, into the
emulated bucket.

Each test is named for what it proves: a slice that trains to its end (the
reference the others compare with), `preempt` as the guest agent shuts a VM down
(`runner_only`: SIGTERM to the startup script's runner alone), `reboot`, `attach`
after the launcher is killed, `detach` through an API outage longer than the
launcher's retry deadline, `sebulba` with envpool, and `multislice`: two slices of
two workers as one run of four processes.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("google.cloud.tpu_v2", reason="needs the tpu extra")

import jax  # noqa: E402
from emulated_pod import EmulatedPod, wait_until, worker_environment  # noqa: E402
from tpu_server import FakeTpuService, TpuServer  # noqa: E402

from podracer.policy import read_run  # noqa: E402
from podracer.provision import api_requests  # noqa: E402
from podracer.command import main  # noqa: E402  (the front door)
from podracer.session.checkpoint import checkpoint_steps  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BUCKET = "gs://podracer-runs"
NAME, ZONE, PROJECT = "pod", "us-central2-b", "proj"
STEPS, CHECKPOINT_EVERY = 8192, 2048
TRAINING = ["--arch=anakin", "--algo=ppo", "--env=CartPole-v1", f"--total-steps={STEPS}",
            "--num-envs=8", "--rollout-len=64", "--updates-per-call=1",
            f"--checkpoint-every={CHECKPOINT_EVERY}"]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("git") is None,
                                reason="needs bash and git")


@dataclass
class Outcome:
    status: int
    out: str
    err: str
    run_dir: str


@pytest.fixture(scope="module")
def emulated_pod(offline_install, gcs_bucket, tmp_path_factory):
    """A factory of (pod, server) pairs: a test TPU API whose slices have 2 workers (a
    v4-16), booted here; each pair's pod is closed, its nothing-left checked, at the end."""
    opened = []

    def open_pod():
        service = FakeTpuService(workers=2)
        pod = EmulatedPod(service, tmp_path_factory.mktemp("pod"), worker_environment(offline_install))
        server = TpuServer(service)
        pod.__enter__()
        server.__enter__()
        opened.append((pod, server))
        return pod, server

    yield open_pod
    for pod, server in opened:
        server.__exit__(None, None, None)
        pod.close()


@pytest.fixture
def pod(emulated_pod):
    return emulated_pod()


def _flags(server) -> list[str]:
    return [f"--zone={ZONE}", f"--project={PROJECT}", f"--api-endpoint={server.endpoint}",
            "--poll-interval=0.5"]


def _run_argv(server, *argv) -> list[str]:
    return [*argv, f"--tpu={NAME}", *_flags(server), "--accelerator-type=v4-16",
            f"--bucket={BUCKET}", "--max-run-time=400", *TRAINING]


def _launch(server, capsys, *argv) -> Outcome:
    status = main(_run_argv(server, *argv))
    out, err = capsys.readouterr()
    run_dir = _run_dir(server.service) or ""
    return Outcome(status, out, err, run_dir)


def _attach(server, capsys, target: str = NAME) -> Outcome:
    status = main(["attach", target, *_flags(server)])
    out, err = capsys.readouterr()
    return Outcome(status, out, err, _run_dir(server.service) or "")


def _run_dir(service) -> str | None:
    nodes = ([create.node for create in service.requests_of("CreateNode")]
             + [create.queued_resource.tpu.node_spec[0].node
                for create in service.requests_of("CreateQueuedResource")])
    return nodes[0].metadata[api_requests.RUN_DIR_KEY] if nodes else None


def _bucket_text(bucket, run_dir: str, name: str) -> str:
    return bucket.blob(f"{run_dir.removeprefix(BUCKET + '/')}/{name}").download_as_text()


def _explain(outcome: Outcome, pod, bucket) -> str:
    """The launcher's output, every worker's log in the bucket and every console: a failure's message."""
    texts = [outcome.out, outcome.err]
    for index in range(2):
        try:
            texts.append(_bucket_text(bucket, outcome.run_dir, f"logs/worker-{index}.log")[-3000:])
        except Exception as error:  # noqa: BLE001 - a message, not a check
            texts.append(f"(no log for worker {index}: {error!r})")
    texts.append(pod.consoles())
    return "\n".join(texts)


def _assert_finished(outcome: Outcome, pod, bucket, processes: int = 2, steps: int = STEPS) -> dict:
    """The run ended well: its summary (read back from the bucket), every worker's exit 0."""
    assert outcome.status == 0, _explain(outcome, pod, bucket)
    summary = json.loads(_bucket_text(bucket, outcome.run_dir, "summary.json"))
    assert summary["env_steps"] == steps and summary["processes"] == processes
    for index in range(processes):
        assert _bucket_text(bucket, outcome.run_dir, f"logs/worker-{index}.exit") == "0"
    return summary


def _final_state(run_dir: str, steps: int = STEPS) -> list[np.ndarray]:
    """Every leaf of the run's last checkpoint (parameters, optimizer, environments, key)."""
    assert checkpoint_steps(run_dir)[-1] == steps
    _, state = read_run(run_dir)
    return [np.asarray(leaf) for leaf in jax.tree.leaves(state)]


def _at_first_checkpoint(emulated, service, disturb, nodes=(NAME,)) -> list:
    """Once the run has a checkpoint: freeze the slice (its `nodes`) there (so it cannot finish first),
    then `disturb()`. The list gets the checkpoints' steps seen then (read before the
    freeze: nothing is asked of the bucket while a worker may be frozen mid-request)."""
    noted = []

    def checkpointed() -> bool:
        run_dir = _run_dir(service)
        steps = checkpoint_steps(run_dir) if run_dir else []
        if steps:
            noted.append(steps)
        return bool(steps)

    def act():
        for node in nodes:
            emulated.pause(node)
        disturb()

    emulated.when(checkpointed, act)
    return noted


def _assert_same_state(run_dir: str, reference: list[np.ndarray]) -> None:
    """The run's last checkpoint is bit for bit the uninterrupted run's."""
    final = _final_state(run_dir)
    assert len(final) == len(reference)
    for got, want in zip(final, reference):
        np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def uninterrupted(emulated_pod, gcs_bucket):
    """One run of TRAINING on a 2-worker slice, undisturbed: (outcome, pod, final state)."""
    pod, server = emulated_pod()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(_run_argv(server))
    outcome = Outcome(status, out.getvalue(), err.getvalue(), _run_dir(server.service) or "")
    _assert_finished(outcome, pod, gcs_bucket)
    return outcome, pod, _final_state(outcome.run_dir)


def test_a_two_worker_slice_trains_to_its_summary_then_is_deleted_and_nothing_is_left(
        uninterrupted, gcs_bucket):
    outcome, pod, _ = uninterrupted

    summary = json.loads(_bucket_text(gcs_bucket, outcome.run_dir, "summary.json"))
    assert summary["config"]["run"]["run_dir"] == outcome.run_dir
    assert "slice_restarts" not in summary  # written where the slice was restarted
    # The launcher read the summary back from the bucket, then deleted the slice.
    assert f"results in {outcome.run_dir}:" in outcome.out
    assert f"{STEPS:,} env steps" in outcome.out and "over 2 processes" in outcome.out
    # Whoever sees the end first deletes the slice: the launcher, or worker 0 itself.
    assert f"deleted TPU {NAME}" in outcome.out or f"TPU {NAME} is gone" in outcome.out, outcome.out
    pod.assert_nothing_left()


def test_preempt_runner_only_sigterm_reaches_training_in_its_unit_which_saves_there_and_the_new_slice_resumes_bitwise(
        pod, uninterrupted, gcs_bucket, capsys):
    """A preemption as the guest agent meets it: SIGTERM to the startup script's runner
    alone, everything else killed after the grace. Training runs in a systemd unit of its
    own, which the shutdown stops with SIGTERM first: it saves at the step it was stopped
    at, and the slice created again resumes from exactly there."""
    emulated, server = pod
    _, _, reference = uninterrupted
    first_log = []  # worker 0's log as the preempted slice left it (the next one's replaces it)

    def preempt():
        emulated.preempt(NAME, grace_s=30)  # a Compute Engine preemption's 30 s notice
        first_log.append(_bucket_text(gcs_bucket, _run_dir(server.service), "logs/worker-0.log"))

    preempted = _at_first_checkpoint(emulated, server.service, preempt)
    outcome = _launch(server, capsys, "--spot", "--max-restarts=1")

    summary = _assert_finished(outcome, emulated, gcs_bucket)
    assert preempted and preempted[0][-1] < STEPS, preempted
    assert [restart["reason"] for restart in summary["slice_restarts"]] == [
        f"TPU {NAME} was PREEMPTED during the run"]
    assert len(server.service.requests_of("CreateNode")) == 2
    assert f"TPU {NAME} was PREEMPTED during the run; restart 1 of 1" in outcome.out, outcome.out
    launch = json.loads(_bucket_text(gcs_bucket, outcome.run_dir, "launch.json"))
    assert len(launch["restarts"]) == 1
    # The second slice's workers resumed from the bucket's checkpoint, not from step 0 ...
    log = _bucket_text(gcs_bucket, outcome.run_dir, "logs/worker-0.log")
    resumed = re.search(r"from env step ([\d,]+)", log)
    assert resumed and 0 < int(resumed[1].replace(",", "")) < STEPS, log[-2000:]
    # ... the checkpoint that training saved when the shutdown's SIGTERM reached it.
    stopped = re.search(rf"stopped by signal {int(signal.SIGTERM)} at env step ([\d,]+); "
                        "checkpoint saved", first_log[0])
    assert stopped and stopped[1] == resumed[1], first_log[0][-3000:]
    assert "Running as unit: podracer-worker.service" in emulated.consoles(10**6)
    # ... and trained to the very parameters (optimizer, environments, key) of an
    # uninterrupted run: resuming lost nothing and repeated nothing.
    _assert_same_state(outcome.run_dir, reference)
    emulated.assert_nothing_left()


def test_reboot_of_one_worker_runs_its_startup_script_again_and_the_run_finishes(
        pod, uninterrupted, gcs_bucket, capsys):
    emulated, server = pod
    _, _, reference = uninterrupted

    def reboot():
        emulated.reboot(NAME, 1)
        emulated.resume(NAME)  # worker 0 trains on, waiting for its lost peer

    rebooted = _at_first_checkpoint(emulated, server.service, reboot)
    outcome = _launch(server, capsys, "--max-restarts=1")

    _assert_finished(outcome, emulated, gcs_bucket)
    assert rebooted and rebooted[0][-1] < STEPS, rebooted
    # The same slice finished the run: nothing was created again.
    assert len(server.service.requests_of("CreateNode")) == 1
    console = emulated.consoles()
    assert "--- boot 2 ---" in console
    # The rebooted worker did not install again (its disk has the code), and every
    # worker started training again together from the checkpoint.
    log = _bucket_text(gcs_bucket, outcome.run_dir, "logs/worker-1.log")
    second_boot = log.rsplit("worker 1 of 2", 1)[1]
    assert "uv pip install" not in second_boot, second_boot
    _assert_same_state(outcome.run_dir, reference)
    emulated.assert_nothing_left()


def _launcher_process(server, *argv) -> subprocess.Popen:
    """`python launch/tpu.py ...` as a user runs it, in its own process."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [sys.executable, str(REPO / "launch" / "tpu.py"), *_run_argv(server, *argv)]
    return subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _guest_reads(service) -> int:
    return len(service.requests_of("GetGuestAttributes"))


def test_attach_follows_a_run_whose_launcher_was_killed_to_its_end(pod, gcs_bucket, capsys):
    emulated, server = pod
    launcher = _launcher_process(server)
    try:
        wait_until(lambda: emulated.runs(NAME) or launcher.poll() is not None, 240,
                   "the launcher to create the slice")
        assert launcher.poll() is None, launcher.communicate()[0]
        emulated.wait_for_phase(NAME, 0, "running", timeout=240)
        emulated.wait_for_phase(NAME, 1, "running", timeout=240)
        emulated.pause(NAME)  # the run cannot end before `attach` is following it
    finally:
        launcher.send_signal(signal.SIGKILL)  # the launcher dies without a word
        output = launcher.communicate(timeout=30)[0]
    assert launcher.returncode == -signal.SIGKILL, output
    assert list(server.service.nodes) and "DeleteNode" not in server.service.methods_called()
    reads = _guest_reads(server.service)
    emulated.when(lambda: _guest_reads(server.service) > reads, lambda: emulated.resume(NAME))

    outcome = _attach(server, capsys)

    _assert_finished(outcome, emulated, gcs_bucket)
    assert f"attached to the run in {outcome.run_dir}" in outcome.out
    assert "the run finished on every worker" in outcome.out  # then deleted, by it or worker 0
    emulated.assert_nothing_left()


def test_detach_leaves_the_slice_training_and_attach_waits_out_an_api_outage(
        pod, gcs_bucket, capsys):
    emulated, server = pod
    retry_deadline = 2.0

    outcome = _launch(server, capsys, "--detach", f"--retry-deadline={retry_deadline}")

    assert (outcome.status, outcome.err) == (0, ""), outcome.out
    assert f"detached: TPU {NAME} trains on" in outcome.out
    assert list(server.service.nodes) and "DeleteNode" not in server.service.methods_called()
    emulated.wait_for_phase(NAME, 0, "running", timeout=240)
    emulated.wait_for_phase(NAME, 1, "running", timeout=240)
    emulated.pause(NAME)

    # Once `attach` follows the run, the API answers UNAVAILABLE to everyone for
    # four times the retry deadline (the old launcher deleted a slice after 120 s of
    # that, its deadline then); the workers train on through it.
    def outage():
        server.service.outage(4 * retry_deadline)
        emulated.resume(NAME)

    reads = _guest_reads(server.service)
    emulated.when(lambda: _guest_reads(server.service) > reads, outage)
    status = main(["attach", NAME, *_flags(server), f"--retry-deadline={retry_deadline}"])
    out, err = capsys.readouterr()
    attached = Outcome(status, out, err, outcome.run_dir)

    # The run finished on the slice that was never deleted under it; then it was.
    _assert_finished(attached, emulated, gcs_bucket)
    assert "cannot reach the Cloud TPU API" in out and "the Cloud TPU API answers again" in out
    assert len(server.service.requests_of("CreateNode")) == 1
    emulated.assert_nothing_left()


# Sebulba on the slice's 4 devices per host: one acts (envpool CartPole on the host's
# CPU threads), three learn, over both workers; actors wait for each update.
SEBULBA = ["--arch=sebulba", "--algo=ppo", "--env=CartPole-v1", "--num-envs=24", "--rollout-len=16",
           "--total-steps=3072", "--synchronous", "--seed=5", "--cpu-devices=4"]


def test_sebulba_with_envpool_trains_on_the_slice_to_its_summary(pod, gcs_bucket, capsys):
    emulated, server = pod
    status = main([f"--tpu={NAME}", *_flags(server), "--accelerator-type=v4-16",
                   f"--bucket={BUCKET}", "--max-run-time=400", *SEBULBA])
    out, err = capsys.readouterr()
    outcome = Outcome(status, out, err, _run_dir(server.service) or "")

    assert status == 0, _explain(outcome, emulated, gcs_bucket)
    summary = json.loads(_bucket_text(gcs_bucket, outcome.run_dir, "summary.json"))
    assert summary["processes"] == 2 and summary["env_steps"] >= 3072
    assert summary["config"]["run"]["arch"] == "sebulba"
    # One actor and three learner devices on each worker; one learner mesh over both.
    assert (summary["actor_devices"], summary["learner_devices"]) == (2, 6)
    prints = summary["params_fingerprints"]
    assert len(prints) == 2 and prints[0] == prints[1]
    for index in range(2):
        assert _bucket_text(gcs_bucket, outcome.run_dir, f"logs/worker-{index}.exit") == "0"
    assert f"results in {outcome.run_dir}:" in outcome.out
    emulated.assert_nothing_left()


# Two slices of 2 workers (a queued resource's nodes pod-0 and pod-1), each worker one
# process of the run: 16 environments split over the preflight's 2 x v4-16 (16 devices);
# 4 updates, a checkpoint after the second.
MULTISLICE_STEPS = 4096
MULTISLICE = ["--arch=anakin", "--algo=ppo", "--env=CartPole-v1", f"--total-steps={MULTISLICE_STEPS}",
              "--num-envs=16", "--rollout-len=64", "--updates-per-call=1",
              f"--checkpoint-every={CHECKPOINT_EVERY}"]


def test_multislice_two_slices_train_as_one_run_restart_together_after_one_is_preempted_and_match_one_process(
        pod, gcs_bucket, capsys, tmp_path):
    """One run over every worker of both slices (jax.distributed's processes numbered
    slice by slice, worker 0 of slice 0 coordinating); a preemption of slice 1 loses the
    run, and the launcher creates both slices again, which resume from the checkpoint;
    the run ends where one process with as many devices ends."""
    emulated, server = pod
    slices = (f"{NAME}-0", f"{NAME}-1")
    preempted = _at_first_checkpoint(emulated, server.service,
                                     lambda: emulated.preempt(slices[1], grace_s=2), slices)

    status = main([f"--tpu={NAME}", *_flags(server), "--accelerator-type=v4-16", "--queued",
                   "--num-slices=2", "--max-restarts=1", f"--bucket={BUCKET}",
                   "--max-run-time=400", *MULTISLICE])
    out, err = capsys.readouterr()
    outcome = Outcome(status, out, err, _run_dir(server.service) or "")

    summary = _assert_finished(outcome, emulated, gcs_bucket, processes=4, steps=MULTISLICE_STEPS)
    assert summary["devices"] == 4
    (create, again) = server.service.requests_of("CreateQueuedResource")
    assert create.queued_resource.tpu.node_spec[0].multislice_params.node_count == 2
    assert preempted and preempted[0][-1] < MULTISLICE_STEPS, preempted
    assert f"TPU {NAME}-1 was PREEMPTED during the run; restart 1 of 1" in out, out
    # Every worker of the new slices resumed from the bucket's checkpoint, as process
    # 2 x slice + worker, joined to worker 0 of slice 0.
    logs = [_bucket_text(gcs_bucket, outcome.run_dir, f"logs/worker-{index}.log") for index in range(4)]
    for index, log in enumerate(logs):
        assert f"--num-processes=4 --process-id={index}" in log, log[-2000:]
    resumed = re.search(r"from env step ([\d,]+)", logs[0])
    assert resumed and 0 < int(resumed[1].replace(",", "")) < MULTISLICE_STEPS, logs[0][-2000:]

    one = tmp_path / "one"
    alone = subprocess.run([sys.executable, str(REPO / "launch" / "tpu.py"), *MULTISLICE,
                            "--cpu-devices=4", f"--run-dir={one}"], cwd=REPO, capture_output=True,
                           text=True, timeout=400, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert alone.returncode == 0, alone.stderr[-2000:]
    for got, want in zip(_final_state(outcome.run_dir, MULTISLICE_STEPS),
                         _final_state(str(one), MULTISLICE_STEPS), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    emulated.assert_nothing_left()
