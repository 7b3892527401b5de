"""PPO's loss on one minibatch of flat samples."""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from podracer.protocol import parallel
from podracer.ppo.config import PPOConfig


class Samples(NamedTuple):
    """Flat [N, ...] training samples, what a minibatch is made of."""

    obs: jax.Array
    action: jax.Array
    log_prob: jax.Array  # behaviour log-probability
    value: jax.Array  # behaviour value
    advantage: jax.Array
    target: jax.Array  # value target (GAE return)


def normalize_advantages(advantage: jax.Array, axis_names: Sequence[str] = ()) -> jax.Array:
    """Standardise with the mean and std of the minibatch across all `axis_names` devices."""
    mean, mean_sq = parallel.pmean((advantage.mean(), (advantage**2).mean()), axis_names)
    std = jnp.sqrt(jnp.maximum(mean_sq - mean**2, 0.0))
    return (advantage - mean) / (std + 1e-8)


def ppo_loss(
    params,
    apply_fn: Callable,
    samples: Samples,
    config: PPOConfig,
    axis_names: Sequence[str] = (),
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped surrogate objective (Schulman et al. 2017), value loss and entropy bonus.

        ratio   = pi(a|s) / mu(a|s)
        L_pi    = -E[min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)]
        L_v     = 0.5 * E[max((v - R)^2, (v_mu + clip(v - v_mu, -eps, eps) - R)^2)]   (clipped)
                  0.5 * E[(v - R)^2]                                                    (unclipped)
        L       = L_pi + vf_coef * L_v - ent_coef * E[entropy]

    `apply_fn(params, obs) -> (distribution, value)`; observations arrive already
    normalised if normalisation is on.
    """
    dist, value = apply_fn(params, samples.obs)
    log_prob = dist.log_prob(samples.action)
    advantage = samples.advantage
    if config.normalize_advantages:
        advantage = normalize_advantages(advantage, axis_names)

    log_ratio = log_prob - samples.log_prob
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1.0 - config.clip_eps, 1.0 + config.clip_eps)
    policy_loss = -jnp.mean(jnp.minimum(ratio * advantage, clipped_ratio * advantage))

    value_error = (value - samples.target) ** 2
    if config.clip_value:
        value_clipped = samples.value + jnp.clip(value - samples.value, -config.clip_eps, config.clip_eps)
        value_error = jnp.maximum(value_error, (value_clipped - samples.target) ** 2)
    value_loss = 0.5 * jnp.mean(value_error)

    entropy = jnp.mean(dist.entropy())
    loss = policy_loss + config.vf_coef * value_loss - config.ent_coef * entropy
    metrics = {
        "loss": loss,
        "policy_loss": policy_loss,
        "value_loss": value_loss,
        "entropy": entropy,
        # (ratio - 1) - log ratio: an unbiased, non-negative KL estimate (Schulman's k3).
        "approx_kl": jnp.mean((ratio - 1.0) - log_ratio),
        "clip_fraction": jnp.mean((jnp.abs(ratio - 1.0) > config.clip_eps).astype(jnp.float32)),
    }
    return loss, metrics
