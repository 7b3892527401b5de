"""V-trace (Espeholt et al. 2018) over time-major [T, B] arrays."""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from podracer.ppo.gae import backward_sum


class VTraceOutput(NamedTuple):
    """As rlax names them: `errors` = v_s - V(x_s), the policy-gradient advantages, and their Q estimates."""

    errors: jax.Array
    pg_advantage: jax.Array
    q_estimate: jax.Array


def vtrace_td_error_and_advantage(
    r_t: jax.Array,
    v_t: jax.Array,
    bootstrap_value: jax.Array,
    terminated_t: jax.Array,
    truncated_t: jax.Array,
    final_value_t: jax.Array,
    log_rho_t: jax.Array,
    gamma: float,
    lambda_: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    pg_rho_bar: float = 1.0,
) -> VTraceOutput:
    """V-trace targets and advantages, with termination and truncation handled as GAE does.

    Row t is the transition (x_t, a_t, r_t) taken by the behaviour policy mu,
    with `v_t[t]` = V(x_t) and `log_rho_t[t]` = log pi(a_t|x_t) - log mu(a_t|x_t).
    The value of the state that followed it, V(x_{t+1}), is (as in
    `podracer.ppo.gae_advantages`)

        v_next[t] = final_value_t[t]  if truncated_t[t]   (cut by a time limit)
                    v_t[t + 1]        otherwise (bootstrap_value for t = T - 1)

    With the truncated importance weights

        rho_t = min(rho_bar, pi/mu),   c_t = lambda * min(c_bar, pi/mu),

    the V-trace target v_s (Espeholt et al. 2018, eq. 1) is, backwards in time,

        delta_t   = rho_t * (r_t + gamma * (1 - terminated_t) * v_next[t] - V(x_t))
        v_t - V(x_t) = delta_t + gamma * (1 - done_t) * c_t * (v_{t+1} - V(x_{t+1})),

    done = terminated or truncated, and v_T - V(x_T) = 0: no correction beyond
    the rollout, nor beyond an episode's end. The policy-gradient advantage is

        A_t = min(pg_rho_bar, pi/mu) * (q_t - V(x_t)),
        q_t = r_t + gamma * (1 - terminated_t) * vs_next[t],

    where vs_next[t] is the V-trace target of the next state: v_{t+1} within an
    episode, and v_next[t] (a plain value) after a truncation or the last row.

    On-policy (pi = mu) with rho_bar, c_bar >= 1 and lambda = 1, v_s is the
    n-step return bootstrapped at the end of the rollout (GAE with lambda = 1).

    Args:
      r_t, v_t, terminated_t, truncated_t, final_value_t, log_rho_t: [T, B].
      bootstrap_value: [B], the value of the observation after the last row.

    Returns:
      `VTraceOutput(errors, pg_advantage, q_estimate)`, each [T, B], with the
      V-trace targets v_s = errors + v_t. Nothing is differentiated through:
      the caller stops gradients where it needs to.
    """
    chex.assert_rank([r_t, v_t, terminated_t, truncated_t, final_value_t, log_rho_t], 2)
    chex.assert_rank(bootstrap_value, 1)
    terminated = terminated_t.astype(v_t.dtype)
    truncated = truncated_t.astype(bool)
    not_done = 1.0 - jnp.maximum(terminated, truncated.astype(v_t.dtype))
    ratio = jnp.exp(log_rho_t)
    rho = jnp.minimum(rho_bar, ratio)
    c = lambda_ * jnp.minimum(c_bar, ratio)
    v_next = jnp.concatenate([v_t[1:], bootstrap_value[None]], axis=0)
    v_next = jnp.where(truncated, final_value_t, v_next)
    discount = gamma * (1.0 - terminated)
    delta = rho * (r_t + discount * v_next - v_t)
    continues = gamma * not_done * c

    errors = backward_sum(delta, continues)
    # The next state's target: its correction carries over only within an episode.
    next_errors = jnp.concatenate([errors[1:], jnp.zeros_like(errors[:1])], axis=0)
    vs_next = v_next + not_done * next_errors
    q_estimate = r_t + discount * vs_next
    pg_advantage = jnp.minimum(pg_rho_bar, ratio) * (q_estimate - v_t)
    return VTraceOutput(errors, pg_advantage, q_estimate)
