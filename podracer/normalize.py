"""Running mean and variance of observations (Chan et al.'s parallel update).

The statistics are a tiny pytree so they live in the train state, are
checkpointed with it, and combine exactly across devices: each device reduces its
own batch and the moments are averaged with a collective.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from podracer.protocol import parallel


class RunningStats(NamedTuple):
    mean: jax.Array
    var: jax.Array
    count: jax.Array  # float32 number of observations seen


def init_stats(obs_shape: Sequence[int]) -> RunningStats:
    return RunningStats(jnp.zeros(obs_shape, jnp.float32), jnp.ones(obs_shape, jnp.float32),
                        jnp.zeros((), jnp.float32))


def update_stats(stats: RunningStats, batch: jax.Array, axis_names: Sequence[str] = ()) -> RunningStats:
    """Fold a batch [N, *obs_shape] into `stats`; moments are averaged over `axis_names`."""
    batch = batch.reshape((-1, *stats.mean.shape)).astype(jnp.float32)
    n = jnp.asarray(batch.shape[0], jnp.float32)
    batch_mean, batch_sq = parallel.pmean((batch.mean(0), (batch**2).mean(0)), axis_names)
    n = parallel.psum(n, axis_names)
    batch_var = jnp.maximum(batch_sq - batch_mean**2, 0.0)
    total = stats.count + n
    delta = batch_mean - stats.mean
    mean = stats.mean + delta * n / total
    m2 = stats.var * stats.count + batch_var * n + delta**2 * stats.count * n / total
    return RunningStats(mean, m2 / total, total)


def normalize(stats: RunningStats, obs: jax.Array, clip: float = 10.0) -> jax.Array:
    """Standardise `obs` with `stats`, clipped to [-clip, clip]."""
    z = (obs.astype(jnp.float32) - stats.mean) * jax.lax.rsqrt(stats.var + 1e-8)
    return jnp.clip(z, -clip, clip)
