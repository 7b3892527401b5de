"""The pure IMPALA update step: the same signature and axis names as `podracer.ppo.make_update`."""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from podracer.normalize import update_stats
from podracer.ppo.update import policy_inputs, random_permutation, sgd_step
from podracer.protocol import parallel
from podracer.types import TrainState, Transition
from podracer.vtrace.config import ImpalaConfig
from podracer.vtrace.losses import Sequences, impala_loss

ApplyFn = Callable  # (params, obs) -> (distribution, value)


def make_update(
    apply_fn: ApplyFn,
    optimizer: optax.GradientTransformation,
    config: ImpalaConfig,
    axis_names: Sequence[str] = (),
) -> Callable:
    """Build `update(state, batch, bootstrap_value, key) -> (state, metrics)`.

    Args:
      apply_fn: `(params, obs) -> (distribution, value)` on a batch of observations.
      optimizer: any optax transformation (add gradient clipping to it yourself).
      config: the algorithm's settings.
      axis_names: mesh axes the batch is split over (e.g. `(parallel.DATA_AXIS,)`
        inside `shard_map`). Gradients, advantage statistics and metrics are
        averaged over them with `lax.pmean`; leave empty on a single device.

    The returned function is pure and jittable, and is called exactly as
    `podracer.ppo.make_update`'s: `batch` is a time-major `Transition`
    [T, B, ...] whose `log_prob` is the behaviour policy's, `bootstrap_value`
    [B] the behaviour value of the observation after the last row. V-trace
    needs whole columns, so each epoch shuffles this device's environments and
    cuts them into `config.minibatches` minibatches of B / minibatches columns
    (the order depends on the device's offset in the batch). After the epochs
    the observation statistics absorb the batch.
    """
    axis_names = tuple(axis_names)

    def loss_fn(params, seqs):
        return impala_loss(params, apply_fn, seqs, config, axis_names)

    minibatch_step = sgd_step(loss_fn, optimizer, axis_names)

    def update(state: TrainState, batch: Transition, bootstrap_value: jax.Array, key: jax.Array):
        num_steps, num_envs = batch.reward.shape
        problem = config.batch_problem(num_steps, num_envs)
        if problem:
            raise ValueError(problem)
        data = Sequences(policy_inputs(batch.obs, state.obs_stats, config), batch.action, batch.reward,
                         batch.terminated, batch.truncated, batch.log_prob, batch.final_value,
                         bootstrap_value)
        key = jax.random.fold_in(key, parallel.axis_offset(num_envs, axis_names))
        per_minibatch = num_envs // config.minibatches

        def minibatches_of(epoch_key):
            if config.minibatches == 1:  # one minibatch: the whole batch, in order
                return jax.tree.map(lambda x: x[None], data)
            order = random_permutation(epoch_key, num_envs)

            def cut(x):
                if x.ndim == 1:  # bootstrap_value [B] -> [minibatches, B / minibatches]
                    return x[order].reshape(config.minibatches, per_minibatch)
                x = x[:, order].reshape((num_steps, config.minibatches, per_minibatch) + x.shape[2:])
                return jnp.moveaxis(x, 1, 0)  # [minibatches, T, B / minibatches, ...]

            return jax.tree.map(cut, data)

        def epoch(carry, epoch_key):
            return jax.lax.scan(minibatch_step, carry, minibatches_of(epoch_key))

        (params, opt_state), metrics = jax.lax.scan(
            epoch, (state.params, state.opt_state), jax.random.split(key, config.epochs))
        obs_stats = state.obs_stats
        if config.normalize_observations:
            obs_stats = update_stats(obs_stats, batch.obs, axis_names)
        metrics = jax.tree.map(jnp.mean, metrics)
        metrics = parallel.pmean(metrics, axis_names)
        return TrainState(params, opt_state, obs_stats, state.step + 1), metrics

    return update
