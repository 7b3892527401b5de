"""`eval --video`: a file whose frame count matches the episodes' lengths; one-line refusals."""

import json
import subprocess

import imageio.v2 as imageio
import jax
import pytest

from conftest import LAUNCHER, PYTHON
from podracer.anakin.env import make_env
from podracer.anakin.train import train_ppo
from podracer.orchestrate.cli import main, parse_configs
from podracer.errors import PodracerError
from podracer.video import anakin_renderer


def test_eval_video_has_a_frame_per_state(tmp_path, capsys):
    # In this process: a short run on one device, then the `eval` command on it.
    run_dir = tmp_path / "run"
    train_ppo(parse_configs(["--total-steps=2048", f"--run-dir={run_dir}"]), devices=jax.devices()[:1])
    capsys.readouterr()
    path = tmp_path / "eval.gif"
    assert main(["eval", f"--run-dir={run_dir}", "--episodes=2", f"--video={path}"]) == 0
    written = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    lengths = written["episode_lengths"]
    assert len(lengths) == 2 and written["episode_returns"] == [float(n) for n in lengths]  # CartPole pays 1 a step
    frames = list(imageio.get_reader(path))
    assert len(frames) == written["frames"] == sum(n + 1 for n in lengths)
    assert frames[0].ndim == 3 and frames[0].shape[0] >= 160


def test_refusals(tmp_path):
    with pytest.raises(PodracerError, match="cannot render"):
        anakin_renderer("Catch-bsuite", make_env("Catch-bsuite"))
    proc = subprocess.run([PYTHON, LAUNCHER, "eval", f"--run-dir={tmp_path}", "--video=out.avi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and ".mp4" in proc.stderr
