"""Generalised Advantage Estimation over time-major [T, B] arrays."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp


def gae_advantages(
    r_t: jax.Array,
    v_t: jax.Array,
    bootstrap_value: jax.Array,
    terminated_t: jax.Array,
    truncated_t: jax.Array,
    final_value_t: jax.Array,
    gamma: float,
    lam: float,
) -> tuple[jax.Array, jax.Array]:
    """GAE(gamma, lambda) (Schulman et al. 2016), with termination and truncation apart.

    Row t is the transition (s_t, a_t, r_t) whose value is `v_t[t]`. The value of
    the state that followed it is

        v_next[t] = final_value_t[t]  if truncated_t[t]  (episode cut by a time limit:
                                                          bootstrap from its final obs)
                    v_t[t + 1]        otherwise (bootstrap_value for t = T - 1)

    and
        delta_t = r_t + gamma * (1 - terminated_t) * v_next[t] - v_t
        A_t     = delta_t + gamma * lam * (1 - done_t) * A_{t+1},  done = terminated or truncated.

    Args:
      r_t, v_t, terminated_t, truncated_t, final_value_t: [T, B].
      bootstrap_value: [B], the value of the observation after the last row.

    Returns:
      (advantages, returns) each [T, B], with returns = advantages + v_t.
    """
    chex.assert_rank([r_t, v_t, terminated_t, truncated_t, final_value_t], 2)
    chex.assert_rank(bootstrap_value, 1)
    terminated = terminated_t.astype(v_t.dtype)
    truncated = truncated_t.astype(bool)
    v_next = jnp.concatenate([v_t[1:], bootstrap_value[None]], axis=0)
    v_next = jnp.where(truncated, final_value_t, v_next)
    delta = r_t + gamma * (1.0 - terminated) * v_next - v_t
    continues = gamma * lam * (1.0 - jnp.maximum(terminated, truncated.astype(v_t.dtype)))

    advantages = backward_sum(delta, continues)
    return advantages, advantages + v_t


def backward_sum(delta: jax.Array, continues: jax.Array) -> jax.Array:
    """`x[t] = delta[t] + continues[t] * x[t + 1]` over time-major [T, B] arrays, `x[T] = 0`:
    GAE's advantages, V-trace's corrections."""

    def backward(carry, xs):
        delta, continues = xs
        x = delta + continues * carry
        return x, x

    # Unrolled: each step is a handful of tiny ops, so loop overhead would dominate.
    _, xs = jax.lax.scan(backward, jnp.zeros_like(delta[0]), (delta, continues), reverse=True,
                         unroll=16)
    return xs
