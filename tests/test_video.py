"""`eval --video`: a file whose frame count matches the episodes' lengths; one-line refusals."""

import json
import subprocess

import imageio.v2 as imageio
import pytest

from conftest import LAUNCHER, PYTHON
from podracer.anakin.env import make_env
from podracer.errors import PodracerError
from podracer.video import anakin_renderer


def test_eval_video_has_a_frame_per_state(tmp_path):
    run_dir = tmp_path / "run"
    train = subprocess.run([PYTHON, LAUNCHER, "--total-steps=2048", f"--run-dir={run_dir}", "--cpu-devices=1"],
                           capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr[-2000:]
    path = tmp_path / "eval.gif"
    proc = subprocess.run([PYTHON, LAUNCHER, "eval", f"--run-dir={run_dir}", "--episodes=2", f"--video={path}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    written = json.loads(proc.stdout.strip().splitlines()[-1])
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
