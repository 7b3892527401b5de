"""Running observation statistics, and the two ways PPO and ARS normalise with them.

One small pytree, `RunningStats(count, mean, sum_squared_deviations)`, per
observation coordinate. It lives in the train state (PPO) or beside the
strategy state (ES), is checkpointed with it, and combines exactly and stably
(Chan, Golub & LeVeque 1979): two sets of `n_a` and `n_b` observations with
means `mu_a`, `mu_b` and sums of squared deviations `M2_a`, `M2_b` make

    n = n_a + n_b,  delta = mu_b - mu_a,
    mu = mu_a + delta n_b / n,
    M2 = M2_a + M2_b + delta^2 n_a n_b / n.

Keeping `M2` rather than the variance avoids the cancellation of
`E[x^2] - E[x]^2`, and makes every combination the same formula: per member
(`observation_stats`, `reduce_stats`), across devices (`psum_stats`, two `psum`s:
the only observation-sized communication), and over time (`merge_stats`).
`update_stats` is all three at once, PPO's fold of one batch.

Two normalisations read the statistics:
- `standardize` (PPO): `clip((x - mu) / sqrt(sigma^2 + eps), -10, 10)`;
- `ars_normalize` (ARS V2, Mania et al. 2018, sec. 3): `diag(Sigma)^{-1/2} (x - mu)`,
  zero where the variance is below 1e-8.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import chex
import jax
import jax.numpy as jnp

from podracer.protocol.parallel import psum

# PPO: standardised observations are clipped to [-10, 10], as in the usual
# implementations, so one outlier cannot saturate the network.
CLIP = 10.0
# PPO: added to the variance so a constant coordinate does not divide by zero.
EPSILON = 1e-8
# Mania et al.: a diagonal entry of Sigma below 1e-8 is replaced by +inf, so a
# (so far) constant observation coordinate is normalised to zero.
MIN_VARIANCE = 1e-8


class RunningStats(NamedTuple):
    """Count, mean and sum of squared deviations of observations, per coordinate."""

    count: chex.Array  # float32 scalar: observations seen
    mean: chex.Array  # [*obs_shape] float32
    sum_squared_deviations: chex.Array  # [*obs_shape] float32


def init_running_stats(obs_shape: int | Sequence[int]) -> RunningStats:
    """No observations yet: the variance reads as 1 and both normalisations as the identity."""
    zeros = jnp.zeros(obs_shape, jnp.float32)
    return RunningStats(jnp.zeros((), jnp.float32), zeros, zeros)


def observation_stats(obs: chex.Array, mask: chex.Array | None = None) -> RunningStats:
    """Statistics of a batch of observations, over its leading axis.

    Args:
      obs: [n, *obs_shape] observations (e.g. `[T * B, obs_dim]` from a rollout).
      mask: optional [n] weights in {0, 1}: 0 drops a row (e.g. after `done`).

    Returns:
      `RunningStats` of the kept rows (all zeros when none is kept).
    """
    obs = jnp.asarray(obs, jnp.float32)
    mask = jnp.ones(obs.shape[:1], jnp.float32) if mask is None else mask.astype(jnp.float32)
    chex.assert_shape(mask, obs.shape[:1])
    weights = mask.reshape(mask.shape + (1,) * (obs.ndim - 1))
    count = jnp.sum(mask)
    mean = jnp.sum(weights * obs, axis=0) / jnp.maximum(count, 1.0)
    deviations = jnp.sum(weights * (obs - mean) ** 2, axis=0)
    return RunningStats(count, mean, deviations)


def reduce_stats(stacked: RunningStats) -> RunningStats:
    """Combine `[k]`-stacked statistics (e.g. one per population member) into one.

        n = sum_j n_j,  mu = sum_j n_j mu_j / n,
        M2 = sum_j (M2_j + n_j (mu_j - mu)^2)
    """
    chex.assert_rank(stacked.count, 1)
    counts = stacked.count.reshape(stacked.count.shape + (1,) * (stacked.mean.ndim - 1))
    count = jnp.sum(stacked.count)
    mean = jnp.sum(counts * stacked.mean, axis=0) / jnp.maximum(count, 1.0)
    spread = counts * (stacked.mean - mean) ** 2
    deviations = jnp.sum(stacked.sum_squared_deviations + spread, axis=0)
    return RunningStats(count, mean, deviations)


def merge_stats(old: RunningStats, new: RunningStats) -> RunningStats:
    """The online update: statistics of the union of two sets of observations.

        n = n_old + n_new,  delta = mu_new - mu_old,
        mu = mu_old + delta n_new / n,
        M2 = M2_old + M2_new + delta^2 n_old n_new / n
    """
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

    Two rounds of `psum`, over `obs_dim + 1` and `obs_dim` floats (the second
    needs the global mean); the identity when `axis_names` is empty (single
    device). Devices may hold different numbers of observations.
    """
    count, weighted_mean = psum((stats.count, stats.count * stats.mean), axis_names)
    mean = weighted_mean / jnp.maximum(count, 1.0)
    spread = stats.count * (stats.mean - mean) ** 2
    deviations = psum(stats.sum_squared_deviations + spread, axis_names)
    return RunningStats(count, mean, deviations)


def update_stats(stats: RunningStats, batch: chex.Array, axis_names: Sequence[str] = ()) -> RunningStats:
    """Fold a batch `[..., *obs_shape]` into `stats`, combined over the devices of `axis_names`.

    `merge_stats(stats, psum_stats(observation_stats(batch), axis_names))`: every
    device ends with the statistics of every batch on every device.
    """
    batch = jnp.reshape(batch, (-1, *stats.mean.shape))
    return merge_stats(stats, psum_stats(observation_stats(batch), axis_names))


def variance(stats: RunningStats) -> chex.Array:
    """`sigma^2 = M2 / n` per coordinate; 1 before any observation."""
    return jnp.where(stats.count > 0, stats.sum_squared_deviations / jnp.maximum(stats.count, 1.0), 1.0)


def standardize(stats: RunningStats, obs: chex.Array, clip: float = CLIP,
                epsilon: float = EPSILON) -> chex.Array:
    """PPO's normalisation: `clip((x - mu) / sqrt(sigma^2 + epsilon), -clip, clip)`.

    Works on one observation `[*obs_shape]` or a batch `[..., *obs_shape]`.
    """
    z = (jnp.asarray(obs, jnp.float32) - stats.mean) * jax.lax.rsqrt(variance(stats) + epsilon)
    return jnp.clip(z, -clip, clip)


def ars_normalize(stats: RunningStats, obs: chex.Array, min_variance: float = MIN_VARIANCE) -> chex.Array:
    """ARS V2's normalisation: `diag(Sigma)^{-1/2} (x - mu)`, zero where `sigma^2 < min_variance`.

    Works on one observation `[obs_dim]` or a batch `[..., obs_dim]`. Before any
    observation is recorded it returns `obs` unchanged. Unlike `standardize` it
    does not clip: Mania et al. do not.
    """
    var = variance(stats)
    inverse_std = jnp.where(var < min_variance, 0.0, 1.0 / jnp.sqrt(var))
    return (jnp.asarray(obs, jnp.float32) - stats.mean) * inverse_std
