"""The networks' dense layers: flax's own `nn.Dense` values and gradients; pairs of ES members."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from podracer import networks
from podracer.networks import make_network


def _plain_dense(features, scale):
    return nn.Dense(features, kernel_init=nn.initializers.orthogonal(scale),
                    bias_init=nn.initializers.zeros)


@pytest.mark.parametrize("batch_shape", [(128,), (16, 8)])
def test_kernel_gradients_match_plain_dense(monkeypatch, batch_shape):
    network = make_network((4,), 2, True)
    obs = jax.random.normal(jax.random.PRNGKey(0), batch_shape + (4,))
    params = network.init(jax.random.PRNGKey(1), obs)
    target = jax.random.normal(jax.random.PRNGKey(2), batch_shape)

    def loss(params):
        dist, value = network.apply(params, obs)
        return jnp.sum(jnp.tanh(dist.logits) * jnp.arange(1.0, 3.0)) + jnp.sum((value - target) ** 2)

    ours = jax.jit(jax.value_and_grad(loss))(params)
    monkeypatch.setattr(networks, "dense", _plain_dense)
    plain = jax.jit(jax.value_and_grad(loss))(params)
    np.testing.assert_allclose(ours[0], plain[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(ours[1]), jax.tree.leaves(plain[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_kernel_gradient_is_x_transpose_g():
    x = jax.random.normal(jax.random.PRNGKey(3), (5, 7, 3))
    g = jax.random.normal(jax.random.PRNGKey(4), (5, 7, 2))
    expected = np.einsum("abi,abj->ij", np.asarray(x, np.float64), np.asarray(g, np.float64))
    np.testing.assert_allclose(jax.jit(networks._kernel_gradient)(x, g), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("discrete, hidden", [(True, (16, 16)), (False, (8,))])
def test_apply_antithetic_acts_as_each_member(discrete, hidden):
    policy = networks.make_policy_network((4,), 3, discrete, hidden)
    mean = policy.init(jax.random.PRNGKey(0), jnp.zeros((4,)))
    flat, unravel = ravel_pytree(mean)
    eps = jax.random.normal(jax.random.PRNGKey(1), flat.shape)
    obs = jax.random.normal(jax.random.PRNGKey(2), (64, 2, 4))  # 64 pairs of observations
    scale = 0.7 if discrete else 0.3
    pair = jax.jit(jax.vmap(lambda o: networks.apply_antithetic(policy, mean, unravel(eps), scale, o)))(obs)
    plus = jax.vmap(lambda o: policy.apply(unravel(flat + scale * eps), o))(obs[:, 0])
    minus = jax.vmap(lambda o: policy.apply(unravel(flat - scale * eps), o))(obs[:, 1])
    members = jnp.stack([plus, minus], axis=1)
    assert not np.array_equal(plus, jax.vmap(lambda o: policy.apply(mean, o))(obs[:, 0]))  # not vacuous
    if discrete:
        np.testing.assert_array_equal(pair, members)
    else:
        np.testing.assert_allclose(pair, members, rtol=1e-5, atol=1e-6)


def test_apply_antithetic_refuses_other_layers():
    class WithScale(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x) * self.param("scale", nn.initializers.ones, (2,))

    module = WithScale()
    variables = module.init(jax.random.PRNGKey(0), jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match="nn.Dense parameters only"):
        networks.apply_antithetic(module, variables, variables, 0.1, jnp.zeros((2, 3)))


def test_apply_antithetic_takes_low_rank_kernels():
    policy = networks.make_policy_network((4,), 2, False, (16,))
    mean = policy.init(jax.random.PRNGKey(0), jnp.zeros((4,)))
    keys = iter(jax.random.split(jax.random.PRNGKey(5), 16))
    factored = jax.tree.map(lambda x: (jax.random.normal(next(keys), (x.shape[0], 2)),
                                       jax.random.normal(next(keys), (x.shape[1], 2)))
                            if x.ndim == 2 else jax.random.normal(next(keys), x.shape), mean)
    dense = jax.tree.map(lambda f: f[0] @ f[1].T if isinstance(f, tuple) else f, factored,
                         is_leaf=lambda f: isinstance(f, tuple))
    obs = jax.random.normal(jax.random.PRNGKey(2), (2, 4))
    ours = networks.apply_antithetic(policy, mean, factored, 0.2, obs)
    explicit = networks.apply_antithetic(policy, mean, dense, 0.2, obs)
    np.testing.assert_allclose(ours, explicit, rtol=1e-5, atol=1e-6)
    assert not np.allclose(ours, networks.apply_antithetic(policy, mean, jax.tree.map(jnp.zeros_like, dense), 0.2, obs))
