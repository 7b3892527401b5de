"""Recording from Anakin: what is stored is what the policy saw, did and got, step for step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from gymnax.environments.classic_control.cartpole import EnvState as CartPoleState

from podracer import data, ppo
from podracer.envs.jax_envs import make_env
from podracer.networks import make_network

MAX_STEPS = 25


def test_recorded_episodes_read_back_and_replay_in_gymnax(tmp_path):
    env = make_env("CartPole-v1")
    network = make_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete)
    params = network.init(jax.random.PRNGKey(0), jnp.zeros((1, 4)))
    state = ppo.init_train_state(params, optax.identity(), env.spec.obs_shape)
    act_fn = data.policy_act_fn(network.apply, ppo.PPOConfig())
    record = jax.jit(data.make_recorder(env, act_fn, num_episodes=8, max_steps=MAX_STEPS))
    recorded = jax.device_get(record(state, jax.random.PRNGKey(3)))

    with data.DatasetWriter(str(tmp_path / "ds"), data.step_spec_for_env(env.spec)) as writer:
        assert writer.add_episodes(recorded) == list(range(8))
    loaded = data.load_episodes(str(tmp_path / "ds"))

    # Read back exactly as recorded (actions widened to int64, the RLDS convention).
    width = loaded.mask.shape[1]
    assert not recorded.mask[:, width:].any()
    np.testing.assert_array_equal(loaded.mask, recorded.mask[:, :width])
    for field, value in loaded.steps.items():
        np.testing.assert_array_equal(value, np.asarray(recorded.steps[field])[:, :width], err_msg=field)
    assert loaded.steps["action"].dtype == np.int64
    np.testing.assert_array_equal(loaded.metadata["episode_length"], recorded.metadata["episode_length"])
    np.testing.assert_allclose(loaded.metadata["episode_return"], recorded.metadata["episode_return"])

    steps = loaded.steps
    lengths = loaded.mask.sum(axis=1) - 1  # transitions
    terminal = steps["is_terminal"].any(axis=1)
    # A random policy drops the pole within MAX_STEPS in some episodes, not in others.
    assert terminal.any() and not terminal.all()
    assert (lengths[~terminal] == MAX_STEPS).all()

    # Replay every episode in gymnax's CartPole, from its first observation, with the
    # recorded actions: every next observation, reward and ending must agree.
    step_env = jax.jit(env.env.step_env)
    is_terminated = jax.jit(env.env.is_terminated)
    for n, length in enumerate(lengths):
        obs = steps["observation"][n]
        assert steps["is_first"][n, 0] and steps["is_first"][n].sum() == 1
        assert steps["is_last"][n, length] and steps["is_last"][n].sum() == 1
        cart = CartPoleState(time=0, x=obs[0, 0], x_dot=obs[0, 1], theta=obs[0, 2], theta_dot=obs[0, 3])
        for t in range(length):
            next_obs, cart, reward, _, _ = step_env(jax.random.PRNGKey(0), cart, steps["action"][n, t],
                                                    env.params)
            np.testing.assert_allclose(next_obs, obs[t + 1], rtol=1e-6, atol=1e-7)
            assert float(reward) == steps["reward"][n, t] == 1.0
            ended = bool(is_terminated(cart, env.params))
            assert ended == (t == length - 1 and terminal[n])
            assert steps["discount"][n, t] == (0.0 if ended else 1.0)
        # The last step carries the final observation only.
        assert steps["action"][n, length] == 0 and steps["reward"][n, length] == 0.0

    # The log-probabilities are the policy's, at the observations it acted on.
    acting = loaded.mask & ~steps["is_last"]
    log_prob = jax.jit(lambda obs, action: network.apply(params, obs)[0].log_prob(action))
    np.testing.assert_allclose(log_prob(steps["observation"][acting], steps["action"][acting]),
                               steps["policy_log_prob"][acting], rtol=1e-5, atol=1e-6)
    assert (steps["policy_log_prob"][acting] < 0).all()
