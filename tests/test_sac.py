"""SAC's maths against hand values and a numerical density, and its agent on any device count."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.scipy.stats import norm

from podracer import sac
from podracer.agent import Trajectory
from podracer.envs.jax_envs import make_env
from podracer.anakin.loop import AnakinConfig, make_programs
from podracer.distributions import TanhGaussian
from podracer.protocol import parallel


def test_the_target_entropy_is_minus_the_action_dimension_by_default():
    assert sac.target_entropy(3) == -3.0
    assert sac.target_entropy(2, per_dim=-0.5) == -1.0
    assert sac.SACConfig().target_entropy_per_dim == -1.0


def test_the_temperature_loss_and_its_gradient_against_hand_values():
    log_prob = jnp.asarray([-1.0, 0.5])  # entropy estimate 0.25, above the target -1
    loss, (grad_alpha, grad_log_prob) = jax.value_and_grad(sac.temperature_loss, argnums=(0, 1))(
        jnp.log(2.0), log_prob, -1.0)
    # -mean(2 * ([-1, 0.5] - 1)) = -mean([-4, -1]) = 2.5; d/d log_alpha is the same (alpha = e^log_alpha).
    assert float(loss) == pytest.approx(2.5) and float(grad_alpha) == pytest.approx(2.5)
    assert grad_alpha > 0  # gradient descent lowers alpha while the entropy is above its target
    np.testing.assert_array_equal(grad_log_prob, 0.0)  # the policy is held fixed


def test_the_actor_loss_pays_alpha_log_prob_and_gains_the_smaller_critic():
    log_prob = jnp.asarray([-1.0, 0.5])
    q = jnp.asarray([[3.0, 1.0], [2.0, 4.0]])  # min: [2, 1]
    loss, (grad_log_prob, grad_q) = jax.value_and_grad(sac.actor_loss, argnums=(0, 1))(log_prob, q, jnp.asarray(0.5))
    # mean(0.5 * [-1, 0.5] - [2, 1]) = mean([-2.5, -0.75]) = -1.625
    assert float(loss) == pytest.approx(-1.625)
    # Descent lowers log pi (raises the entropy) and raises the smaller critic's value only.
    np.testing.assert_allclose(grad_log_prob, [0.25, 0.25])
    np.testing.assert_allclose(grad_q, [[0.0, -0.5], [-0.5, 0.0]])


def test_the_critic_target_takes_the_smaller_target_critic_minus_alpha_log_prob():
    reward = jnp.asarray([1.0, 2.0, 3.0])
    terminated = jnp.asarray([False, True, False])
    next_q = jnp.asarray([[5.0, 1.0, 2.0], [4.0, 3.0, -1.0]])  # min: [4, 1, -1]
    next_log_prob = jnp.asarray([0.5, -1.0, 2.0])
    target = sac.critic_target(reward, terminated, next_q, next_log_prob, jnp.asarray(0.5), 0.9)
    # soft values [4 - 0.25, 1 + 0.5, -1 - 1]; the terminated row keeps its reward only.
    np.testing.assert_allclose(target, [1 + 0.9 * 3.75, 2.0, 3 + 0.9 * -2.0], rtol=1e-6)
    q = jnp.asarray([[4.0, 2.0, 1.0], [5.0, 2.0, 1.0]])
    errors = (q - target) ** 2
    assert float(sac.critic_loss(q, target)) == pytest.approx(0.5 * float(errors[0].mean() + errors[1].mean()))


def test_a_truncated_episode_bootstraps_from_its_last_observation_and_a_terminated_one_does_not():
    # Two steps of one environment: row 0 ends its episode (truncated or terminated), row 1 does not.
    obs = jnp.asarray([[[0.0]], [[10.0]]])  # [T, B, 1]: row 1 is the next episode's first observation
    final_obs = jnp.asarray([[[5.0]], [[11.0]]])
    for truncated, terminated in ((True, False), (False, True)):
        rollout = Trajectory(obs, None, jnp.ones((2, 1)), jnp.asarray([[terminated], [False]]),
                             jnp.asarray([[truncated], [False]]), final_obs, None, (), jnp.asarray([[12.0]]), ())
        next_obs = sac.next_observations(rollout)
        np.testing.assert_array_equal(next_obs[:, 0, 0], [5.0, 12.0])  # the old episode's last, then the next
        value_of_next = next_obs[0, 0, 0] * jnp.ones((2, 1))  # critics valuing s' at 5
        target = sac.critic_target(jnp.ones(1), rollout.terminated[0], value_of_next, jnp.zeros(1),
                                   jnp.asarray(0.0), 0.5)
        assert float(target[0]) == (1.0 if terminated else 1.0 + 0.5 * 5.0)


def _numerical_log_density(mean, std, action, h=1e-4):
    """log of P(a - h < tanh(u) < a + h) / 2h per dimension, summed: the squashed density, numerically."""
    mass = norm.cdf((np.arctanh(action + h) - mean) / std) - norm.cdf((np.arctanh(action - h) - mean) / std)
    return np.sum(np.log(np.asarray(mass, np.float64) / (2 * h)), axis=-1)


def test_the_tanh_log_prob_correction_matches_a_numerical_density():
    mean, log_std = np.asarray([0.3, -1.2]), np.asarray([-0.5, 0.4])
    dist = TanhGaussian(jnp.asarray(mean, jnp.float32), jnp.asarray(log_std, jnp.float32))
    for action in ([0.1, -0.8], [0.9, 0.5], [-0.95, -0.2]):
        action = np.asarray(action)
        expected = _numerical_log_density(mean.astype(np.float64), np.exp(log_std), action)
        assert float(dist.log_prob(jnp.asarray(action, jnp.float32))) == pytest.approx(expected, abs=2e-3)
    # The sample's own log-probability (from its pre-squash value) is the log-probability of the action.
    noise = jnp.asarray([0.7, -0.3])
    action, log_prob = dist.sample_and_log_prob(noise)
    assert float(log_prob) == pytest.approx(float(dist.log_prob(action)), abs=1e-4)
    np.testing.assert_array_equal(dist.mode(), jnp.tanh(dist.mean))


ENV = make_env("Pendulum-v1")
NETWORKS = sac.make_networks(ENV.spec.obs_shape, ENV.spec.action_dim, (16,), "relu", ENV.spec.action_low,
                             ENV.spec.action_high)
SMALL = sac.SACConfig(buffer_size=256, batch_size=16, learning_starts=40, updates_per_rollout=2)
ANAKIN = AnakinConfig(num_envs=8, rollout_len=4, updates_per_call=3)


def _programs(num_devices):
    agent_for = lambda hparams, axes: sac.make_agent(NETWORKS, optax.adam(1e-3), SMALL, ENV.spec,
                                                     ANAKIN.rollout_len, axes)
    return make_programs(ENV, agent_for, ANAKIN, parallel.make_mesh(jax.devices()[:num_devices]))


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_one_and_eight_devices_train_the_same_agent():
    results = []
    for num_devices in (1, 8):
        programs = _programs(num_devices)
        runner = programs.init(jax.random.PRNGKey(3))
        start = _leaves(runner.train.params)
        for _ in range(2):  # 6 rollouts of 32 transitions: learning starts with the second
            runner, metrics = programs.train(runner)
        results.append((runner, metrics))
    (one, metrics), (eight, _) = results
    assert int(one.train.step) == 5 * SMALL.updates_per_rollout  # every rollout after the first learned
    assert float(metrics["critic_loss"][-1]) > 0 and bool(np.all(metrics["params_finite"]))
    assert any(not np.array_equal(a, b) for a, b in zip(start, _leaves(one.train.params)))
    for a, b in zip(_leaves(one.train), _leaves(eight.train)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


REFUSED = {
    "a discrete environment": (["--env=CartPole-v1"], "acts in continuous action spaces"),
    "a buffer smaller than a batch": (["--buffer-size=64", "--batch-size=128"], "smaller than one batch"),
    "no Polyak step": (["--tau=0"], "--tau must be in (0, 1]"),
    "a Polyak step past a copy": (["--tau=1.5"], "--tau must be in (0, 1]"),
    "a batch that does not split over the devices": (["--batch-size=12"], "multiple of 8"),  # conftest's 8
    "Sebulba": (["--arch=sebulba"], "--algo=sac runs on --arch=anakin, not --arch=sebulba"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_bad_input_is_one_line_exit_2_before_compiling(name, tmp_path, capsys):
    from podracer.command import main

    flags, words = REFUSED[name]
    run_dir = tmp_path / "run"
    code = main(["--algo=sac", "--env=Pendulum-v1", *flags, f"--run-dir={run_dir}"])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and words in err, err
    # The device split is found as the program is traced (as the layout's own checks are, once the
    # devices are known): before XLA compiles anything, after the line that announces it.
    assert ("compiling" not in out or "split over" in err) and not (run_dir / "checkpoints").exists()


def test_the_docs_own_update_snippet_takes_one_step():
    import re

    from conftest import REPO_ROOT

    text = open(f"{REPO_ROOT}/docs/sac.md").read()
    source = re.search(r"<!-- snippet: own-update -->\s*```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(source, "docs/sac.md", "exec"), namespace)
    state, metrics = namespace["state"], namespace["metrics"]
    assert int(state.step) == 1 and all(np.isfinite(float(v)) for v in metrics.values())
    assert not np.array_equal(np.asarray(jax.tree.leaves(state.params.critic)[0]),
                              np.asarray(jax.tree.leaves(state.params.target_critic)[0]))  # the target trails the critic by tau
