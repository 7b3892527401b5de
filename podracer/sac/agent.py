"""SAC as an agent (`podracer.agent.Agent`): a replay buffer in its state, gradient steps after each rollout."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax

from podracer import replay
from podracer.agent import Agent, Rollout, Trajectory
from podracer.acting import Policy
from podracer.distributions import sampling_noise
from podracer.errors import PodracerError
from podracer.sac.config import SACConfig
from podracer.sac.networks import SACNetworks, action_scale
from podracer.sac.update import SACState, Transitions, init_opt_states, init_params, make_update


def make_act(networks: SACNetworks, deterministic: bool = False):
    """`act(actor_params, obs [B, ...], noise [B, action_dim]) -> (env action, action in (-1, 1))`.

    The squashed sample (or, `deterministic`, the tanh of the mean) scaled from
    (-1, 1) to the environment's bounds [low, high].
    """
    centre, half_width = action_scale(networks)

    def act(actor_params, obs, noise):
        dist = networks.actor.apply(actor_params, obs)
        unit = dist.mode() if deterministic else dist.sample_from_noise(noise)
        return centre + half_width * unit, unit

    return act


def next_observations(rollout: Trajectory) -> jax.Array:
    """[T, B, ...]: the observation after each row, the last of its episode where one ended there."""
    following = jnp.concatenate([rollout.obs[1:], rollout.next_obs[None]], axis=0)
    done = jnp.logical_or(rollout.terminated, rollout.truncated)
    done = done.reshape(done.shape + (1,) * (following.ndim - done.ndim))
    return jnp.where(done, rollout.final_obs, following)


def make_agent(networks: SACNetworks, optimizer: optax.GradientTransformation, config: SACConfig, spec: Any,
               rollout_len: int, axis_names: Sequence[str] = (), *, num_envs: int | None = None) -> Agent:
    """SAC on `networks` (`podracer.sac.make_networks`) for `spec`'s continuous actions, as an `Agent`.

    Acting samples the squashed policy from noise drawn ahead of the rollout;
    `prepare` turns the rollout into transitions; `learn` adds every device's
    transitions to the replicated buffer (`podracer.replay`) and, once it holds
    `config.learning_starts` of them (and a batch), takes
    `config.updates_per_rollout` gradient steps (`make_update`), each on its
    own uniform sample of `config.batch_size` (all drawn at once).
    """
    axis_names = tuple(axis_names)
    buffer = replay.make_buffer(config.buffer_size, config.batch_size, config.learning_starts,
                                config.updates_per_rollout)
    update = make_update(networks, optimizer, config, spec.action_dim, axis_names)
    act_fn = make_act(networks)

    def init(key):
        params = init_params(networks, spec.obs_shape, spec.obs_dtype, spec.action_dim, key, config.init_alpha)
        item = Transitions(jnp.zeros(spec.obs_shape, spec.obs_dtype), jnp.zeros(spec.action_dim, jnp.float32),
                           jnp.zeros((), jnp.float32), jnp.zeros((), bool), jnp.zeros(spec.obs_shape, spec.obs_dtype))
        return SACState(params, init_opt_states(params, optimizer), buffer.init(item), jnp.zeros((), jnp.int32))

    def draw(key):
        return sampling_noise(key, False, spec.action_dim)

    def act(state, obs, noise, carry):
        action, unit = act_fn(state.params.actor, obs, noise)
        return action, carry, unit  # the buffer keeps the action the critics see, in (-1, 1)

    def prepare(state, rollout: Trajectory):
        del state
        return Transitions(rollout.obs, rollout.extras, rollout.reward, rollout.terminated,
                           next_observations(rollout)), ()

    def learn(state, batch, bootstrap, key, carry):
        del bootstrap, carry
        problem = replay.share_problem(config.batch_size, jax.lax.psum(1, axis_names) if axis_names else 1)
        if problem:  # found while tracing, before anything compiles
            raise PodracerError(problem)
        buffer_state = buffer.add(state.buffer, replay.gather_rollout(batch, axis_names))

        def train(state):
            # Every step's minibatch drawn at once (the buffer does not change between the steps).
            sample_key, update_key = jax.random.split(key)
            drawn = buffer.sample(buffer_state, sample_key).experience
            minibatches = jax.tree.map(
                lambda x: x.reshape((config.updates_per_rollout, config.batch_size) + x.shape[1:]), drawn)
            step = lambda state, xs: update(state, *xs)
            steps = (minibatches, jax.random.split(update_key, config.updates_per_rollout))
            state, metrics = jax.lax.scan(step, state, steps)
            return state, jax.tree.map(jnp.mean, metrics)

        def wait(state):  # the buffer does not hold enough yet: the same metrics' shapes, zeros
            shapes = jax.eval_shape(train, state)[1]
            return state, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        learner = state._replace(buffer=())  # the scan carries what it changes, not the buffer
        learner, metrics = jax.lax.cond(replay.ready(buffer, buffer_state), train, wait, learner)
        return learner._replace(buffer=buffer_state), metrics

    # The NaN guard reads what learning computes, not the buffer of what the environments answered.
    return Agent(init, act, prepare, learn, Rollout(rollout_len), draw, lambda num_envs: (),
                 learned_state=lambda state: state._replace(buffer=()))


def policy(state: SACState, networks: SACNetworks, config: SACConfig, deterministic: bool) -> Policy:
    """A trained state's policy for recording: `act_fn(state, obs, keys) -> (env action, log-probability)`.

    The log-probability is the stochastic policy's, of the action in (-1, 1),
    also when `deterministic` acts with the tanh of the mean.
    """
    del config
    act = make_act(networks, deterministic)

    def act_fn(state, obs, keys):
        noise = jax.vmap(lambda k: sampling_noise(k, False, len(networks.action_low)))(keys)
        action, unit = act(state.params.actor, obs, noise)
        return action, networks.actor.apply(state.params.actor, obs).log_prob(unit)

    return Policy(act_fn, state, "sac", deterministic)


def load_policy(networks: SACNetworks, config: SACConfig, saved: dict, deterministic: bool):
    """`act(obs [B, ...], key) -> env actions` from a checkpoint's agent state (nested dicts of arrays)."""
    del config
    actor = jax.tree.map(jnp.asarray, saved["params"]["actor"])
    act_batch = make_act(networks, deterministic)

    def act(obs: jax.Array, key: jax.Array) -> jax.Array:
        noise = jax.random.normal(key, (obs.shape[0], len(networks.action_low)))
        return act_batch(actor, obs, noise)[0]

    return act
