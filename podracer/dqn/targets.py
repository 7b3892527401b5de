"""DQN's maths as pure functions: n-step transitions cut from a rollout, double-Q targets, the TD loss.

Names follow rlax: `_t` is the row acted on, `_tp1` what bootstraps it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class NStep(NamedTuple):
    """Transitions for the replay buffer: reward_t = sum_{j<k} gamma^j r_{t+j}, bootstrapped by
    discount_t * max_a Q(obs_tp1, a) (discount_t = gamma^k, or 0 after a termination)."""

    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    discount: jax.Array
    next_obs: jax.Array


def _rows_like(mask: jax.Array, x: jax.Array) -> jax.Array:
    """`mask` [T, B] broadcast over the trailing dimensions of `x` [T, B, ...]."""
    return mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))


def nstep_transitions(obs_t, action_t, reward_t, terminated_t, truncated_t, final_obs_t, next_obs,
                      gamma, n: int) -> NStep:
    """Every row of a time-major rollout [T, B, ...] as an n-step transition [T, B, ...].

    Row t sums the rewards of rows t..t+k-1 and bootstraps from the observation
    after row t+k-1, where k <= n stops at the first row that ends an episode
    and at the rollout's end (the rows near it get shorter returns rather than
    none). A termination bootstraps nothing (discount 0); a truncation
    bootstraps from the episode's final observation (`final_obs_t`), not from
    the next episode's first; `next_obs` [B, ...] is the observation after
    the last row.
    """
    num_steps = reward_t.shape[0]
    done = jnp.logical_or(terminated_t, truncated_t)
    after = jnp.concatenate([obs_t[1:], next_obs[None]], axis=0)
    after = jnp.where(_rows_like(done, after), final_obs_t, after)  # the observation that follows row t
    step_discount = gamma * (1.0 - terminated_t.astype(jnp.float32))

    ret = jnp.zeros(reward_t.shape, jnp.float32)
    discount = jnp.ones(reward_t.shape, jnp.float32)
    bootstrap = after
    alive = jnp.ones(reward_t.shape, bool)
    rows = jnp.arange(num_steps)[:, None]
    for j in range(n):
        # Row t of `ahead(x)` is row t + j of x (zeros past the rollout's end, never used).
        ahead = lambda x: jnp.concatenate([x[j:], jnp.zeros_like(x[:j])], axis=0)
        valid = jnp.logical_and(alive, rows + j < num_steps)
        ret = ret + jnp.where(valid, discount * ahead(reward_t.astype(jnp.float32)), 0.0)
        bootstrap = jnp.where(_rows_like(valid, after), ahead(after), bootstrap)
        discount = jnp.where(valid, discount * ahead(step_discount), discount)
        alive = jnp.logical_and(valid, jnp.logical_not(ahead(done)))
    return NStep(obs_t, action_t, ret, discount, bootstrap)


def double_q_targets(reward, discount, q_tp1_target, q_tp1_online=None):
    """reward + discount * Q_target(s', a*): a* = argmax Q_online(s', .) (double Q-learning), or
    argmax Q_target(s', .) (DQN's own max) without `q_tp1_online`. Batches [N], Q-values [N, A]."""
    selector = q_tp1_target if q_tp1_online is None else q_tp1_online
    best = jnp.argmax(selector, axis=-1)
    value = jnp.take_along_axis(q_tp1_target, best[:, None], axis=-1)[:, 0]
    return reward + discount * jax.lax.stop_gradient(value)


def td_loss(q_taken, target, loss: str):
    """Mean TD loss over a batch [N]: Huber with delta 1 (`huber`) or the squared error (`mse`)."""
    error = q_taken - target
    if loss == "huber":
        return jnp.mean(optax.huber_loss(error, delta=1.0))
    return jnp.mean(jnp.square(error))
