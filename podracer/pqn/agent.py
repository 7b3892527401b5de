"""PQN as an agent (`podracer.agent.Agent`): epsilon-greedy acting, Q(lambda) learning, all pure functions."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax

from podracer.agent import Agent, Rollout, Trajectory
from podracer.networks import init_params
from podracer.pqn.config import PQNConfig
from podracer.pqn.targets import epsilon_at
from podracer.pqn.update import QTransition, make_update
from podracer.ppo.update import init_train_state
from podracer.qnetwork import draw_exploration, epsilon_greedy


def epsilon_of(config: PQNConfig, update: jax.Array) -> jax.Array:
    """The exploration rate of the rollout acted on after `update` updates (the state's step counter)."""
    if not config.schedule_updates:
        raise ValueError("PQNConfig.schedule_updates is 0: set it to the run's update count "
                         "(the command line fills it in from --total-steps)")
    return epsilon_at(update, config.epsilon_start, config.epsilon_end,
                      config.epsilon_decay_fraction * config.schedule_updates)


def make_agent(network, optimizer: optax.GradientTransformation, config: PQNConfig, spec: Any,
               rollout_len: int, axis_names: Sequence[str] = (), *, num_envs: int | None = None) -> Agent:
    """PQN on a Q-network (`podracer.pqn.make_q_network`: a layer-normed `podracer.qnetwork.QNetwork`) as an `Agent`.

    Acting is epsilon-greedy, epsilon read off the state's update counter
    (`epsilon_of`), so a population's agents and a resumed run act as one run
    would; the random draws are made ahead of the rollout. `act` hands out the
    max-Q of each observation (computed there for the greedy action anyway);
    `prepare` adds, in one batch each, that of the observations that ended
    episodes and of the one after the rollout; `learn` is `make_update`'s.
    """
    apply_fn = network.apply
    update = make_update(apply_fn, optimizer, config, tuple(axis_names))
    q_max = lambda params, obs: jnp.max(apply_fn(params, obs), axis=-1)

    def init(key):
        return init_train_state(init_params(network, spec.obs_shape, spec.obs_dtype, key), optimizer,
                                spec.obs_shape)

    def act(state, obs, draws, carry):
        uniform, random_action = draws
        q = apply_fn(state.params, obs)
        action = epsilon_greedy(q, epsilon_of(config, state.step), uniform, random_action)
        return action, carry, jnp.max(q, axis=-1)

    def prepare(state, rollout: Trajectory):
        num_steps, num_envs = rollout.reward.shape
        flat = rollout.final_obs.reshape((num_steps * num_envs,) + rollout.final_obs.shape[2:])
        final_q_max = q_max(state.params, flat).reshape(num_steps, num_envs)
        batch = QTransition(rollout.obs, rollout.action, rollout.reward, rollout.terminated, rollout.truncated,
                            rollout.extras, final_q_max)
        return batch, q_max(state.params, rollout.next_obs)

    def learn(state, batch, bootstrap_q, key, carry):
        epsilon = epsilon_of(config, state.step)
        state, metrics = update(state, batch, bootstrap_q, key)
        return state, {**metrics, "epsilon": epsilon}

    # Acting reads the parameters and the update counter (epsilon); the optimizer state stays with the learner.
    return Agent(init, act, prepare, learn, Rollout(rollout_len),
                 draw=lambda key: draw_exploration(key, spec.action_dim), initial_carry=lambda num_envs: (),
                 acting_state=lambda state: state._replace(opt_state=()))
