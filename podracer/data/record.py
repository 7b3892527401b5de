"""Record episodes of a policy on an Anakin (gymnax) environment, as RLDS-layout arrays.

A policy to record is an `ActFn` and its first argument (`podracer.acting.Policy`):
`ppo_policy` builds one from a PPO train state, `es_policy` from an ES search
distribution's mean. `make_recorder` returns a pure, jittable function that runs one episode in each
of `num_episodes` environments at once (vmapped) and lays the steps out the RLDS
way, batch-major: step t holds the observation the policy acted on, its action
and log-probability, and the reward that followed; one more step holds the final
observation. The result goes straight to `DatasetWriter.add_episodes`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from podracer.acting import ActFn
from podracer.data.episodes import EpisodeBatch
from podracer.data.spec import (ACTION, DISCOUNT, IS_FIRST, IS_LAST, IS_TERMINAL, OBSERVATION,
                                POLICY_LOG_PROB, REWARD)

def default_max_steps(env) -> int:
    """The environment's own time limit, which every episode reaches at the latest
    (`horizon`: gymnax's `max_steps_in_episode`, a suite's time limit)."""
    return int(getattr(env, "horizon", 1000))


def make_recorder(env, act_fn: ActFn, num_episodes: int, max_steps: int | None = None
                  ) -> Callable[[Any, jax.Array], EpisodeBatch]:
    """Build `record(params, key) -> EpisodeBatch` of `num_episodes` episodes.

    Each episode runs in its own environment for at most `max_steps` steps
    (default: the environment's time limit); an episode still running then ends
    truncated. Steps are [num_episodes, max_steps + 1, ...]; past an episode's
    last step everything is zero and `mask` is False. Flags follow RLDS:
    `is_terminal` on the last step when the episode reached a terminal state,
    `discount` 0 on the step whose action led there, 1 on the others.
    `metadata` holds `episode_return` and `episode_length` (transitions).
    """
    if num_episodes <= 0:
        raise ValueError(f"num_episodes must be positive, got {num_episodes}")
    max_steps = default_max_steps(env) if max_steps is None else max_steps

    def step(params, carry, keys):
        env_state, obs, finished = carry
        action, log_prob = act_fn(params, obs, keys[:, 0])[:2]
        env_state, ts = jax.vmap(env.step)(keys[:, 1], env_state, action)
        ended = jnp.logical_or(ts.terminated, ts.truncated)
        row = (obs, action, log_prob, ts.reward, ts.terminated, ts.final_obs)
        return (env_state, ts.obs, jnp.logical_or(finished, ended)), (row, finished)

    def record(params, key) -> EpisodeBatch:
        reset_key, run_key = jax.random.split(key)
        env_state, first = jax.vmap(env.reset)(jax.random.split(reset_key, num_episodes))
        keys = jax.random.split(run_key, max_steps * num_episodes * 2)
        keys = keys.reshape((max_steps, num_episodes, 2) + keys.shape[1:])
        carry = (env_state, first.obs, jnp.zeros(num_episodes, bool))
        _, (rows, finished_before) = jax.lax.scan(lambda c, k: step(params, c, k), carry, keys)
        # Time-major [T, N] -> batch-major [N, T].
        obs, action, log_prob, reward, terminated, final_obs = jax.tree.map(
            lambda x: jnp.swapaxes(x, 0, 1), rows)
        length = (~finished_before).sum(axis=0)  # transitions; step `length` is the final observation
        episodes = jnp.arange(num_episodes)
        reached_terminal = terminated[episodes, length - 1]

        t = jnp.arange(max_steps + 1)[None, :]
        acting = t < length[:, None]  # steps whose action was taken: [N, T + 1]
        is_last = t == length[:, None]
        mask = t <= length[:, None]

        def where(condition, x, y):
            return jnp.where(condition.reshape(condition.shape + (1,) * (x.ndim - 2)), x, y)

        def acting_steps(x):
            """[N, T, ...] -> [N, T + 1, ...], zero on the final step and past it."""
            return where(acting, jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1), 0)

        final_step = final_obs[episodes, length - 1][:, None]  # [N, 1, ...]
        steps = {
            OBSERVATION: where(is_last, final_step, acting_steps(obs)),
            ACTION: acting_steps(action),
            REWARD: acting_steps(reward),
            DISCOUNT: jnp.where(acting, 1.0 - acting_steps(terminated.astype(jnp.float32)), 0.0),
            IS_FIRST: jnp.broadcast_to(t == 0, mask.shape),
            IS_LAST: is_last,
            IS_TERMINAL: is_last & reached_terminal[:, None],
            POLICY_LOG_PROB: acting_steps(log_prob),
        }
        metadata = {"episode_return": steps[REWARD].sum(axis=1), "episode_length": length}
        return EpisodeBatch(steps, mask, metadata)

    return record
