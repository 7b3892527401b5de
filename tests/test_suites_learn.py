"""A short PPO run per JAX suite beats a random policy by a margin a broken adapter cannot reach.

Random-policy returns, measured with the adapters (64 envs, 1000 steps):
Navix Empty-5x5 0.43, brax inverted_pendulum 19.9 (the pole falls), Jumanji
Snake 0.10 (uniform over all four actions). Each run is one launcher process on
one CPU device (most of its time is compilation).
"""

import json
import subprocess

import pytest

from conftest import LAUNCHER, PYTHON


def _train(tmp_path, env, *flags):
    run_dir = tmp_path / "run"
    proc = subprocess.run([PYTHON, LAUNCHER, f"--env={env}", f"--run-dir={run_dir}", "--cpu-devices=1",
                           *flags], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((run_dir / "summary.json").read_text())["episode_return_mean"]


def test_navix_learns_empty_room(tmp_path):
    pytest.importorskip("navix")
    ret = _train(tmp_path, "navix:Navix-Empty-5x5-v0", "--total-steps=49152", "--num-envs=32",
                 "--rollout-len=32", "--lr=1e-3")
    assert ret > 0.8, ret  # random: 0.43; the goal is a few cells away


def test_brax_learns_inverted_pendulum(tmp_path):
    pytest.importorskip("brax")
    ret = _train(tmp_path, "brax:inverted_pendulum", "--total-steps=131072", "--num-envs=64",
                 "--rollout-len=32", "--lr=1e-3")
    assert ret > 60, ret  # random: 20 steps upright (80-90 here after 131k steps)


def test_jumanji_learns_snake_with_masks(tmp_path):
    pytest.importorskip("jumanji")
    ret = _train(tmp_path, "jumanji:Snake-v1", "--total-steps=65536", "--num-envs=64",
                 "--rollout-len=32", "--lr=1e-3")
    assert ret > 1.0, ret  # random: 0.10 fruit per game
