"""PQN's maths: Q(lambda) targets over a rollout, and the epsilon schedule."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp


def q_lambda_targets(
    r_t: jax.Array,
    q_next_t: jax.Array,
    terminated_t: jax.Array,
    truncated_t: jax.Array,
    gamma: float,
    lam: float,
) -> jax.Array:
    """Q(lambda) returns (Peng and Williams 1996; PQN's targets), backwards over time-major [T, B] arrays.

    Row t is the transition (s_t, a_t, r_t); `q_next_t[t]` is max_a Q(s', a) of
    the observation that followed it: the next row's, the one after the rollout
    for the last row, or the episode's final observation where `truncated_t`.
    With done = terminated or truncated,

        G_t = r_t + gamma * (1 - terminated_t) * q_next_t                              if done_t or t = T - 1
        G_t = r_t + gamma * ((1 - lam) * q_next_t + lam * G_{t+1})                    otherwise

    so a termination stops the bootstrap, a truncation bootstraps from its final
    observation, lambda = 0 is one-step Q-learning and lambda = 1 the
    discounted return of the rest of the rollout bootstrapped at its end.
    """
    chex.assert_rank([r_t, q_next_t, terminated_t, truncated_t], 2)
    continues = 1.0 - terminated_t.astype(r_t.dtype)
    done = jnp.logical_or(terminated_t, truncated_t)

    def backward(g_next, row):
        r, q_next, cont, done = row
        blended = jnp.where(done, q_next, (1.0 - lam) * q_next + lam * g_next)
        g = r + gamma * cont * blended
        return g, g

    # The rollout's end bootstraps from the max-Q after it: (1 - lam) q + lam q = q.
    _, targets = jax.lax.scan(backward, q_next_t[-1], (r_t, q_next_t, continues, done), reverse=True,
                              unroll=16)
    return targets


def epsilon_at(update: jax.Array, start: float, finish: float, decay_updates: float) -> jax.Array:
    """Epsilon after `update` updates: linear from `start` to `finish` over `decay_updates`, then `finish`."""
    fraction = jnp.clip(update / jnp.maximum(decay_updates, 1.0), 0.0, 1.0)
    return start + fraction * (finish - start)
