"""Several processes, one run directory: they agree on resuming, and on the checkpoint to resume from.

Process 0 looks for the latest checkpoint and every process takes its answer
(`podracer.session.run_dir.agreed_checkpoint_steps`), in the launcher's
resume-or-start decision and in the session's restore.
"""

import json
import os
import re
import signal
import subprocess
import threading

from conftest import GCS_BUCKET, LAUNCHER, PYTHON, REPO_ROOT
from podracer.orchestrate.distributed import free_port

# Calls of 2 updates of 8 environments x 16 steps (256 steps), over 2 processes x 2 devices; a save every 2 calls.
# One minibatch per update: few collectives per call, each slow on a busy machine.
TWO = ["--num-envs=8", "--rollout-len=16", "--updates-per-call=2", "--epochs=1", "--minibatches=1", "--seed=3",
       "--checkpoint-every=512", "--num-processes=2", "--cpu-devices=2"]


PROGRESS = re.compile(r"steps +[\d,]+/[\d,]+ ")


def _objects(bucket, prefix):
    return [blob.name for blob in bucket.list_blobs(prefix=prefix)]


def _checkpoints(bucket, prefix):
    """Steps of the complete checkpoints under `prefix` (on Cloud Storage orbax writes commit_success.txt last)."""
    return sorted(int(name.split("/")[-2]) for name in _objects(bucket, prefix + "checkpoints/")
                  if name.count("/") == 3 and name.endswith("/commit_success.txt"))


def _json(bucket, name):
    return json.loads(bucket.blob(name).download_as_text())


def _line(stdout, start):
    """The first line of `stdout` from `start` on.

    The processes' collectives library (gloo) prints to the same stdout from
    C++, in pieces: a piece of its may precede one of our lines on the same line.
    """
    return stdout[stdout.index(start):].split("\n", 1)[0]


def _launch(args, cwd):
    return subprocess.run([PYTHON, LAUNCHER, *args], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env=dict(os.environ))


def _stop_after_first_progress_line(args, cwd, timeout_s=300):
    """Start a run, SIGTERM the launcher once the first call is done (it forwards it); returns (code, stderr).

    The first progress line comes after a collective of both processes inside
    their training loop: from there a signal saves before stopping, on both.
    """
    proc = subprocess.Popen([PYTHON, LAUNCHER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=cwd, env=dict(os.environ))
    watchdog = threading.Timer(timeout_s, proc.kill)  # a run that hangs ends the read below
    watchdog.start()
    try:
        for line in proc.stdout:
            if PROGRESS.search(line):  # maybe after a piece of gloo's (see `_line`)
                proc.send_signal(signal.SIGTERM)
                break
        _, stderr = proc.communicate(timeout=timeout_s)
    finally:
        watchdog.cancel()
    return proc.returncode, stderr


def test_two_processes_stop_and_resume_from_a_bucket_to_the_same_parameters(gcs_bucket, tmp_path):
    """Both processes save to the bucket on SIGTERM, resume from that checkpoint, and end as an unstopped run.

    The stopped run has no end in sight (10^9 steps), so the signal lands mid-run however
    fast the machine; the resumed and the unstopped run then end two calls after the save,
    at a constant learning rate so that their totals do not change their updates.
    """
    constant = [*TWO, "--no-anneal-lr"]
    args = [*constant, f"--run-dir=gs://{GCS_BUCKET}/stopped"]
    code, stderr = _stop_after_first_progress_line([*args, "--total-steps=1000000000"], tmp_path)
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    saved = _checkpoints(gcs_bucket, "stopped/")
    assert saved and saved[-1] >= 256, saved
    # Each process says so: both stopped at that call, and both took part in the save.
    said = f"stopped by signal {signal.SIGTERM} at env step {saved[-1]:,}; checkpoint saved"
    assert stderr.count(said) == 2, stderr[-3000:]
    total = saved[-1] + 512

    whole = _launch([*constant, f"--total-steps={total}", f"--run-dir=gs://{GCS_BUCKET}/whole"], tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    reference = _json(gcs_bucket, "whole/summary.json")

    resumed = _launch([*args, f"--total-steps={total}"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first = _line(resumed.stdout, "podracer ")
    assert f"resuming gs://{GCS_BUCKET}/stopped from env step {saved[-1]:,}" in first, resumed.stdout[-3000:]
    summary = _json(gcs_bucket, "stopped/summary.json")
    assert summary["resumed_from_env_steps"] == saved[-1] and summary["env_steps"] == total, summary
    assert summary["processes"] == 2 and summary["updates"] == reference["updates"] == total // 128, \
        (summary, reference)
    # One row per call: the stopped run's up to its checkpoint, then the resumed run's.
    rows = gcs_bucket.blob("stopped/metrics.jsonl").download_as_text().splitlines()
    assert [json.loads(row)["env_steps"] for row in rows] == list(range(256, total + 1, 256)), rows
    assert _checkpoints(gcs_bucket, "stopped/")[-1] == total
    # Both processes hold bitwise the parameters of the run that was never stopped.
    prints = summary["params_fingerprints"]
    assert len(prints) == 2 and prints == reference["params_fingerprints"], (summary, reference, saved)


# Two processes joined on loopback, each in its own working directory: `--run-dir=run`
# is another directory on each, as a host's local disk is; each reports what it decided.
AGREE = """
import json, sys
import jax.numpy as jnp
from podracer.orchestrate import distributed
from podracer.orchestrate.cli import _run_dir_state, parse_configs
from podracer.session.session import RunSession

configs = parse_configs(sys.argv[1:])
distributed.initialize(configs.distributed)
state = _run_dir_state(configs)
session = RunSession(configs)
restored, meta = session.open({"w": jnp.zeros(3)})
session.checkpointer.close()
print(json.dumps({"state": state.checkpoint_steps, "session": session.resume_steps,
                  "restored_meta": meta.get("env_steps"), "restored_w": float(restored["w"][0])}))
"""
AGREE_FLAGS = ["--total-steps=4096", "--run-dir=run"]


def test_every_process_resumes_from_process_0s_latest_checkpoint(tmp_path):
    """Process 1 sees a newer checkpoint than process 0: both still decide on, and restore, process 0's."""
    import jax.numpy as jnp

    from podracer.orchestrate.cli import parse_configs
    from podracer.session.checkpoint import Checkpointer, config_record

    views = {0: (256,), 1: (256, 512)}  # the checkpoints each process's run directory holds
    for process, steps in views.items():
        (tmp_path / str(process)).mkdir()
        configs = parse_configs([*AGREE_FLAGS[:-1], f"--run-dir={tmp_path / str(process) / 'run'}"])
        checkpointer = Checkpointer(configs.run.run_dir, configs.checkpoint, config_record(configs.recorded()))
        for step in steps:  # the state names its step
            checkpointer.save(step, {"w": jnp.full(3, float(step))}, {})
            checkpointer.wait()
        checkpointer.close()

    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)}
    procs = [subprocess.Popen([PYTHON, "-c", AGREE, *AGREE_FLAGS, "--num-processes=2", f"--coordinator={coordinator}",
                               f"--process-id={process}"], cwd=tmp_path / str(process), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for process in views]
    try:
        outputs = [proc.communicate(timeout=240) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (_, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, stderr[-3000:]
    decided = [json.loads(_line(stdout, '{"state"')) for stdout, _ in outputs]
    expected = {"state": 256, "session": 256, "restored_meta": 256, "restored_w": 256.0}
    assert decided == [expected, expected]
