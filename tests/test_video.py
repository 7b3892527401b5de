"""`eval --video`: a file whose frame count matches the episodes' lengths; one-line refusals."""

import json
import os
import subprocess

import imageio.v2 as imageio
import jax
import numpy as np
import pytest

from conftest import LAUNCHER, PYTHON
from podracer.envs.jax_envs import make_env
from podracer.anakin.train import train_ppo
from podracer.command import main
from podracer.orchestrate.cli import parse_configs
from podracer.errors import PodracerError
from podracer.video import anakin_renderer
from test_suites import _countdown_env


def test_eval_video_has_a_frame_per_state(tmp_path, capsys):
    # In this process: a short run on one device, then the `eval` command on it.
    run_dir = tmp_path / "run"
    train_ppo(parse_configs(["--total-steps=2048", f"--run-dir={run_dir}"]), devices=jax.devices()[:1])
    capsys.readouterr()
    path = tmp_path / "eval.gif"
    assert main(["eval", f"--run-dir={run_dir}", "--episodes=2", f"--video={path}"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    evaluated, written = json.loads(lines[-3]), json.loads(lines[-1])
    lengths = written["episode_lengths"]
    assert len(lengths) == 2 and written["episode_returns"] == [float(n) for n in lengths]  # CartPole pays 1 a step
    # The episodes evaluated are the ones in the video.
    assert evaluated["episodes"] == 2 and evaluated["episode_return_mean"] == np.mean(written["episode_returns"])
    frames = list(imageio.get_reader(path))
    assert len(frames) == written["frames"] == sum(n + 1 for n in lengths)
    assert frames[0].ndim == 3 and frames[0].shape[0] >= 160


def test_eval_video_from_the_command_line_prints_no_console_noise_and_refuses_without_pygame(tmp_path):
    """Gymnasium's CartPole renderer starts pygame, whose SDL reports a machine's missing sound
    card and display on stderr, and imageio starts ffmpeg under JAX's fork warning: neither
    reaches the console. Without pygame (not installed), a one-line refusal before any episode."""
    run_dir = tmp_path / "run"
    train_ppo(parse_configs(["--total-steps=2048", f"--run-dir={run_dir}"]), devices=jax.devices()[:1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("SDL_")}
    command = [PYTHON, LAUNCHER, "eval", f"--run-dir={run_dir}", "--episodes=1"]
    proc = subprocess.run(command + [f"--video={tmp_path / 'eval.mp4'}"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["frames"] >= 2
    for noise in ("ALSA", "XDG_RUNTIME_DIR", "os.fork()"):
        assert noise not in proc.stderr, proc.stderr

    hidden = tmp_path / "no_pygame" / "pygame"  # an import of pygame fails, as where it is not installed
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('No module named pygame')\n")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hidden.parent), env.get("PYTHONPATH")]))
    proc = subprocess.run(command + [f"--video={tmp_path / 'other.mp4'}"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "pygame" in proc.stderr and 'pip install -e ".[video]"' in proc.stderr
    assert "mean return" not in proc.stdout and not (tmp_path / "other.mp4").exists()


def test_the_video_extra_installs_what_draws_classic_control():
    """`pip install -e ".[video]"` is all `eval --video` of the default CartPole asks for."""
    import re
    import tomllib

    from conftest import REPO_ROOT

    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["video"]
    names = {re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower() for requirement in extra}
    assert {"imageio", "imageio-ffmpeg", "pygame"} <= names


def test_refusals(tmp_path):
    with pytest.raises(PodracerError, match="cannot render"):
        anakin_renderer("Catch-bsuite", make_env("Catch-bsuite"))
    proc = subprocess.run([PYTHON, LAUNCHER, "eval", f"--run-dir={tmp_path}", "--video=out.avi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and ".mp4" in proc.stderr


@pytest.mark.parametrize("env_id", ["CartPole-v1", "toy:countdown"])
def test_stepped_inner_is_the_state_an_episode_ended_in(env_id):
    """A video's last frame of an episode is drawn from `stepped_inner`: the state `step`
    reached before its auto-reset replaced it (gymnax and suite adapters alike)."""
    env = make_env(env_id) if env_id == "CartPole-v1" else _countdown_env(False)
    obs_of = (lambda inner: env.env.get_obs(inner)) if env_id == "CartPole-v1" else None
    step, stepped_inner = jax.jit(env.step), jax.jit(env.stepped_inner)
    state, _ = env.reset(jax.random.PRNGKey(0))
    ends = 0
    for t in range(300):
        key = jax.random.PRNGKey(t + 1)
        inner = stepped_inner(key, state, 1)  # CartPole: always right, so episodes end soon
        state, ts = step(key, state, 1)
        if bool(ts.terminated | ts.truncated):
            ends += 1
            # Not the reset state the step returned, but the one its final observation shows.
            assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(inner), jax.tree.leaves(state.inner)))
            if obs_of is not None:
                np.testing.assert_allclose(obs_of(inner), ts.final_obs, rtol=1e-6)
            else:
                assert int(inner) == 0 and float(ts.final_obs[0]) == 0.0  # the countdown reached 0
        else:
            for a, b in zip(jax.tree.leaves(inner), jax.tree.leaves(state.inner)):
                np.testing.assert_array_equal(a, b)
    assert ends >= 5
