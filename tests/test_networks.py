"""The networks' dense layers: the same values and gradients as flax's own `nn.Dense`."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
    monkeypatch.setattr(networks, "_dense", _plain_dense)
    plain = jax.jit(jax.value_and_grad(loss))(params)
    np.testing.assert_allclose(ours[0], plain[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(ours[1]), jax.tree.leaves(plain[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_kernel_gradient_is_x_transpose_g():
    x = jax.random.normal(jax.random.PRNGKey(3), (5, 7, 3))
    g = jax.random.normal(jax.random.PRNGKey(4), (5, 7, 2))
    expected = np.einsum("abi,abj->ij", np.asarray(x, np.float64), np.asarray(g, np.float64))
    np.testing.assert_allclose(jax.jit(networks._kernel_gradient)(x, g), expected, rtol=1e-5, atol=1e-5)
