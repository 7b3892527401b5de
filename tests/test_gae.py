import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rlax

from podracer.ppo import gae_advantages


def _column(values):
    return jnp.asarray(values, jnp.float32)[:, None]


def test_gae_hand_computed_with_truncation():
    # T=3, one env; the episode is cut by a time limit after row 1.
    adv, ret = gae_advantages(
        r_t=_column([1.0, 2.0, 3.0]), v_t=_column([0.5, 0.4, 0.3]),
        bootstrap_value=jnp.array([0.2]), terminated_t=_column([0, 0, 0]),
        truncated_t=_column([0, 1, 0]), final_value_t=_column([7.0, 0.9, 7.0]),
        gamma=0.9, lam=0.8)
    # t=2: 3 + .9*.2 - .3 = 2.88
    # t=1: bootstraps from the final observation's value 0.9, chain cut: 2 + .9*.9 - .4 = 2.41
    # t=0: 1 + .9*.4 - .5 = .86, plus .9*.8*2.41
    expected = [0.86 + 0.72 * 2.41, 2.41, 2.88]
    np.testing.assert_allclose(adv[:, 0], expected, rtol=1e-6)
    np.testing.assert_allclose(ret[:, 0], np.array(expected) + [0.5, 0.4, 0.3], rtol=1e-6)


def test_gae_hand_computed_with_termination():
    adv, _ = gae_advantages(
        r_t=_column([1.0, 2.0, 3.0]), v_t=_column([0.5, 0.4, 0.3]),
        bootstrap_value=jnp.array([0.2]), terminated_t=_column([1, 0, 0]),
        truncated_t=_column([0, 0, 0]), final_value_t=_column([9.0, 9.0, 9.0]),
        gamma=0.9, lam=0.8)
    a2 = 3 + 0.9 * 0.2 - 0.3
    a1 = 2 + 0.9 * 0.3 - 0.4 + 0.72 * a2
    # Terminated: no bootstrap at all (final_value ignored), no credit from the next episode.
    np.testing.assert_allclose(adv[:, 0], [1 - 0.5, a1, a2], rtol=1e-6)


def test_truncation_differs_from_termination():
    kwargs = dict(r_t=_column([1.0]), v_t=_column([0.0]), bootstrap_value=jnp.array([5.0]),
                  final_value_t=_column([3.0]), gamma=0.5, lam=1.0)
    terminated, _ = gae_advantages(terminated_t=_column([1]), truncated_t=_column([0]), **kwargs)
    truncated, _ = gae_advantages(terminated_t=_column([0]), truncated_t=_column([1]), **kwargs)
    running, _ = gae_advantages(terminated_t=_column([0]), truncated_t=_column([0]), **kwargs)
    assert float(terminated[0, 0]) == pytest.approx(1.0)
    assert float(truncated[0, 0]) == pytest.approx(1.0 + 0.5 * 3.0)
    assert float(running[0, 0]) == pytest.approx(1.0 + 0.5 * 5.0)


def test_gae_matches_rlax():
    T, B, gamma, lam = 64, 5, 0.97, 0.9
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    r = jax.random.normal(keys[0], (T, B))
    v = jax.random.normal(keys[1], (T + 1, B))
    terminated = jax.random.bernoulli(keys[2], 0.1, (T, B))
    adv, _ = gae_advantages(r, v[:-1], v[-1], terminated, jnp.zeros((T, B), bool),
                            jnp.zeros((T, B)), gamma, lam)
    discount = gamma * (1.0 - terminated.astype(jnp.float32))
    oracle = jax.vmap(rlax.truncated_generalized_advantage_estimation, in_axes=(1, 1, None, 1),
                      out_axes=1)(r, discount, lam, v)
    np.testing.assert_allclose(adv, oracle, rtol=1e-5, atol=1e-5)
