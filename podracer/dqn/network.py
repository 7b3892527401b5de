"""The Q-network: one value per discrete action, from an MLP (vectors) or Nature-CNN (frames)."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from podracer.distributions import MASKED_LOGIT, masked_logits
from podracer.networks import MLP, NatureCNN, _dense, _split_mask


class QNetwork(nn.Module):
    """obs [N, ...] -> Q-values [N, action_dim]; an illegal action's (with `action_mask`) is MASKED_LOGIT."""

    action_dim: int
    hidden: Sequence[int] = (64, 64)
    activation: str = "relu"
    obs_rank: int = 1
    action_mask: bool = False  # the last `action_dim` observation entries are the legal actions
    cnn: bool = False
    channels_last: bool = False

    @nn.compact
    def __call__(self, obs):
        if self.cnn:
            x, legal = NatureCNN(self.channels_last)(obs), None
        else:
            x, legal = _split_mask(obs, self.obs_rank, self.action_dim if self.action_mask else 0)
            x = MLP(self.hidden, self.activation)(x)
        q = _dense(self.action_dim, 1.0)(x)
        return q if legal is None else masked_logits(q, legal)


def legal_actions(q: jax.Array) -> jax.Array:
    """Which actions a `QNetwork`'s Q-values [..., A] allow (all, without an action mask)."""
    return q > MASKED_LOGIT / 2


def make_q_network(obs_shape: Sequence[int], action_dim: int, hidden: Sequence[int] = (64, 64),
                   activation: str = "relu", action_mask: bool = False) -> QNetwork:
    """Nature-CNN for frames big enough for its 8x8/4 first layer (as `networks.make_network`), an MLP otherwise."""
    cnn, channels_last = False, False
    if len(obs_shape) == 3 and not action_mask:
        channels_last = obs_shape[-1] <= obs_shape[0]
        spatial = obs_shape[:2] if channels_last else obs_shape[1:]
        cnn = min(spatial) >= 36
    return QNetwork(action_dim, tuple(hidden), activation, len(obs_shape), action_mask, cnn, channels_last)


def greedy_or_random(q: jax.Array, epsilon, key: jax.Array) -> jax.Array:
    """Epsilon-greedy action of one observation's Q-values [A]: a uniform legal action with probability epsilon."""
    explore_key, action_key = jax.random.split(key)
    legal = legal_actions(q)
    random_action = jax.random.categorical(action_key, jnp.where(legal, 0.0, MASKED_LOGIT))
    return jnp.where(jax.random.uniform(explore_key) < epsilon, random_action, jnp.argmax(q)).astype(jnp.int32)


def epsilon_greedy_log_prob(q: jax.Array, action: jax.Array, epsilon) -> jax.Array:
    """log pi(action) of the epsilon-greedy policy on Q-values [N, A], actions [N]."""
    legal = legal_actions(q)
    uniform = epsilon / jnp.sum(legal, axis=-1)
    greedy = (action == jnp.argmax(q, axis=-1)).astype(jnp.float32)
    return jnp.log(uniform + greedy * (1.0 - epsilon))

