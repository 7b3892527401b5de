"""MuZero's loss on replayed sequences: the model unrolled along their actions, three cross-entropies.

For a sequence of rows 0..L-1 the representation reads row 0's observation
and the dynamics are unrolled K = `unroll_steps` times along its actions
(gradients into each unrolled state halved, as MuZero's). At step k the
policy is fitted to the search's improved policy of row k, the value to row
k's n-step target (`targets.n_step_targets`, bootstrapped from the target
network) and, for k >= 1, the reward to row k-1's. Steps past the end of the
episode that row 0 is in are masked out. Steps k >= 1 weigh 1/K each.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from podracer.muzero.config import MuZeroConfig
from podracer.muzero.targets import n_step_targets, scalar_to_support, support_to_scalar


class Sequences(NamedTuple):
    """Replayed rows, batch-major [N, L, ...] (stored in the buffer as [B, T, ...])."""

    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    final_obs: jax.Array  # the observation that ended the episode at this row (a truncation's bootstrap)
    policy: jax.Array  # [N, L, A]: the search's improved policy (mctx's action_weights)


def _cross_entropy(target: jax.Array, logits: jax.Array) -> jax.Array:
    return -jnp.sum(target * jax.nn.log_softmax(logits), axis=-1)


def _scale_gradient(x: jax.Array, scale: float) -> jax.Array:
    return x * scale + jax.lax.stop_gradient(x) * (1.0 - scale)


def value_targets(network, target_params, sequences: Sequences, config: MuZeroConfig) -> jax.Array:
    """[N, K + 1]: the n-step value targets of the first K + 1 rows, from the target network's values."""
    num, length = sequences.reward.shape
    flat = lambda x: x.reshape((num * length,) + x.shape[2:])
    value_of = lambda obs: support_to_scalar(network.apply(target_params, flat(obs), method="initial")[2],
                                             config.support_size).reshape(num, length)
    value, final_value = value_of(sequences.obs), value_of(sequences.final_obs)
    targets = jax.vmap(n_step_targets, in_axes=(0, 0, 0, 0, 0, None, None, None))(
        sequences.reward, sequences.terminated, sequences.truncated, value, final_value, config.gamma,
        config.td_steps, config.unroll_steps + 1)
    return jax.lax.stop_gradient(targets)


def muzero_loss(params, target_params, network, sequences: Sequences, config: MuZeroConfig):
    """(loss, metrics) averaged over the N sequences."""
    steps = config.unroll_steps
    support = config.support_size
    state, policy_logits, value_logits = network.apply(params, sequences.obs[:, 0], method="initial")

    def unroll(state, action):
        state, reward_logits, policy_logits, value_logits = network.apply(params, state, action,
                                                                          method="recurrent")
        return _scale_gradient(state, 0.5), (reward_logits, policy_logits, value_logits)

    _, (reward_logits, unrolled_policy, unrolled_value) = jax.lax.scan(
        unroll, _scale_gradient(state, 1.0), jnp.swapaxes(sequences.action[:, :steps], 0, 1))
    # [N, K + 1, ...]: step 0's predictions, then the unrolled ones.
    batch_major = lambda first, rest: jnp.concatenate([first[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)
    policy_logits = batch_major(policy_logits, unrolled_policy)
    value_logits = batch_major(value_logits, unrolled_value)
    reward_logits = jnp.swapaxes(reward_logits, 0, 1)  # [N, K, ...]: steps 1..K

    done = jnp.logical_or(sequences.terminated, sequences.truncated)[:, :steps].astype(jnp.float32)
    # in_episode[:, k]: no episode ended in rows 0..k-1, so step k is row 0's episode's.
    in_episode = jnp.cumprod(jnp.concatenate([jnp.ones_like(done[:, :1]), 1.0 - done], axis=1), axis=1)
    weights = jnp.concatenate([jnp.ones((1,)), jnp.full((steps,), 1.0 / steps)])

    z = value_targets(network, target_params, sequences, config)
    policy_loss = _cross_entropy(sequences.policy[:, :steps + 1], policy_logits)
    value_loss = _cross_entropy(scalar_to_support(z, support), value_logits)
    # The reward of step k (k >= 1) is row k-1's, seen while row k-1 was still in the episode.
    reward_loss = _cross_entropy(scalar_to_support(sequences.reward[:, :steps], support), reward_logits)

    policy_loss = jnp.mean(jnp.sum(weights * in_episode * policy_loss, axis=1))
    value_loss = jnp.mean(jnp.sum(weights * in_episode * value_loss, axis=1))
    reward_loss = jnp.mean(jnp.sum(weights[1:] * in_episode[:, :-1] * reward_loss, axis=1))
    loss = policy_loss + config.value_coef * value_loss + reward_loss
    metrics = {"loss": loss, "policy_loss": policy_loss, "value_loss": value_loss, "reward_loss": reward_loss,
               "value_target": jnp.mean(z[:, 0])}
    return loss, metrics
