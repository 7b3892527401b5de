"""PQN as an agent (`podracer.agent.Agent`): epsilon-greedy acting, Q(lambda) learning, all pure functions."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from podracer.agent import Agent, Rollout, Trajectory
from podracer.networks import init_params
from podracer.pqn.config import PQNConfig
from podracer.pqn.targets import epsilon_at, epsilon_greedy, epsilon_greedy_log_prob
from podracer.pqn.update import QTransition, make_update
from podracer.ppo.update import init_train_state


def epsilon_of(config: PQNConfig, update: jax.Array) -> jax.Array:
    """The exploration rate of the rollout acted on after `update` updates (the state's step counter)."""
    if not config.schedule_updates:
        raise ValueError("PQNConfig.schedule_updates is 0: set it to the run's update count "
                         "(the command line fills it in from --total-steps)")
    return epsilon_at(update, config.epsilon_start, config.epsilon_end,
                      config.epsilon_decay_fraction * config.schedule_updates)


def draw_exploration(key: jax.Array, num_actions: int) -> tuple[jax.Array, jax.Array]:
    """One environment's exploration draw: a uniform number (explore below epsilon) and a random action."""
    uniform_key, action_key = jax.random.split(key)
    return jax.random.uniform(uniform_key), jax.random.randint(action_key, (), 0, num_actions)


def make_epsilon_act(apply_fn: Callable, epsilon: float, greedy: bool = False) -> Callable:
    """`act_fn(params, obs [B, ...], keys [B, 2]) -> (action, log_prob)`: a trained Q-network's policy.

    Epsilon-greedy with `epsilon`, or with `greedy` the argmax; either way the
    log-probability is that of the epsilon-greedy choice (what a recorded
    dataset keeps, as PPO's keeps its stochastic policy's beside a mode).
    """

    def act_fn(params, obs, keys):
        q = apply_fn(params, obs)
        if greedy:
            action = jnp.argmax(q, axis=-1).astype(jnp.int32)
        else:
            uniform, random_action = jax.vmap(lambda k: draw_exploration(k, q.shape[-1]))(keys)
            action = epsilon_greedy(q, epsilon, uniform, random_action)
        return action, epsilon_greedy_log_prob(q, action, jnp.asarray(epsilon, q.dtype))

    return act_fn


def make_agent(network, optimizer: optax.GradientTransformation, config: PQNConfig, spec: Any,
               rollout_len: int, axis_names: Sequence[str] = (), *, num_envs: int | None = None) -> Agent:
    """PQN on a Q-network (`podracer.pqn.QNetwork`) as an `Agent`.

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
