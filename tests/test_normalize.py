"""One `RunningStats` for PPO and ES: PPO's fold of a batch, and its standardisation."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from podracer import es, normalize
from podracer.protocol.parallel import DATA_AXIS, make_mesh

KEY = jax.random.PRNGKey(0)


def test_es_and_ppo_share_one_type_and_one_set_of_functions():
    assert es.RunningStats is normalize.RunningStats
    for name in ("init_running_stats", "observation_stats", "reduce_stats", "merge_stats",
                 "psum_stats", "ars_normalize"):
        assert getattr(es, name) is getattr(normalize, name)


def test_update_stats_folds_batches_of_any_shape_like_numpy():
    # [T, B, *obs_shape] batches with a two-axis observation, one after the other.
    scale = jnp.array([[1.0, 5.0, 0.1], [2.0, 0.5, 30.0]])
    first = jax.random.normal(KEY, (4, 5, 2, 3)) * scale + 100.0
    second = jax.random.normal(jax.random.PRNGKey(1), (6, 5, 2, 3)) * scale - 3.0
    stats = normalize.init_running_stats((2, 3))
    stats = normalize.update_stats(normalize.update_stats(stats, first), second)
    everything = np.concatenate([np.reshape(first, (-1, 2, 3)), np.reshape(second, (-1, 2, 3))])
    np.testing.assert_allclose(stats.count, 50)
    np.testing.assert_allclose(stats.mean, everything.mean(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(normalize.variance(stats), everything.var(0), rtol=1e-4)


def test_update_stats_over_eight_devices_equals_one_device():
    mesh = make_mesh()
    batch = jax.random.normal(KEY, (16, 8 * 3, 4)) * 2.0 + 7.0  # [T, B, obs_dim], B sharded
    start = normalize.update_stats(normalize.init_running_stats(4), batch[:, :8] - 1.0)

    def per_device(stats, local_batch):
        return normalize.update_stats(stats, local_batch, (DATA_AXIS,))

    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(None, DATA_AXIS)), out_specs=P())
    combined = jax.jit(sharded)(start, batch)
    one_device = normalize.update_stats(start, batch)
    for actual, expected in zip(combined, one_device):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-4)


def test_standardize_is_the_identity_at_first_then_standardises_and_clips():
    obs = jnp.array([[1.0, -2.0], [3.0, 4.0], [0.5, 9.0]])
    np.testing.assert_allclose(normalize.standardize(normalize.init_running_stats(2), obs), obs, rtol=1e-6)
    np.testing.assert_array_equal(normalize.standardize(normalize.init_running_stats(1), jnp.array([20.0])),
                                  [10.0])

    stats = normalize.observation_stats(obs)
    z = normalize.standardize(stats, obs)
    expected = (obs - obs.mean(0)) / np.sqrt(obs.var(0) + 1e-8)
    np.testing.assert_allclose(z, expected, rtol=1e-5)
    far = normalize.standardize(stats, jnp.array([1e6, -1e6]))
    np.testing.assert_array_equal(far, [10.0, -10.0])
    # A constant coordinate divides by sqrt(eps), not zero, and stays finite.
    constant = normalize.observation_stats(jnp.ones((5, 1)))
    np.testing.assert_array_equal(normalize.standardize(constant, jnp.ones((1,))), [0.0])
