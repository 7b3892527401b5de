"""The pure PQN update: Q(lambda) targets of one rollout, then epochs of minibatch regressions onto them."""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from podracer.pqn.config import PQNConfig
from podracer.pqn.targets import q_lambda_targets
from podracer.ppo.update import sgd_step, shuffle_time, time_orders
from podracer.protocol import parallel
from podracer.types import TrainState

QApplyFn = Callable  # (params, obs [N, ...]) -> Q-values [N, num_actions]


class QTransition(NamedTuple):
    """A time-major rollout for PQN: every field is [T, B, ...].

    `q_max` is max_a Q(obs, a) of each row's observation under the parameters
    that acted; `final_q_max` that of the observation that ended the episode at
    row t, read where `truncated` (a time limit: the bootstrap of a cut
    episode) and ignored elsewhere.
    """

    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    q_max: jax.Array
    final_q_max: jax.Array


def next_q_max(batch: QTransition, bootstrap_q: jax.Array) -> jax.Array:
    """[T, B]: max-Q of the observation that followed each row (the next row's, `bootstrap_q` [B] after
    the last, the final observation's where the episode was truncated)."""
    following = jnp.concatenate([batch.q_max[1:], bootstrap_q[None]], axis=0)
    return jnp.where(batch.truncated, batch.final_q_max, following)


def make_update(
    apply_fn: QApplyFn,
    optimizer: optax.GradientTransformation,
    config: PQNConfig,
    axis_names: Sequence[str] = (),
) -> Callable:
    """Build `update(state, batch, bootstrap_q, key) -> (state, metrics)`, pure and jittable.

    Args:
      apply_fn: `(params, obs) -> Q-values` on a batch of observations.
      optimizer: any optax transformation (add gradient clipping to it yourself).
      config: the algorithm's settings.
      axis_names: mesh axes the batch is split over (e.g. `(parallel.DATA_AXIS,)`
        inside `shard_map`). Gradients and metrics are averaged over them with
        `lax.pmean`; leave empty on a single device.

    `state` is a `TrainState` (its `obs_stats` unused), `batch` a `QTransition`
    [T, B, ...] and `bootstrap_q` [B] max-Q of the observation after the last
    row. The Q(lambda) targets (`q_lambda_targets`, rewards times
    `config.reward_scale`) are computed once from the acting parameters; each
    epoch then shuffles every environment's T steps and regresses Q(obs,
    action) onto them in `config.minibatches` minibatches of T / minibatches
    steps of every environment (the same cut on any number of devices). No
    target network: the targets move only between updates.
    """
    axis_names = tuple(axis_names)

    def loss_fn(params, minibatch):
        obs, action, target = minibatch
        q = apply_fn(params, obs.reshape((-1,) + obs.shape[2:]))
        chosen = jnp.take_along_axis(q, action.reshape(-1, 1), axis=-1)[:, 0]
        loss = 0.5 * jnp.mean(jnp.square(chosen - target.reshape(-1)))
        return loss, {"td_loss": loss, "q_mean": jnp.mean(chosen)}

    minibatch_step = sgd_step(loss_fn, optimizer, axis_names)

    def update(state: TrainState, batch: QTransition, bootstrap_q: jax.Array, key: jax.Array):
        num_steps, num_envs = batch.reward.shape
        if num_steps % config.minibatches:
            raise ValueError(f"rollout length {num_steps} does not split into {config.minibatches} minibatches")
        targets = q_lambda_targets(batch.reward * config.reward_scale, next_q_max(batch, bootstrap_q),
                                   batch.terminated, batch.truncated, config.gamma, config.q_lambda)
        data = (batch.obs, batch.action, jax.lax.stop_gradient(targets))
        env_offset = parallel.axis_offset(num_envs, axis_names)

        def epoch(carry, epoch_key):
            shuffled = shuffle_time(data, time_orders(epoch_key, env_offset, num_envs, num_steps))
            minibatches = jax.tree.map(lambda x: x.reshape((config.minibatches, -1) + x.shape[1:]), shuffled)
            return jax.lax.scan(minibatch_step, carry, minibatches)

        (params, opt_state), metrics = jax.lax.scan(
            epoch, (state.params, state.opt_state), jax.random.split(key, config.epochs))
        metrics = parallel.pmean(jax.tree.map(jnp.mean, metrics), axis_names)
        metrics["target_mean"] = parallel.pmean(jnp.mean(targets), axis_names)
        return state._replace(params=params, opt_state=opt_state, step=state.step + 1), metrics

    return update
