"""PQN as an agent (`podracer.agent.Agent`): epsilon-greedy acting, Q(lambda) learning, all pure functions."""

from __future__ import annotations

from typing import Any, Callable, Sequence

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


def truncated_q_max(q_max: Callable, params, rollout: Trajectory) -> jax.Array:
    """[T, B]: max-Q of the final observation of every truncated row (`QTransition.final_q_max`; the values
    of other rows are never read).

    A time limit no shorter than the rollout truncates each environment at
    most once in it, so only one final observation per environment is
    evaluated, that of its first truncation (B observations, not T x B);
    where an environment was truncated more than once, every row is.
    """
    final_obs, truncated = rollout.final_obs, rollout.truncated
    num_steps, num_envs = truncated.shape

    def first_truncations(_):
        first = jnp.argmax(truncated, axis=0)  # [B]; 0 where never truncated (that row is not read)
        index = first.reshape((1, num_envs) + (1,) * (final_obs.ndim - 2))
        q = q_max(params, jnp.take_along_axis(final_obs, index, axis=0)[0])
        return jnp.where(jnp.arange(num_steps)[:, None] == first, q, 0.0)

    def every_row(_):
        flat = final_obs.reshape((num_steps * num_envs,) + final_obs.shape[2:])
        return q_max(params, flat).reshape(num_steps, num_envs)

    at_most_once = jnp.all(jnp.sum(truncated, axis=0) <= 1)
    return jax.lax.cond(at_most_once, first_truncations, every_row, None)


def make_agent(network, optimizer: optax.GradientTransformation, config: PQNConfig, spec: Any,
               rollout_len: int, axis_names: Sequence[str] = (), *, num_envs: int | None = None) -> Agent:
    """PQN on a Q-network (`podracer.pqn.make_q_network`: a layer-normed `podracer.qnetwork.QNetwork`) as an `Agent`.

    Acting is epsilon-greedy, epsilon read off the state's update counter
    (`epsilon_of`), so a population's agents and a resumed run act as one run
    would; the random draws are made ahead of the rollout. `act` hands out the
    max-Q of each observation (computed there for the greedy action anyway);
    `prepare` adds that of the final observations of truncated episodes
    (`truncated_q_max`) and of the one after the rollout; `learn` is `make_update`'s.
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
        batch = QTransition(rollout.obs, rollout.action, rollout.reward, rollout.terminated, rollout.truncated,
                            rollout.extras, truncated_q_max(q_max, state.params, rollout))
        return batch, q_max(state.params, rollout.next_obs)

    def learn(state, batch, bootstrap_q, key, carry):
        epsilon = epsilon_of(config, state.step)
        state, metrics = update(state, batch, bootstrap_q, key)
        return state, {**metrics, "epsilon": epsilon}

    # Acting reads the parameters and the update counter (epsilon); the optimizer state stays with the learner.
    return Agent(init, act, prepare, learn, Rollout(rollout_len),
                 draw=lambda key: draw_exploration(key, spec.action_dim), initial_carry=lambda num_envs: (),
                 acting_state=lambda state: state._replace(opt_state=()))
