"""IMPALA's loss on one minibatch of whole environment columns."""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from podracer.ppo.losses import normalize_advantages
from podracer.vtrace.config import ImpalaConfig
from podracer.vtrace.vtrace import vtrace_td_error_and_advantage


class Sequences(NamedTuple):
    """Time-major [T, N, ...] columns, what an IMPALA minibatch is made of."""

    obs: jax.Array  # what the network sees (normalised if normalisation is on)
    action: jax.Array
    reward: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    log_prob: jax.Array  # behaviour log-probability
    final_value: jax.Array  # behaviour value of a truncated episode's final observation
    bootstrap_value: jax.Array  # [N], behaviour value of the observation after the last row


def impala_loss(
    params,
    apply_fn: Callable,
    seqs: Sequences,
    config: ImpalaConfig,
    axis_names: Sequence[str] = (),
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """V-trace actor-critic loss (Espeholt et al. 2018, section 4.2).

        rho_t   = pi(a_t|x_t) / mu(a_t|x_t)          (1 with importance_weights off)
        v_s, A_s = V-trace targets and advantages of (r, V, rho)   (`vtrace_td_error_and_advantage`)
        L_pi    = -E[A_s * log pi(a_s|x_s)]
        L_v     = 0.5 * E[(V(x_s) - v_s)^2]
        L       = L_pi + vf_coef * L_v - ent_coef * E[entropy]

    V and pi are the learner's current network; targets and advantages are
    constants (no gradient flows through them). The values after a truncation
    and after the last row are the behaviour's (`final_value`,
    `bootstrap_value`): their observations are not in the batch.
    """
    num_steps, num_envs = seqs.reward.shape
    flat_obs = seqs.obs.reshape((num_steps * num_envs,) + seqs.obs.shape[2:])
    flat_action = seqs.action.reshape((num_steps * num_envs,) + seqs.action.shape[2:])
    dist, value = apply_fn(params, flat_obs)
    log_prob = dist.log_prob(flat_action).reshape(num_steps, num_envs)
    value = value.reshape(num_steps, num_envs)

    log_rho = jax.lax.stop_gradient(log_prob) - seqs.log_prob
    used_log_rho = log_rho if config.importance_weights else jnp.zeros_like(log_rho)
    out = vtrace_td_error_and_advantage(
        seqs.reward, jax.lax.stop_gradient(value), seqs.bootstrap_value, seqs.terminated,
        seqs.truncated, seqs.final_value, used_log_rho, config.gamma, config.vtrace_lambda,
        config.rho_bar, config.c_bar, config.pg_rho_bar)
    advantage = out.pg_advantage
    if config.normalize_advantages:
        advantage = normalize_advantages(advantage, axis_names)
    policy_loss = -jnp.mean(jax.lax.stop_gradient(advantage) * log_prob)
    target = jax.lax.stop_gradient(value) + out.errors
    value_loss = 0.5 * jnp.mean((value - target) ** 2)
    entropy = jnp.mean(dist.entropy())
    loss = policy_loss + config.vf_coef * value_loss - config.ent_coef * entropy
    ratio = jnp.exp(log_rho)
    metrics = {
        "loss": loss,
        "policy_loss": policy_loss,
        "value_loss": value_loss,
        "entropy": entropy,
        # (ratio - 1) - log ratio: an unbiased, non-negative KL estimate (Schulman's k3).
        "approx_kl": jnp.mean((ratio - 1.0) - log_rho),
        # How far the actors' policies lag: the share of weights the truncation cuts.
        "rho_clipped_fraction": jnp.mean((ratio > config.rho_bar).astype(jnp.float32)),
    }
    return loss, metrics
