"""The pure PPO update step, and the acting function that goes with it."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from podracer.protocol import parallel
from podracer.normalize import RunningStats, init_running_stats, standardize, update_stats
from podracer.ppo.config import PPOConfig
from podracer.ppo.gae import gae_advantages
from podracer.ppo.losses import Samples, ppo_loss
from podracer.types import Params, TrainState, Transition

ApplyFn = Callable  # (params, obs) -> (distribution, value)


def init_train_state(params: Params, optimizer: optax.GradientTransformation,
                     obs_shape: Sequence[int]) -> TrainState:
    """A fresh train state for `params`."""
    return TrainState(params=params, opt_state=optimizer.init(params),
                      obs_stats=init_running_stats(obs_shape), step=jnp.zeros((), jnp.int32))


def policy_inputs(obs: jax.Array, obs_stats: RunningStats, config: PPOConfig) -> jax.Array:
    """What the network sees: raw observations, or standardised ones."""
    return standardize(obs_stats, obs) if config.normalize_observations else obs


def make_act(apply_fn: ApplyFn, config: PPOConfig, deterministic: bool = False,
             presampled: bool = False, recurrent: bool = False) -> Callable:
    """`act(params, obs_stats, obs, randomness) -> (action, log_prob, value)` for a batch.

    `randomness` holds one PRNG key per observation ([B, 2]), so an environment's
    action depends on its own key only, not on how the batch is split over
    devices. With `presampled`, it is instead the sampling noise drawn ahead from
    those keys ([B, action_dim], `distributions.sampling_noise`): the same actions.

    With `recurrent` (`apply_fn` a `networks.RecurrentActorCritic`'s), it is
    `act(params, obs_stats, obs, randomness, carry, reset) -> (action, log_prob,
    value, carry)`: one step of the sequence, the carry zeroed first where
    `reset` ([B] bool: an episode starts at `obs`).
    """

    def pick(dist, randomness):
        if deterministic:
            return dist.mode()
        if presampled:
            return dist.sample_from_noise(randomness)
        return jax.vmap(lambda d, k: d.sample(k))(dist, randomness)

    def act(params, obs_stats, obs, randomness):
        dist, value = apply_fn(params, policy_inputs(obs, obs_stats, config))
        action = pick(dist, randomness)
        return action, dist.log_prob(action), value

    def act_recurrent(params, obs_stats, obs, randomness, carry, reset):
        (dist, value), carry = apply_fn(params, policy_inputs(obs, obs_stats, config)[None], carry,
                                        reset[None])
        dist, value = jax.tree.map(lambda x: x[0], (dist, value))
        action = pick(dist, randomness)
        return action, dist.log_prob(action), value, carry

    return act_recurrent if recurrent else act


def episode_starts(batch: Transition) -> jax.Array:
    """[T, B]: True where row t starts an episode within the batch (row t - 1 ended one).

    Row 0 is False: the carry stored for a trajectory is the one its first row
    was acted on with, already reset if an episode started there.
    """
    done = jnp.logical_or(batch.terminated, batch.truncated)
    return jnp.concatenate([jnp.zeros_like(done[:1]), done[:-1]], axis=0)


def random_permutation(key: jax.Array, n: int) -> jax.Array:
    """A uniformly random permutation of `range(n)`, like `jax.random.permutation`.

    The same method (sort by random words, rounds enough that ties are unlikely),
    with each index packed into the low bits of its random word: one sort of
    one uint32 operand, which XLA:CPU runs about 6x faster than the key-value
    sort `jax.random.permutation` lowers to. Rounds are counted by the random
    bits that are left, as jax does for its 32.
    """
    index_bits = max(1, (n - 1).bit_length())
    random_bits = 32 - index_bits
    if random_bits < 8:
        return jax.random.permutation(key, n)
    rounds = math.ceil(3 * math.log(max(n, 2)) / (random_bits * math.log(2)))
    mask = np.uint32((1 << index_bits) - 1)
    order = jnp.arange(n, dtype=jnp.uint32)
    for round_key in ([key] if rounds == 1 else jax.random.split(key, rounds)):
        words = jax.random.bits(round_key, (n,), jnp.uint32)
        order = jnp.sort((words & ~mask) | order) & mask
    return order.astype(jnp.int32)


def time_orders(key: jax.Array, env_offset, num_envs: int, num_steps: int) -> jax.Array:
    """One random order of the T steps for every environment column: [T, B].

    The key of column b is derived from its *global* index, so a batch split over
    any number of devices is shuffled exactly as it would be on one device.
    """
    env_index = env_offset + jnp.arange(num_envs)
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(env_index)
    return jax.vmap(lambda k: random_permutation(k, num_steps))(keys).T


def shuffle_time(tree, order: jax.Array):
    """Reorder each environment column's T rows by its column of `order` [T, B]."""

    def take(x):
        index = order.reshape(order.shape + (1,) * (x.ndim - 2))
        return jnp.take_along_axis(x, index, axis=0)

    return jax.tree.map(take, tree)


def _env_orders(key: jax.Array, env_offset, num_envs: int, minibatches: int) -> jax.Array:
    """The environment columns of each minibatch: [minibatches, B / minibatches] local indices.

    Columns are dealt out in blocks of `minibatches` consecutive global indices:
    each block is shuffled by a key derived from its global index and its j-th
    column goes to minibatch j. So every minibatch holds one column of every
    block, and a batch split over any number of devices (each holding whole
    blocks) is cut into the same minibatches as on one device.
    """
    blocks = num_envs // minibatches
    block_index = env_offset // minibatches + jnp.arange(blocks)
    perms = jax.vmap(lambda i: random_permutation(jax.random.fold_in(key, i), minibatches))(block_index)
    return (perms + minibatches * jnp.arange(blocks)[:, None]).T


def sgd_step(loss_fn: Callable, optimizer: optax.GradientTransformation,
             axis_names: Sequence[str]) -> Callable:
    """`step((params, opt_state), minibatch) -> ((params, opt_state), metrics)` for `lax.scan`.

    `loss_fn(params, minibatch) -> (loss, metrics)`; the gradients are averaged over
    `axis_names` (the devices the batch is split over) before the optimizer's step.
    """
    grad_fn = jax.grad(loss_fn, has_aux=True)

    def step(carry, minibatch):
        params, opt_state = carry
        grads, metrics = grad_fn(parallel.vary(params, axis_names), minibatch)
        grads = parallel.pmean(grads, axis_names)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), metrics

    return step


def make_update(
    apply_fn: ApplyFn,
    optimizer: optax.GradientTransformation,
    config: PPOConfig,
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

    The returned function is pure and jittable. `batch` is a time-major
    `Transition` [T, B, ...]; `bootstrap_value` [B] is the behaviour value of the
    observation after the last row. Each epoch shuffles every environment's T
    steps and cuts them into `config.minibatches` minibatches of T / minibatches
    steps of every environment. After the epochs the observation statistics
    absorb the batch, so acting and learning always see the same normalisation.

    A recurrent network (`networks.RecurrentActorCritic`) passes `carry`, its
    state before each environment's first row ([B, ...] leaves):
    `update(state, batch, bootstrap_value, key, carry)`. Minibatches then keep
    whole environment sequences (each epoch shuffles environments, not steps,
    `_env_orders`: B must divide by `config.minibatches`), and the loss replays
    each sequence in order from its stored carry, zeroing it after every row
    that ended an episode (`episode_starts`), as the actors did.
    """
    axis_names = tuple(axis_names)

    def loss_fn(params, samples):
        return ppo_loss(params, apply_fn, samples, config, axis_names)

    minibatch_step = sgd_step(loss_fn, optimizer, axis_names)

    def recurrent_loss_fn(params, sequences):
        samples, carry, reset = sequences
        replay = lambda p, obs: apply_fn(p, obs, carry, reset)[0]
        return ppo_loss(params, replay, samples, config, axis_names)

    sequence_step = sgd_step(recurrent_loss_fn, optimizer, axis_names)

    def recurrent_epochs(state, data, batch, initial_carry, key):
        num_steps, num_envs = batch.reward.shape
        if num_envs % config.minibatches:
            raise ValueError(f"{num_envs} environments do not split into {config.minibatches} minibatches")
        env_offset = parallel.axis_offset(num_envs, axis_names)
        sequences = (data, initial_carry, episode_starts(batch))

        def epoch(carry, epoch_key):
            order = _env_orders(epoch_key, env_offset, num_envs, config.minibatches)  # [M, B / M]
            time_major = lambda x: jnp.moveaxis(x[:, order], 1, 0)  # [T, B] -> [M, T, B / M]
            minibatches = (jax.tree.map(time_major, sequences[0]), jax.tree.map(lambda x: x[order], sequences[1]),
                           time_major(sequences[2]))
            return jax.lax.scan(sequence_step, carry, minibatches, unroll=config.unroll_minibatches)

        return jax.lax.scan(epoch, (state.params, state.opt_state), jax.random.split(key, config.epochs),
                            unroll=config.unroll_minibatches)

    def update(state: TrainState, batch: Transition, bootstrap_value: jax.Array, key: jax.Array,
               carry=None):
        num_steps, num_envs = batch.reward.shape
        if carry is not None:
            return recurrent_update(state, batch, bootstrap_value, key, carry)
        if num_steps % config.minibatches:
            raise ValueError(f"rollout length {num_steps} does not split into {config.minibatches} minibatches")
        advantage, target = gae_advantages(
            batch.reward, batch.value, bootstrap_value, batch.terminated, batch.truncated,
            batch.final_value, config.gamma, config.gae_lambda)
        data = Samples(policy_inputs(batch.obs, state.obs_stats, config), batch.action,
                       batch.log_prob, batch.value, advantage, target)
        env_offset = parallel.axis_offset(num_envs, axis_names)

        def epoch(carry, epoch_key):
            order = time_orders(epoch_key, env_offset, num_envs, num_steps)
            shuffled = shuffle_time(data, order)
            minibatches = jax.tree.map(
                lambda x: x.reshape((config.minibatches, -1) + x.shape[2:]), shuffled)
            return jax.lax.scan(minibatch_step, carry, minibatches,
                                unroll=config.unroll_minibatches)

        # Each epoch draws its own orders inside the loop: drawn for all epochs ahead,
        # the whole update ran ~8% slower on XLA:CPU (measured).
        epoch_keys = jax.random.split(key, config.epochs)
        (params, opt_state), metrics = jax.lax.scan(
            epoch, (state.params, state.opt_state), epoch_keys, unroll=config.unroll_minibatches)
        return finish(state, batch, params, opt_state, metrics)

    def recurrent_update(state, batch, bootstrap_value, key, initial_carry):
        advantage, target = gae_advantages(
            batch.reward, batch.value, bootstrap_value, batch.terminated, batch.truncated,
            batch.final_value, config.gamma, config.gae_lambda)
        data = Samples(policy_inputs(batch.obs, state.obs_stats, config), batch.action,
                       batch.log_prob, batch.value, advantage, target)
        (params, opt_state), metrics = recurrent_epochs(state, data, batch, initial_carry, key)
        return finish(state, batch, params, opt_state, metrics)

    def finish(state, batch, params, opt_state, metrics):
        obs_stats = state.obs_stats
        if config.normalize_observations:
            obs_stats = update_stats(obs_stats, batch.obs, axis_names)
        metrics = jax.tree.map(jnp.mean, metrics)
        metrics = parallel.pmean(metrics, axis_names)
        new_state = TrainState(params, opt_state, obs_stats, state.step + 1)
        return new_state, metrics

    return update
