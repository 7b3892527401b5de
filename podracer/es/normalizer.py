"""Online observation normalisation for ARS V2 (Mania et al. 2018, sec. 3).

The policy reads `diag(Sigma)^{-1/2} (x - mu)`, with `mu` and `Sigma` the mean and
(diagonal) variance of every state seen so far. Statistics live in a small
`RunningStats` the caller threads through training: rollouts of one generation
use the statistics from before it; the states they visit then update them.

Statistics combine exactly and stably (Chan, Golub & LeVeque 1979): per member,
per device (`reduce_stats`), across devices (`psum_stats`, two `psum`s of
`obs_dim + 1` floats: the only observation-sized communication) and over time
(`merge_stats`).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import chex
import jax.numpy as jnp

from podracer.protocol.parallel import psum

# Mania et al.: a diagonal entry of Sigma below 1e-8 is replaced by +inf, so a
# (so far) constant observation coordinate is normalised to zero.
MIN_VARIANCE = 1e-8


class RunningStats(NamedTuple):
    """Count, mean and sum of squared deviations of observations, per coordinate."""

    count: chex.Array  # float32 scalar
    mean: chex.Array  # [obs_dim] float32
    sum_squared_deviations: chex.Array  # [obs_dim] float32


def init_running_stats(obs_dim: int) -> RunningStats:
    """No observations yet: `normalize` is the identity (mu_0 = 0, Sigma_0 = I)."""
    zeros = jnp.zeros((obs_dim,), jnp.float32)
    return RunningStats(jnp.zeros((), jnp.float32), zeros, zeros)


def observation_stats(obs: chex.Array, mask: chex.Array | None = None) -> RunningStats:
    """Statistics of a batch of observations.

    Args:
      obs: [n, obs_dim] observations (e.g. `[T * B, obs_dim]` from a rollout).
      mask: optional [n] weights in {0, 1}: 0 drops a row (e.g. after `done`).

    Returns:
      `RunningStats` of the kept rows (all zeros when none is kept).
    """
    chex.assert_rank(obs, 2)
    obs = obs.astype(jnp.float32)
    mask = jnp.ones(obs.shape[:1], jnp.float32) if mask is None else mask.astype(jnp.float32)
    chex.assert_shape(mask, obs.shape[:1])
    count = jnp.sum(mask)
    mean = jnp.sum(mask[:, None] * obs, axis=0) / jnp.maximum(count, 1.0)
    deviations = jnp.sum(mask[:, None] * (obs - mean) ** 2, axis=0)
    return RunningStats(count, mean, deviations)


def reduce_stats(stacked: RunningStats) -> RunningStats:
    """Combine `[k]`-stacked statistics (e.g. one per population member) into one.

        n = sum_j n_j,  mu = sum_j n_j mu_j / n,
        M2 = sum_j (M2_j + n_j (mu_j - mu)^2)
    """
    chex.assert_rank(stacked.count, 1)
    count = jnp.sum(stacked.count)
    mean = jnp.sum(stacked.count[:, None] * stacked.mean, axis=0) / jnp.maximum(count, 1.0)
    spread = stacked.count[:, None] * (stacked.mean - mean) ** 2
    deviations = jnp.sum(stacked.sum_squared_deviations + spread, axis=0)
    return RunningStats(count, mean, deviations)


def merge_stats(old: RunningStats, new: RunningStats) -> RunningStats:
    """The online update: statistics of the union of two sets of observations."""
    count = old.count + new.count
    delta = new.mean - old.mean
    new_share = new.count / jnp.maximum(count, 1.0)
    mean = old.mean + delta * new_share
    deviations = (
        old.sum_squared_deviations + new.sum_squared_deviations + delta**2 * old.count * new_share
    )
    return RunningStats(count, mean, deviations)


def psum_stats(stats: RunningStats, axis_names: Sequence[str]) -> RunningStats:
    """`reduce_stats` across devices, inside `shard_map`: same result everywhere.

    Two rounds of `psum` over `obs_dim + 1` and `obs_dim` floats; the identity
    when `axis_names` is empty (single device).
    """
    count, weighted_mean = psum((stats.count, stats.count * stats.mean), axis_names)
    mean = weighted_mean / jnp.maximum(count, 1.0)
    spread = stats.count * (stats.mean - mean) ** 2
    deviations = psum(stats.sum_squared_deviations + spread, axis_names)
    return RunningStats(count, mean, deviations)


def normalize(stats: RunningStats, obs: chex.Array) -> chex.Array:
    """`diag(Sigma)^{-1/2} (x - mu)`, zero where the variance is below `MIN_VARIANCE`.

    Works on one observation `[obs_dim]` or a batch `[..., obs_dim]`. Before any
    observation is recorded it returns `obs` unchanged.
    """
    variance = stats.sum_squared_deviations / jnp.maximum(stats.count, 1.0)
    variance = jnp.where(stats.count > 0, variance, 1.0)
    inverse_std = jnp.where(variance < MIN_VARIANCE, 0.0, 1.0 / jnp.sqrt(variance))
    return (obs - stats.mean) * inverse_std
