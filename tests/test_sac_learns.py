"""SAC learns Pendulum with its preset, a learning rate of 0 does not; a trained run evaluates and resumes bitwise.

One population run holds both: the preset's agent and its control (--sweep lr=1e-3,0),
each on its own CPU device, compiled once.
"""

import json
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import LAUNCHER, PYTHON
from podracer import sac
from podracer.envs.jax_envs import make_env
from podracer.policy import load_policy
from podracer.session.checkpoint import checkpoint_steps, restore_on_host


def _launch(*args, cwd, timeout=600):
    return subprocess.run([PYTHON, LAUNCHER, "--arch=anakin", "--algo=sac", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def pendulum(tmp_path_factory):
    root = tmp_path_factory.mktemp("sac")
    result = _launch("--env=Pendulum-v1", "--sweep", "lr=1e-3,0", "--cpu-devices=2", f"--run-dir={root / 'run'}",
                     cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "run", json.loads((root / "run" / "summary.json").read_text())


def test_the_preset_reaches_minus_250_on_pendulum_and_a_zero_learning_rate_does_not(pendulum):
    _, summary = pendulum
    learned, control = summary["agents"]
    assert learned["settings"]["lr"] == 1e-3 and control["settings"]["lr"] == 0.0
    assert learned["episode_return_mean"] >= -250, learned  # measured: about -150
    assert control["episode_return_mean"] < -900, control  # measured: about -1,190 (random torques)


def test_eval_acts_with_the_tanh_of_the_mean_scaled_to_the_bounds(pendulum):
    run_dir, _ = pendulum
    result = subprocess.run([PYTHON, LAUNCHER, "eval", f"--run-dir={run_dir}", "--agent=0", "--episodes=4",
                             "--deterministic"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1])["episode_return_mean"] >= -250

    saved = restore_on_host(str(run_dir / "checkpoints" / str(checkpoint_steps(str(run_dir))[-1]) / "state"))
    actor = jax.tree.map(lambda x: jnp.asarray(x[0]), saved["train"]["params"]["actor"])  # agent 0
    spec = make_env("Pendulum-v1").spec
    networks = sac.make_networks(spec.obs_shape, spec.action_dim, (64, 64), "relu", spec.action_low,
                                 spec.action_high)
    obs = jax.random.normal(jax.random.PRNGKey(0), (5, 3))
    mean = networks.actor.apply(actor, obs).mean
    act = load_policy(str(run_dir), deterministic=True, agent=0)
    deterministic = act(obs, jax.random.PRNGKey(1))
    np.testing.assert_allclose(deterministic, 2.0 * np.tanh(mean), rtol=1e-5, atol=1e-6)  # bounds +-2
    np.testing.assert_array_equal(deterministic, act(obs, jax.random.PRNGKey(2)))
    sampled = load_policy(str(run_dir), agent=0)
    assert not np.array_equal(sampled(obs, jax.random.PRNGKey(1)), sampled(obs, jax.random.PRNGKey(2)))


SHORT = ["--env=Pendulum-v1", "--num-envs=8", "--rollout-len=8", "--updates-per-call=4", "--learning-starts=128",
         "--batch-size=32", "--updates-per-rollout=2", "--hidden", "16", "16"]


def test_a_resumed_run_is_bitwise_the_run_that_never_stopped(tmp_path):
    def final_state(run_dir):
        steps = checkpoint_steps(str(run_dir))
        return steps[-1], restore_on_host(str(run_dir / "checkpoints" / str(steps[-1]) / "state"))

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for args in ((f"--run-dir={straight}", "--total-steps=2048"), (f"--run-dir={resumed}", "--total-steps=1024"),
                 (f"--run-dir={resumed}", "--total-steps=2048")):
        result = _launch(*SHORT, *args, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((resumed / "summary.json").read_text())["resumed_from_env_steps"] == 1024
    (steps_a, a), (steps_b, b) = final_state(straight), final_state(resumed)
    assert steps_a == steps_b == 2048 and int(np.asarray(a["train"]["step"])) > 0
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)  # parameters, optimizers, buffer, envs, key
    assert len(leaves_a) == len(leaves_b) > 0
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
