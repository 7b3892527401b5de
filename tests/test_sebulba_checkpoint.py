"""Sebulba checkpoints as a preempted user meets them: the launcher, a real SIGTERM, the same command again."""

import json
import os
import signal
import subprocess
import time

from conftest import LAUNCHER, PYTHON

# 32 environments x 32 steps = 1,024 env steps per update; 118 updates in all.
STEPS_PER_UPDATE = 1024
RUN = ["--arch=sebulba", "--env=CartPole-v1", "--cpu-devices=2", "--num-envs=32", "--rollout-len=32",
       "--log-every=2", "--total-steps=120000", "--checkpoint-every=0", "--seed=1"]


def _rows(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _steps(run_dir):
    path = run_dir / "checkpoints"
    return sorted(int(name) for name in os.listdir(path) if name.isdigit()) if path.exists() else []


def _snapshot(run_dir):
    return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def test_sigterm_saves_and_the_same_command_resumes_and_learns_on(tmp_path):
    run_dir = tmp_path / "run"
    args = [PYTHON, LAUNCHER, *RUN, f"--run-dir={run_dir}"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # Preempt once the policy is clearly better than random (about 22).
    deadline = time.monotonic() + 120
    while not any((row["episode_return_mean"] or 0) >= 80 for row in _rows(run_dir)):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the run never learned"
        time.sleep(0.05)
    assert _steps(run_dir) == []  # periodic saves are off: only the signal saves
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "checkpoint saved" in stderr and "Traceback" not in stderr
    [saved] = _steps(run_dir)
    assert 0 < saved < 118 * STEPS_PER_UPDATE and saved % STEPS_PER_UPDATE == 0
    updates_at_save = saved // STEPS_PER_UPDATE
    before = [row for row in _rows(run_dir) if row["env_steps"] <= saved]
    return_at_save = [row["episode_return_mean"] for row in before if row["episode_return_mean"]][-1]

    result = subprocess.run(args, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_env_steps"] == saved
    assert summary["updates"] == 118 and summary["env_steps"] == 118 * STEPS_PER_UPDATE
    rows = _rows(run_dir)
    steps = [row["env_steps"] for row in rows]
    assert steps == sorted(set(steps)) and steps[-1] == 118 * STEPS_PER_UPDATE  # no interval twice
    # Policy versions continue from the checkpoint's, not from 0.
    after = [row for row in rows if row["env_steps"] > saved]
    versions = [row["policy_version"] for row in rows]
    assert versions == sorted(versions)
    assert after[0]["policy_version"] >= updates_at_save and versions[-1] >= 110
    # It learns on from the restored parameters: a fresh policy would need about
    # 15 updates to pass 80 (random play averages 22); the resumed one does it early.
    early = [row["episode_return_mean"] or 0 for row in after[:5]]
    assert max(early) >= 0.6 * return_at_save, (early, return_at_save)
    assert max(row["episode_return_mean"] or 0 for row in after[-10:]) >= return_at_save
    assert _steps(run_dir)[-1] == 118 * STEPS_PER_UPDATE  # the final save

    # The trained policy, scored on envpool by the eval verb (a random policy averages about 22).
    result = subprocess.run([PYTHON, LAUNCHER, "eval", f"--run-dir={run_dir}", "--episodes=16",
                             "--deterministic"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["episode_return_mean"] >= 80

    # The same run directory with another config: one line naming the flags, nothing touched.
    before = _snapshot(run_dir)
    for flag, named in (("--lr=0.01", "--lr"), ("--num-envs=64", "--num-envs"), ("--arch=anakin", "--arch")):
        result = subprocess.run([*args, flag], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and named in result.stderr and "Traceback" not in result.stderr
        assert _snapshot(run_dir) == before


# Sebulba ES: lock-step generations of the CartPole preset's population; only the signal saves.
ES_RUN = ["--arch=sebulba", "--algo=es", "--env=CartPole-v1", "--cpu-devices=2", "--log-every=1",
          "--total-steps=400000", "--checkpoint-every=0", "--seed=1"]


def test_es_sigterm_saves_and_the_same_command_resumes_and_learns_on(tmp_path):
    run_dir = tmp_path / "run"
    args = [PYTHON, LAUNCHER, *ES_RUN, f"--run-dir={run_dir}"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # Preempt once the mean parameters clearly beat a random policy (about 22).
    deadline = time.monotonic() + 120
    while not any(row["mean_params_return"] >= 100 for row in _rows(run_dir)):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the run never learned"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "checkpoint saved" in stderr and "Traceback" not in stderr
    # The save holds the last finished generation, the last row logged.
    [saved] = _steps(run_dir)
    last = _rows(run_dir)[-1]
    assert saved == last["env_steps"] < 400_000
    generations_at_save, return_at_save = last["generations"], last["mean_params_return"]

    result = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_env_steps"] == saved and summary["env_steps"] >= 400_000
    rows = _rows(run_dir)
    steps = [row["env_steps"] for row in rows]
    assert steps == sorted(set(steps))  # no generation logged twice
    # Generations (the policy versions) continue from the checkpoint's.
    after = [row for row in rows if row["env_steps"] > saved]
    assert [row["generations"] for row in after][:3] == [generations_at_save + i for i in (1, 2, 3)]
    assert summary["generations"] == rows[-1]["generations"] > generations_at_save
    # It goes on from the restored mean: a fresh one starts near 22 and needs several generations.
    assert max(row["mean_params_return"] for row in after[:2]) >= 0.6 * return_at_save
    assert max(row["mean_params_return"] for row in after) >= max(return_at_save, 475)

    # The saved mean, scored on envpool by the eval verb (a random policy averages about 22).
    result = subprocess.run([PYTHON, LAUNCHER, "eval", f"--run-dir={run_dir}", "--episodes=16"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["episode_return_mean"] >= 400

    # The same run directory with another population: one line naming it, nothing touched.
    before = _snapshot(run_dir)
    result = subprocess.run([*args, "--population=32"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "--population" in result.stderr
    assert "Traceback" not in result.stderr and _snapshot(run_dir) == before


def test_nan_guard_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    # One Adam step per update at a learning rate of 1e30: the first update leaves huge but
    # finite parameters, the second overflows. A checkpoint after every update.
    result = subprocess.run([PYTHON, LAUNCHER, "--arch=sebulba", "--env=CartPole-v1", "--cpu-devices=2",
                             "--num-envs=8", "--rollout-len=16", "--synchronous", "--total-steps=1280",
                             "--lr=1e30", "--epochs=1", "--minibatches=1", "--checkpoint-every=128",
                             f"--run-dir={run_dir}"], capture_output=True, text=True, timeout=180)
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert "\n" not in line and "non-finite" in line and "update 2 " in line, line
    assert "env step 128" in line  # the last good checkpoint, named
    assert _steps(run_dir) == [128]  # the checkpoint after update 1, nothing after
    from podracer.session.checkpoint import restore_on_host

    import jax
    import numpy as np

    params = restore_on_host(str(run_dir / "checkpoints" / "128" / "state"))["train"]["params"]
    leaves = jax.tree.leaves(params)
    assert leaves and all(np.all(np.isfinite(np.asarray(x))) for x in leaves)
