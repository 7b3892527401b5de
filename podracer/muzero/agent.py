"""MuZero as an agent (`podracer.agent.Agent`): search to act, a replay of sequences to learn from.

`act` runs Gumbel MuZero's search (`podracer.muzero.search`) on every
environment's observation and keeps the improved policy it returns;
`learn` appends the rollout to a flashbax trajectory buffer kept in the
state, the same on every device (`podracer.replay`), samples sequences from
it and takes one `make_update` step on this device's share of them. Until
the buffer holds `learning_starts` steps, the state passes through unchanged.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax

from podracer import replay
from podracer.agent import Agent, Rollout, Trajectory
from podracer.errors import PodracerError
from podracer.muzero.config import MuZeroConfig
from podracer.muzero.losses import Sequences
from podracer.muzero.search import make_search
from podracer.muzero.update import MuZeroState, make_update


def sized_network(network, config: MuZeroConfig):
    """`network` (a `MuZeroNetwork`) with the latent and support sizes of `config`."""
    return network.clone(latent_size=config.latent_size, support_size=config.support_size)


def _empty_row(spec) -> Sequences:
    """One (environment, step) row of the buffer, as the environments and the search produce it."""
    obs = jnp.zeros(spec.obs_shape, spec.obs_dtype)
    return Sequences(obs=obs, action=jnp.zeros((), jnp.int32), reward=jnp.zeros((), jnp.float32),
                     terminated=jnp.zeros((), bool), truncated=jnp.zeros((), bool), final_obs=obs,
                     policy=jnp.zeros((spec.action_dim,), jnp.float32))


def make_agent(network, optimizer: optax.GradientTransformation, config: MuZeroConfig, spec: Any,
               rollout_len: int, axis_names: Sequence[str] = (), *, num_envs: int) -> Agent:
    """MuZero on `network` (`podracer.muzero.MuZeroNetwork`) as an `Agent`, over `num_envs` environments in all.

    `num_envs` sizes the replay (one history per environment, over every device).
    """
    if not spec.discrete:
        raise PodracerError("--algo=muzero searches over discrete actions; use a discrete-action environment")
    if spec.action_mask:
        raise PodracerError("--algo=muzero does not read legal-action masks: its search would consider "
                            "illegal actions; use --algo=ppo or impala on this environment")
    axis_names = tuple(axis_names)
    network = sized_network(network, config)
    buffer = replay.make_sequence_buffer(num_envs, config.buffer_size, config.batch_size, config.sequence_len,
                                         config.learning_starts)
    update = make_update(network, optimizer, config, axis_names)
    search = make_search(network, config)

    def init(key):
        params = network.init(key, jnp.zeros((1, *spec.obs_shape), spec.obs_dtype))
        return MuZeroState(params, params, optimizer.init(params), buffer.init(_empty_row(spec)),
                           jnp.zeros((), jnp.int32))

    def act(state, obs, keys, carry):
        out = search(state.params, obs, keys)
        return out.action, carry, out.action_weights

    def prepare(state, trajectory: Trajectory):
        rows = Sequences(trajectory.obs, trajectory.action, trajectory.reward, trajectory.terminated,
                         trajectory.truncated, trajectory.final_obs, trajectory.extras)
        return rows, ()

    def learn(state, rows, bootstrap, key, carry):
        del bootstrap, carry  # values come from the target network, sequences from the replay
        if axis_names:
            problem = replay.share_problem(config.batch_size, jax.lax.axis_size(axis_names))
            if problem:
                raise PodracerError(problem)
        state = state._replace(buffer=buffer.add(state.buffer, replay.gather_sequences(rows, axis_names)))
        sequences = buffer.sample(state.buffer, key).experience
        learned, metrics = update(state, replay.device_share(sequences, axis_names))
        ready = replay.ready(buffer, state.buffer)
        state = jax.tree.map(lambda new, old: jnp.where(ready, new, old), learned, state)
        metrics = {name: jnp.where(ready, value, 0.0) for name, value in metrics.items()}
        metrics["learning"] = ready.astype(jnp.float32)
        return state, metrics

    # mctx's search loops start from constants and carry per-device data, which
    # shard_map's replication check refuses: it runs unchecked (1 and 4 devices tested alike).
    # Acting reads the parameters alone: the replay, the target network and the optimizer stay with learning.
    acting_state = lambda state: state._replace(target_params=(), opt_state=(), buffer=())
    return Agent(init, act, prepare, learn, Rollout(rollout_len), draw=lambda key: key,
                 initial_carry=lambda num_envs: (), acting_state=acting_state,
                 learned_state=lambda state: state._replace(buffer=()), check_vma=False)
