"""SAC's targets and losses (Haarnoja et al. 2018, "Soft Actor-Critic Algorithms and Applications") on flat [N] batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def target_entropy(action_dim: int, per_dim: float = -1.0) -> float:
    """The entropy the temperature aims at: `per_dim` per action dimension (SAC's default: -action_dim)."""
    return per_dim * action_dim


def critic_target(r_t: jax.Array, terminated_t: jax.Array, next_q: jax.Array, next_log_prob: jax.Array,
                  alpha: jax.Array, gamma: float) -> jax.Array:
    """The soft Bellman target of each transition, [N]:

        y = r + gamma (1 - terminated) (min_i Q'_i(s', a') - alpha log pi(a'|s')),   a' ~ pi(.|s')

    `next_q` [2, N] are the target critics' values of (s', a'). A truncated
    episode (a time limit) is not terminated: s' is its last observation and
    the target bootstraps from it. No gradient flows through the target.
    """
    soft_value = jnp.min(next_q, axis=0) - alpha * next_log_prob
    target = r_t + gamma * (1.0 - terminated_t.astype(r_t.dtype)) * soft_value
    return jax.lax.stop_gradient(target)


def critic_loss(q: jax.Array, target: jax.Array) -> jax.Array:
    """Both critics' squared errors [2, N] against one target [N]: 0.5 sum_i E[(Q_i(s, a) - y)^2]."""
    return 0.5 * jnp.sum(jnp.mean((q - target[None]) ** 2, axis=1))


def actor_loss(log_prob: jax.Array, q: jax.Array, alpha: jax.Array) -> jax.Array:
    """E[alpha log pi(a|s) - min_i Q_i(s, a)] for a ~ pi(.|s) reparameterised; alpha is held fixed."""
    return jnp.mean(jax.lax.stop_gradient(alpha) * log_prob - jnp.min(q, axis=0))


def temperature_loss(log_alpha: jax.Array, log_prob: jax.Array, entropy_target: float) -> jax.Array:
    """J(alpha) = E[-alpha (log pi(a|s) + target entropy)], with alpha = exp(log_alpha) and the policy held fixed.

    Its gradient raises alpha while the policy's entropy (-log pi) is below the
    target and lowers it while above.
    """
    return -jnp.mean(jnp.exp(log_alpha) * jax.lax.stop_gradient(log_prob + entropy_target))
