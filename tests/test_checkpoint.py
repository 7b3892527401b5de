"""Checkpoints as a preempted user meets them: real processes, real signals, real orbax files."""

import json
import os
import signal
import subprocess
import time

import numpy as np
from podracer.session.checkpoint import restore_on_host
import pytest

from conftest import LAUNCHER, PYTHON, wait_for

# Small, fast runs: 16 envs x 16 steps, one update per call, 40 calls.
RUN = ["--num-envs=16", "--rollout-len=16", "--updates-per-call=1", "--total-steps=10240"]


def _env(tmp_path):
    return dict(os.environ)  # with the session's compilation cache (conftest)


def _launch(args, tmp_path, timeout=180):
    return subprocess.run([PYTHON, LAUNCHER, *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(tmp_path))


def _start(args, tmp_path):
    return subprocess.Popen([PYTHON, LAUNCHER, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=_env(tmp_path))


def _steps(run_dir):
    path = run_dir / "checkpoints"
    return sorted(int(name) for name in os.listdir(path) if name.isdigit()) if path.exists() else []


def _final_params(run_dir):
    step = _steps(run_dir)[-1]
    restored = restore_on_host(str(run_dir / "checkpoints" / str(step) / "state"))
    return restored["train"]["params"]


def _assert_bitwise_equal(a, b):
    import jax

    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 0
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))



def test_sigkill_then_resume_is_bitwise_identical(tmp_path):
    # 120 updates and 15 saves: long enough that the kill below lands mid-run (an
    # update takes milliseconds; at 40 updates the run could end inside the 0.5 s).
    total = 30720
    run = [*RUN, f"--total-steps={total}", "--checkpoint-every=2048"]
    reference = tmp_path / "reference"
    result = _launch([*run, f"--run-dir={reference}"], tmp_path)
    assert result.returncode == 0, result.stderr

    run_dir = tmp_path / "killed"
    proc = _start([*run, f"--run-dir={run_dir}"], tmp_path)
    # Killed as soon as its first checkpoint (of 15) is complete: mid-run, 28k steps from the end.
    assert wait_for(lambda: _steps(run_dir), 120), "no checkpoint appeared"
    proc.kill()
    proc.wait(timeout=30)
    killed_at = _steps(run_dir)[-1]
    assert killed_at < total or proc.returncode == 0

    result = _launch([*run, f"--run-dir={run_dir}"], tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_env_steps"] == killed_at
    _assert_bitwise_equal(_final_params(run_dir), _final_params(reference))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row["env_steps"] for row in rows]
    assert steps == sorted(set(steps)) and steps[-1] == total  # no interval logged twice


def test_kill_during_a_save_keeps_the_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    args = [*RUN, "--checkpoint-every=1", "--keep-checkpoints=2", f"--run-dir={run_dir}"]
    proc = _start(args, tmp_path)

    def saving():  # orbax writes into a temporary directory, renamed when complete
        path = run_dir / "checkpoints"
        return path.exists() and _steps(run_dir) and any(
            not name.isdigit() for name in os.listdir(path))

    caught = wait_for(saving, 120, poll_s=0.001)
    proc.kill()
    proc.wait(timeout=30)
    assert caught, "never saw a save in progress"
    good = _steps(run_dir)
    assert good
    result = _launch(args, tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_env_steps"] in good
    assert summary["env_steps"] == 10240


def test_sigterm_saves_then_exits_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    args = [*RUN, "--total-steps=400000", "--checkpoint-every=0", f"--run-dir={run_dir}"]
    proc = _start(args, tmp_path)
    assert wait_for(lambda: (run_dir / "metrics.jsonl").exists()
                     and (run_dir / "metrics.jsonl").stat().st_size > 0, 120)
    assert _steps(run_dir) == []  # periodic saves are off: only the signal saves
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 60  # a deadline; what it stopped at is checked below
    assert proc.returncode == 128 + signal.SIGTERM
    assert "checkpoint saved" in stderr and "Traceback" not in stderr
    saved = _steps(run_dir)
    assert len(saved) == 1 and 0 < saved[0] < 400000

    result = _launch([*RUN, "--total-steps=400000", "--checkpoint-every=0", f"--run-dir={run_dir}",
                      "--total-steps=" + str(saved[0] + 2048)], tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_env_steps"] == saved[0]
    assert summary["env_steps"] == saved[0] + 2048


def test_nan_guard_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    # One Adam step per update at a learning rate of 1e30: the first update leaves huge but
    # finite parameters, the second overflows.
    result = _launch([*RUN, "--lr=1e30", "--epochs=1", "--minibatches=1", "--checkpoint-every=1",
                      f"--run-dir={run_dir}"], tmp_path)
    assert result.returncode == 2
    line = result.stderr.strip()
    assert "\n" not in line and "non-finite" in line and "update 2" in line
    assert _steps(run_dir) == [256]  # the checkpoint after update 1, nothing after
    params = _final_params(run_dir)
    import jax

    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(params))


def test_corrupt_checkpoint_is_one_line_and_left_alone(tmp_path):
    run_dir = tmp_path / "run"
    result = _launch([*RUN, "--checkpoint-every=0", f"--run-dir={run_dir}"], tmp_path)
    assert result.returncode == 0, result.stderr
    step_dir = run_dir / "checkpoints" / str(_steps(run_dir)[-1])
    for path in step_dir.rglob("*"):
        if path.is_file() and path.stat().st_size > 0:
            path.write_bytes(b"\x00garbage")
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    result = _launch([*RUN, "--checkpoint-every=0", f"--run-dir={run_dir}"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "checkpoint" in result.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_a_signal_delivered_twice_is_one_request():
    """A terminal's Ctrl-C reaches the spawner and its processes, and the spawner forwards it too."""
    from podracer.session.checkpoint import REPEAT_WINDOW_S, stop_on_signals

    with stop_on_signals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs between the two deliveries
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert stop.signal == signal.SIGINT  # stopping politely, not interrupted
        time.sleep(REPEAT_WINDOW_S)
        with pytest.raises(KeyboardInterrupt):  # a user who insists
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)


def test_a_checkpoint_of_another_pair_is_refused_by_naming_the_pair_alone():
    from podracer.orchestrate.parse import parse_configs
    from podracer.session.checkpoint import config_differences, config_record

    def record(*argv):
        return config_record(parse_configs(list(argv)).recorded())

    sebulba_es = record("--arch=sebulba", "--algo=es")
    # Each pair reads sections of its own; what sets them apart is the pair, said alone.
    assert config_differences(sebulba_es, record("--arch=anakin", "--algo=impala")) == [
        "--arch ('sebulba' saved, 'anakin' now)", "--algo ('es' saved, 'impala' now)"]
    assert config_differences(sebulba_es, record("--arch=sebulba", "--algo=ppo")) == [
        "--algo ('es' saved, 'ppo' now)"]
    # Within a pair, every setting that differs is named.
    assert config_differences(sebulba_es, record("--arch=sebulba", "--algo=es", "--sigma=0.1",
                                                 "--population=128")) == [
        "--population (64 saved, 128 now)", "--sigma (0.05 saved, 0.1 now)"]
