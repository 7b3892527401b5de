"""`podracer.prng.fast` keys draw exactly what jax's own Threefry keys draw."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from podracer import prng
from podracer.anakin.env import make_env

KEY = jax.random.PRNGKey(1234)


def _same(a, b, float_ulps=False):
    """Equal leaf by leaf; with `float_ulps`, floats may differ in their last bits.

    The random bits are the same either way, but XLA may contract a draw's float
    arithmetic (`u * (high - low) + low`) into one fused multiply-add in one
    program and not in the other.
    """
    a, b = prng.raw(a), prng.raw(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        if float_ulps and jnp.issubdtype(x.dtype, jnp.floating):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-9)
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("shape", [(), (1,), (3,), (5, 7), (2, 3, 4)])
def test_draws_match_jax_threefry(shape):
    fast = prng.fast(KEY)
    for draw in (jax.random.bits, jax.random.uniform, jax.random.normal, jax.random.gumbel,
                 lambda k, s: jax.random.randint(k, s, -3, 11),
                 lambda k, s: jax.random.bits(k, s, jnp.uint8),
                 lambda k, s: jax.random.uniform(k, s, minval=-0.05, maxval=0.05)):
        _same(draw(KEY, shape), draw(fast, shape))
        _same(jax.jit(draw, static_argnums=1)(KEY, shape), jax.jit(draw, static_argnums=1)(fast, shape))


def test_keys_match_jax_threefry():
    fast = prng.fast(KEY)
    _same(jax.random.split(KEY, 5), jax.random.split(fast, 5))
    _same(jax.random.split(KEY, (3, 4)), jax.random.split(fast, (3, 4)))
    _same(jax.random.fold_in(KEY, 7), jax.random.fold_in(fast, 7))
    _same(jax.random.permutation(KEY, 50), jax.random.permutation(fast, 50))
    logits = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    _same(jax.random.categorical(KEY, logits), jax.random.categorical(fast, logits))
    # Batched (vmap) and staged (jit) as the rollout draws them.
    index = jnp.arange(6)
    _same(jax.vmap(lambda i: jax.random.fold_in(KEY, i))(index),
          jax.jit(jax.vmap(lambda i: jax.random.fold_in(fast, i)))(index))
    keys = jax.random.split(KEY, 6)
    _same(jax.vmap(jax.random.split)(keys), jax.jit(jax.vmap(lambda k: jax.random.split(prng.fast(k))))(keys))
    _same(jax.vmap(lambda k: jax.random.gumbel(k, (2,)))(keys),
          jax.jit(jax.vmap(lambda k: jax.random.gumbel(prng.fast(k), (2,))))(keys))


def test_fast_and_raw_round_trip():
    fast = prng.fast(KEY)
    assert jnp.issubdtype(fast.dtype, jax.dtypes.prng_key)
    assert prng.fast(fast) is fast
    np.testing.assert_array_equal(prng.raw(fast), KEY)
    tree = {"key": fast, "x": jnp.ones(2)}
    assert prng.raw(tree)["key"].dtype == jnp.uint32 and prng.raw(tree)["x"] is tree["x"]


def test_a_wrong_cipher_is_caught(monkeypatch):
    # The checks above are not vacuous: one rotation off and the numbers differ.
    monkeypatch.setattr(prng, "_ROTATIONS", ((13, 15, 26, 6), (17, 29, 16, 23)))
    # (A shape no other test draws: jax caches compiled draws by impl and shape.)
    assert not np.array_equal(jax.random.bits(KEY, (17,)), jax.random.bits(prng.fast(KEY), (17,)))


# Each draws differently: uniform resets, a stochastic step (MinAtar's sticky actions,
# bandits), bsuite's own step, continuous actions. (Every other registered gymnax
# environment was checked once as well; each costs a compilation here.)
ENV_IDS = ["CartPole-v1", "Pendulum-v1", "MountainCarContinuous-v0", "Acrobot-v1",
           "Breakout-MinAtar", "DeepSea-bsuite", "GaussianBandit-misc", "FourRooms-misc"]


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_every_gymnax_env_draws_and_steps_alike(env_id):
    """Anakin hands `prng.fast` keys to gymnax's own reset and step: same states, same steps."""
    env = make_env(env_id)
    keys = jax.random.split(KEY, 3)

    def run(wrap):
        state, timestep = jax.vmap(lambda k: env.reset(wrap(k)))(keys)
        action = jnp.zeros((3,) + (() if env.spec.discrete else (env.spec.action_dim,)),
                           jnp.int32 if env.spec.discrete else jnp.float32)
        draws = jax.vmap(lambda k: env.draw(wrap(k)))(jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys))
        stepped = jax.vmap(env.step_with)(draws, state, action)
        return prng.raw((state, timestep, draws, stepped))

    _same(jax.jit(lambda: run(lambda k: k))(), jax.jit(lambda: run(prng.fast))(), float_ulps=True)
