"""DQN's update as a pure function: add transitions to the replay buffer, then learn from minibatches of it.

    from podracer import dqn
    update = jax.jit(dqn.make_update(q_fn, optax.adam(1e-3), dqn.DQNConfig()))
    state, metrics = update(state, transitions, key)  # transitions: a dqn.NStep of [N, ...] items

With `axis_names` (inside `shard_map`) every device must be given the same
transitions (`podracer.replay.gather_rollout`): the buffer stays replicated,
each minibatch is drawn with the replicated key, every device takes the
gradient of its share of it and the gradients are averaged, so any device
count trains the same network.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from podracer import replay
from podracer.dqn.config import DQNConfig
from podracer.dqn.targets import NStep, double_q_targets, td_loss
from podracer.errors import PodracerError
from podracer.protocol import parallel

QFn = Callable[[Any, jax.Array], jax.Array]  # q_fn(params, obs [N, ...]) -> Q-values [N, A]


class DQNState(NamedTuple):
    """Everything DQN learns and keeps: a pytree of arrays, checkpointed whole (the buffer too)."""

    params: Any
    target_params: Any
    opt_state: Any
    buffer: Any  # flashbax's buffer state of `NStep` items
    step: jax.Array  # updates: batches of transitions added (int32); epsilon decays with it
    gradient_steps: jax.Array  # int32; the target network follows every `target_update_period` of them


def make_replay(config: DQNConfig):
    """The flashbax item buffer `config` asks for."""
    return replay.make_buffer(config.buffer_size, config.batch_size, config.learning_starts)


def init_state(params, optimizer: optax.GradientTransformation, config: DQNConfig, example: NStep) -> DQNState:
    """A fresh state for `params`: the target network a copy of them, an empty buffer of items like `example`
    (one transition, no batch axis)."""
    zero = jnp.zeros((), jnp.int32)
    return DQNState(params, jax.tree.map(jnp.array, params), optimizer.init(params),
                    make_replay(config).init(example), zero, zero)


def epsilon(config: DQNConfig, step: jax.Array) -> jax.Array:
    """Epsilon-greedy's exploration rate after `step` updates: linear from start to end over `epsilon_decay`."""
    progress = jnp.clip(step.astype(jnp.float32) / config.epsilon_decay, 0.0, 1.0)
    return config.epsilon_start + (config.epsilon_end - config.epsilon_start) * progress


def target_update(params, target_params, gradient_steps: jax.Array, config: DQNConfig):
    """The target network after gradient step `gradient_steps`: every `target_update_period` steps
    target <- tau * params + (1 - tau) * target (a copy when tau is 1), unchanged in between."""
    refresh = gradient_steps % config.target_update_period == 0
    return jax.tree.map(lambda p, t: jnp.where(refresh, config.tau * p + (1.0 - config.tau) * t, t),
                        params, target_params)


def make_loss(q_fn: QFn, config: DQNConfig) -> Callable:
    """`loss(params, target_params, batch: NStep) -> (loss, mean Q of the actions taken)`."""

    def loss(params, target_params, batch: NStep):
        q_t = q_fn(params, batch.obs)
        q_taken = jnp.take_along_axis(q_t, batch.action.astype(jnp.int32)[:, None], axis=-1)[:, 0]
        q_tp1_online = jax.lax.stop_gradient(q_fn(params, batch.next_obs)) if config.double_q else None
        target = double_q_targets(batch.reward, batch.discount, q_fn(target_params, batch.next_obs), q_tp1_online)
        return td_loss(q_taken, target, config.loss), jnp.mean(q_taken)

    return loss


def make_update(q_fn: QFn, optimizer: optax.GradientTransformation, config: DQNConfig,
                axis_names: Sequence[str] = ()) -> Callable:
    """`update(state, transitions, key) -> (state, metrics)`: add `transitions` (an `NStep` of [N, ...]),
    then take `updates_per_rollout` gradient steps if the buffer is ready (none before)."""
    axes = tuple(axis_names)
    buffer = make_replay(config)
    grad_fn = jax.value_and_grad(make_loss(q_fn, config), has_aux=True)
    mean = lambda tree: jax.lax.pmean(tree, axes) if axes else tree

    def gradient_step(state: DQNState, key):
        if axes:  # known while tracing: the mesh's size
            problem = replay.share_problem(config.batch_size, jax.lax.psum(1, axes))
            if problem:
                raise PodracerError(problem)
        batch = replay.device_share(buffer.sample(state.buffer, key).experience, axes)
        # Each device's gradient its own (`parallel.vary`), averaged explicitly below.
        (loss, q_mean), grads = grad_fn(parallel.vary(state.params, axes), state.target_params, batch)
        grads, loss, q_mean = mean((grads, loss, q_mean))
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        gradient_steps = state.gradient_steps + 1
        target_params = target_update(params, state.target_params, gradient_steps, config)
        state = state._replace(params=params, target_params=target_params, opt_state=opt_state,
                               gradient_steps=gradient_steps)
        return state, (loss, q_mean)

    def learn(state: DQNState, key):
        state, (loss, q_mean) = jax.lax.scan(gradient_step, state,
                                             jax.random.split(key, config.updates_per_rollout))
        return state, (jnp.mean(loss), jnp.mean(q_mean))

    def wait(state: DQNState, key):
        return state, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))

    def update(state: DQNState, transitions: NStep, key: jax.Array):
        state = state._replace(buffer=buffer.add(state.buffer, transitions))
        ready = replay.ready(buffer, state.buffer)
        state, (loss, q_mean) = jax.lax.cond(ready, learn, wait, state, key)
        metrics = {"loss": loss, "q_mean": q_mean, "learning": ready.astype(jnp.float32),
                   "epsilon": epsilon(config, state.step)}
        return state._replace(step=state.step + 1), metrics

    return update
