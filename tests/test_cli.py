"""The launcher as a user runs it: bad input is one line, exit 2, and harms nothing."""

import os
import subprocess

import pytest

from conftest import LAUNCHER, PYTHON

BAD_INVOCATIONS = {
    "mistyped flag": ["--totl-steps=10"],
    "unknown env": ["--env=CartPol-v1"],
    "unknown arch": ["--arch=podracer"],
    "unknown algo": ["--algo=dqn"],
    "zero total steps": ["--total-steps=0"],
    "negative envs": ["--num-envs=-4"],
    "zero rollout": ["--rollout-len=0"],
    "zero epochs": ["--epochs=0"],
    "zero minibatches": ["--minibatches=0"],
    "not a number": ["--num-envs=many"],
    "envs do not split over devices": ["--cpu-devices=4", "--num-envs=30"],
    "rollout does not split into minibatches": ["--rollout-len=30", "--minibatches=4"],
    "negative cpu devices": ["--cpu-devices=-1"],
    "zero updates per call": ["--updates-per-call=0"],
    "bad activation": ["--activation=swish"],
}


def _launch(args, cwd=None, timeout=120):
    return subprocess.run([PYTHON, LAUNCHER, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


@pytest.mark.parametrize("args", BAD_INVOCATIONS.values(), ids=BAD_INVOCATIONS.keys())
def test_bad_input_is_one_line_exit_2_and_changes_nothing(args, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    previous = run_dir / "metrics.jsonl"
    previous.write_text('{"env_steps": 1}\n')
    before = {p: p.read_bytes() for p in run_dir.iterdir()}
    result = _launch([*args, f"--run-dir={run_dir}"])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in result.stderr
    assert {p: p.read_bytes() for p in run_dir.iterdir()} == before


def test_unwritable_run_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = _launch([f"--run-dir={blocker}/run", "--total-steps=1000"])
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--run-dir" in result.stderr
    assert blocker.read_text() == "not a directory"


def test_help_documents_the_flags():
    result = _launch(["--help"])
    assert result.returncode == 0
    for flag in ("--arch", "--algo", "--env", "--seed", "--total-steps", "--run-dir", "--num-envs",
                 "--rollout-len", "--epochs", "--minibatches", "--lr", "--clip-eps", "--gamma"):
        assert flag in result.stdout


def test_short_run_writes_metrics_and_summary(tmp_path):
    import json

    run_dir = tmp_path / "run"
    result = _launch(["--env=Pendulum-v1", "--total-steps=20000", f"--run-dir={run_dir}",
                      "--updates-per-call=2"])
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env"] == "Pendulum-v1" and summary["env_steps"] >= 20000
    assert summary["episode_return_mean"] < 0  # Pendulum's rewards are costs
    assert "summary" in result.stdout and "steps/s" in result.stdout
