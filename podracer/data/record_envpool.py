"""Record episodes of a policy on envpool environments (Sebulba's), step by step.

A host loop steps a batch of `EnvPoolEnvs` synchronously and writes each
environment's steps with `DatasetWriter.add_step` / `end_episode` (its stream is
the environment's index), in the layout of the gymnax recorder
(`podracer.data.record`): step t holds the observation acted on, the action,
the policy's log-probability of it and the reward that followed; the episode's
final observation is one more step.

envpool auto-resets (`podracer.sebulba.envs`): the result that ends an episode
carries its final observation, and that environment's next step ignores its
action and returns the first observation of a new episode. Each environment
records only its first episode after the batch is reset, so neither that reset
step nor a second episode is ever recorded, and short episodes are not favoured
over long ones. More episodes than `max_envs` are recorded in rounds, each on a
freshly reset batch.

An episode is what envpool reports as one: from a reset to the step that is
`terminated` or `truncated`. On Atari, which podracer plays with episodic life,
that is one life (a lost life is `terminated`), not a whole game, and the
rewards are the clipped ones the agent learns from. Observations are stored as
`EnvPoolEnvs` yields them (float64 ones as float32).
"""

from __future__ import annotations

import math

import jax
import numpy as np

from podracer.acting import Policy
from podracer.data.writer import DatasetWriter
from podracer.protocol import parallel

# Environments stepped at once: bounds the open episodes held in memory (Atari frames).
MAX_ENVS = 16


def make_batch_act(policy: Policy):
    """Jitted `act(params, obs [B, ...], key, t) -> (action, log_prob)`: one call per step,
    with one key per environment split from `fold_in(key, t)`."""

    def act(params, obs, key, t):
        keys = jax.random.split(jax.random.fold_in(key, t), obs.shape[0])
        return policy.act_fn(params, obs, keys)[:2]

    return jax.jit(act)


def record_envpool(writer: DatasetWriter, env_id: str, policy: Policy, num_episodes: int, seed: int,
                   key: jax.Array, max_envs: int = MAX_ENVS) -> list[float]:
    """Write `num_episodes` complete episodes of `policy` on envpool's `env_id` into `writer`.

    Rounds of at most `max_envs` environments, each seeded from `seed` and the
    round, each environment recording its first episode. Returns the episodes'
    returns in the order they were written.
    """
    if num_episodes <= 0:
        raise ValueError(f"num_episodes must be positive, got {num_episodes}")
    from podracer.sebulba.envs import EnvPoolEnvs

    act = make_batch_act(policy)
    # Played here, on one local device: never a computation over another process's devices.
    params = jax.device_put(parallel.to_host(policy.params), jax.local_devices()[0])
    returns: list[float] = []
    for round_ in range(math.ceil(num_episodes / max_envs)):
        num_envs = min(max_envs, num_episodes - len(returns))
        env_seed = int(np.random.SeedSequence([seed, round_]).generate_state(1)[0] >> 1)
        envs = EnvPoolEnvs(env_id, num_envs, num_envs, 0, seed=env_seed)
        try:
            returns += _record_round(writer, envs, act, params, jax.random.fold_in(key, round_))
        finally:
            envs.close()
    return returns


def _record_round(writer: DatasetWriter, envs, act, params, key: jax.Array) -> list[float]:
    """Every environment of `envs` plays until its first episode ends; that episode is written."""
    from podracer.sebulba.envs import in_env_order

    env_ids = np.arange(envs.num_envs, dtype=np.int32)
    envs.start()
    obs = in_env_order(envs.recv()).obs  # the first observations (reset steps)
    recording = np.ones(envs.num_envs, bool)
    totals = np.zeros(envs.num_envs, np.float64)
    returns = []
    t = 0
    while recording.any():
        action, log_prob = jax.device_get(act(params, obs, key, t))
        # Environments whose episode was written keep stepping (envpool steps the
        # whole batch); what they do is not recorded.
        envs.send(np.asarray(action), env_ids)
        step = in_env_order(envs.recv())
        ended = step.terminated | step.truncated
        for i in np.flatnonzero(recording):
            writer.add_step(obs[i], action[i], step.reward[i], policy_log_prob=log_prob[i], stream=i)
            totals[i] += step.reward[i]
            if ended[i]:
                writer.end_episode(step.obs[i], bool(step.terminated[i]), stream=i)
                returns.append(float(totals[i]))
                recording[i] = False
        obs = step.obs  # envpool returns new arrays on every `recv`: this one outlives the next
        t += 1
    return returns
