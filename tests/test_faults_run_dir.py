"""Faults in a run directory: two writers, a full disk, a blocked save, torn and damaged files.

Real processes, real signals, a real tmpfs and the Cloud Storage emulator; each
case ends in one line, and what trained is kept (checkpoints resume, metrics
lines are whole).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

from conftest import GCS_BUCKET, LAUNCHER, PYTHON, wait_for

# Small, fast runs: 16 envs x 16 steps, one update per call.
RUN = ["--num-envs=16", "--rollout-len=16", "--updates-per-call=1"]


def _launch(args, cwd=None, timeout=180):
    return subprocess.run([PYTHON, LAUNCHER, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=dict(os.environ))


def _start(args, cwd=None):
    return subprocess.Popen([PYTHON, LAUNCHER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=cwd, env=dict(os.environ))



def _steps(run_dir):
    path = run_dir / "checkpoints"
    return sorted(int(n) for n in os.listdir(path) if n.isdigit()) if path.exists() else []


def _rows(run_dir):
    """Every line of metrics.jsonl, parsed: a torn line fails here."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _one_line(stderr):
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A short finished run (checkpoints at 2048 and 4096 env steps), copied by the tests that damage it."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    result = _launch([*RUN, "--total-steps=4096", "--checkpoint-every=2048", f"--run-dir={run_dir}"])
    assert result.returncode == 0, result.stderr
    return run_dir


def test_a_second_run_on_a_training_run_dir_is_refused_naming_the_holder(tmp_path):
    first = _start([*RUN, "--total-steps=50000000", "--checkpoint-every=4096"], cwd=tmp_path)
    try:
        runs = tmp_path / "runs"
        assert wait_for(lambda: (runs / "latest").exists() and _steps(runs / "latest"), 120), "no checkpoint"
        run_dir = (runs / "latest").resolve()
        latest = os.readlink(runs / "latest")
        second = _launch([*RUN, "--total-steps=50000000", f"--run-dir={run_dir}"], cwd=tmp_path)
        line = _one_line(second.stderr)
        assert second.returncode == 2 and "in use by another run" in line and f"pid {first.pid}" in line, line
        assert os.readlink(runs / "latest") == latest and sorted(os.listdir(runs)) == sorted([latest, "latest"])
        assert first.poll() is None  # the first run trains on
    finally:
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=60)
    assert first.returncode == 128 + signal.SIGTERM, stderr
    assert not (run_dir / "run.lock").exists()
    assert _rows(run_dir)  # every line whole


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_message(tmp_path, capsys):
    from podracer.errors import PodracerError
    from podracer.session import lock

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = lock.Holder(socket.gethostname(), dead.pid, time.time() - 60)
    (tmp_path / lock.LOCK_NAME).write_text(stale.text())
    held = lock.acquire(str(tmp_path))
    try:
        assert _one_line(capsys.readouterr().err).startswith(f"taking over --run-dir={tmp_path}")
        with pytest.raises(PodracerError, match=f"in use by another run .*pid {os.getpid()}"):
            lock.acquire(str(tmp_path))  # a lock is a lock within one process too
    finally:
        held.release()
    assert list(tmp_path.iterdir()) == []


def test_a_bucket_run_dir_has_one_leaseholder(gcs_bucket, monkeypatch, capsys):
    from podracer.errors import PodracerError
    from podracer.session import lock

    run_dir = f"gs://{GCS_BUCKET}/leased"
    held = lock.acquire(run_dir)
    with pytest.raises(PodracerError, match=f"in use by another run .*pid {os.getpid()}"):
        lock.acquire(run_dir)
    held.release()
    assert gcs_bucket.get_blob("leased/run.lock") is None

    # A holder on another host that stopped renewing: stale once its lease is over.
    blob = gcs_bucket.blob("leased/run.lock")
    blob.upload_from_string(lock.Holder("elsewhere", 1, time.time()).text(), if_generation_match=0)
    with pytest.raises(PodracerError, match="host elsewhere, pid 1"):
        lock.acquire(run_dir)
    monkeypatch.setattr(lock, "LEASE_S", 0.5)
    time.sleep(1.0)
    taken = lock.acquire(run_dir)
    try:
        assert "has not renewed its lease" in _one_line(capsys.readouterr().err)
        assert lock.Holder.parse(gcs_bucket.get_blob("leased/run.lock").download_as_text()).pid == os.getpid()
    finally:
        taken.release()


def test_a_torn_metrics_line_is_dropped_with_a_warning_on_resume(finished_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "4096")  # resume from 2048
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"env_steps": 4352, "sps": 1')  # a row cut short
    result = _launch([*RUN, "--total-steps=4096", "--checkpoint-every=2048", f"--run-dir={run_dir}"])
    assert result.returncode == 0, result.stderr
    assert "warning: dropped 1 line" in _one_line(result.stderr)
    steps = [row["env_steps"] for row in _rows(run_dir)]
    assert steps == sorted(set(steps)) and steps[-1] == 4096


def test_rerunning_a_finished_run_with_a_damaged_summary_is_one_line(finished_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    (run_dir / "summary.json").write_text('{"env_steps": 40')
    result = _launch([*RUN, "--total-steps=4096", f"--run-dir={run_dir}"])
    assert result.returncode == 2 and "summary.json is damaged" in _one_line(result.stderr)
    assert _steps(run_dir) == [2048, 4096]


@pytest.fixture
def small_disk(tmp_path, request):
    """A tmpfs of `request.param` (default 700k: room for a few checkpoints of the small run),
    unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    size = getattr(request, "param", "700k")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root, as CI has): {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_ends_the_run_in_seconds_with_one_line_and_it_resumes(small_disk):
    run_dir = small_disk / "run"
    args = [*RUN, "--total-steps=40960", "--checkpoint-every=2048", f"--run-dir={run_dir}"]
    started = time.monotonic()
    result = _launch(args, timeout=120)
    assert time.monotonic() - started < 60
    line = _one_line(result.stderr)
    assert result.returncode == 2 and "is full (No space left on device)" in line, line
    kept = _steps(run_dir)
    assert kept and f"env step {kept[-1]:,}) is kept" in line
    rows = _rows(run_dir)  # no torn line

    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    result = _launch(args, timeout=120)
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_env_steps"] == kept[-1] and summary["env_steps"] == 40960
    steps = [row["env_steps"] for row in _rows(run_dir)]
    assert rows and steps == sorted(set(steps)) and steps[-1] == 40960


@pytest.mark.parametrize("small_disk", ["64k"], indirect=True)
def test_a_disk_that_fills_while_logging_ends_the_run_in_seconds(small_disk):
    # TensorBoard's writer thread dies on the full disk first; the run once waited on it forever.
    run_dir = small_disk / "run"
    started = time.monotonic()
    result = _launch([*RUN, "--total-steps=50000000", "--checkpoint-every=0", f"--run-dir={run_dir}"],
                     timeout=120)
    assert time.monotonic() - started < 60
    line = _one_line(result.stderr)
    assert result.returncode == 2 and "is full (No space left on device)" in line, line
    assert _rows(run_dir)  # the rows written are whole


def test_sigterm_ends_a_run_whose_save_is_blocked(gcs_emulator, gcs_bucket):
    # A bucket that stops answering (its server paused) blocks the run's next save.
    run_dir = f"gs://{GCS_BUCKET}/blocked"
    proc = _start([*RUN, "--total-steps=50000000", "--checkpoint-every=2048", "--stop-timeout-s=3",
                   f"--run-dir={run_dir}"])
    try:
        assert wait_for(lambda: gcs_bucket.get_blob("blocked/metrics.jsonl") is not None, 120)
        os.kill(gcs_emulator.pid, signal.SIGSTOP)
        time.sleep(2)  # a save starts every few milliseconds of training: one is waiting now
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        os.kill(gcs_emulator.pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and took < 10, (took, stderr)
    assert "did not end within --stop-timeout-s=3 s" in _one_line(stderr)
