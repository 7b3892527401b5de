"""Sebulba's acting: the randomness of many steps is drawn in one call, and the per-step policy
call is the policy alone. A real PPO agent on envpool CartPole's spaces."""

import jax
import numpy as np
import optax

from podracer.networks import make_network
from podracer.ppo import PPOConfig, make_agent
from podracer.sebulba.actor import Draws, make_acting
from podracer.sebulba.envs import env_spec


def _acting():
    spec = env_spec("CartPole-v1")
    network = make_network(spec.obs_shape, spec.action_dim, spec.discrete, (16, 16))
    agent = make_agent(network, optax.sgd(0.0), PPOConfig(), spec, rollout_len=4)
    acting_state = agent.acting_state(agent.init(jax.random.PRNGKey(0)))
    return spec, agent, acting_state, make_acting(agent, acting_state, spec)


def test_the_per_step_policy_call_draws_no_random_numbers():
    # Random bits inside the step cost XLA:CPU two while loops and a second thread each call.
    spec, agent, acting_state, acting = _acting()
    batch = 6
    obs = np.zeros((batch, *spec.obs_shape), np.float32)
    randomness = Draws(acting, jax.random.PRNGKey(1), calls=3, batch=batch).next()
    jaxpr = str(jax.make_jaxpr(acting.step)(acting_state, obs, randomness, ()))
    assert "threefry" not in jaxpr and "random_bits" not in jaxpr, jaxpr
    action, _, log_prob = acting.unpack(np.asarray(acting.step(acting_state, obs, randomness, ())))
    expected_action, _, expected_log_prob = agent.act(acting_state, obs, randomness, ())
    np.testing.assert_array_equal(action, np.asarray(expected_action))
    np.testing.assert_allclose(log_prob, np.asarray(expected_log_prob), rtol=1e-6)


def test_draws_hand_out_each_step_of_a_block_once_then_draw_the_next_block():
    _, agent, _, acting = _acting()
    calls, batch = 3, 5
    draws = Draws(acting, jax.random.PRNGKey(7), calls, batch)
    steps = [draws.next() for _ in range(2 * calls)]
    assert all(s.shape == (batch, 2) for s in steps)
    # One block is Agent.draw of one key per environment and step, split from the actor's key.
    _, draw_key = jax.random.split(jax.random.PRNGKey(7))
    first_block = jax.vmap(agent.draw)(jax.random.split(draw_key, calls * batch)).reshape(calls, batch, 2)
    np.testing.assert_allclose(np.stack(steps[:calls]), np.asarray(first_block), rtol=1e-6)
    # Every step (across blocks too) and every environment gets noise of its own.
    rows = np.concatenate(steps).reshape(-1, 2)
    assert len(np.unique(rows, axis=0)) == 2 * calls * batch
