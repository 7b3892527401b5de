"""SAC's networks: a tanh-squashed Gaussian actor and twin Q critics, each its own MLP."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from podracer.distributions import TanhGaussian
from podracer.networks import MLP

# The range of the Gaussian's log standard deviation (as in Stable-Baselines3 and CleanRL):
# narrower than this the log-probability's gradients blow up, wider the squash saturates.
LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


def _flat(obs: jnp.ndarray, obs_rank: int) -> jnp.ndarray:
    return obs.reshape(obs.shape[: obs.ndim - obs_rank] + (-1,)).astype(jnp.float32)


def _head(features: int, scale: float) -> nn.Dense:
    return nn.Dense(features, kernel_init=nn.initializers.orthogonal(scale), bias_init=nn.initializers.zeros)


class Actor(nn.Module):
    """obs [B, ...] -> `TanhGaussian` over actions in (-1, 1)^action_dim."""

    action_dim: int
    hidden: Sequence[int] = (256, 256)
    activation: str = "relu"
    obs_rank: int = 1

    @nn.compact
    def __call__(self, obs):
        x = MLP(self.hidden, self.activation)(_flat(obs, self.obs_rank))
        mean = _head(self.action_dim, 0.01)(x)
        raw = _head(self.action_dim, 0.01)(x)
        # Squashed into the range smoothly: a clip would stop the gradient at its edges.
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (jnp.tanh(raw) + 1.0)
        return TanhGaussian(mean, log_std)


class TwinCritic(nn.Module):
    """(obs [B, ...], action [B, action_dim] in (-1, 1)) -> the two critics' Q values [2, B]."""

    hidden: Sequence[int] = (256, 256)
    activation: str = "relu"
    obs_rank: int = 1

    @nn.compact
    def __call__(self, obs, action):
        x = jnp.concatenate([_flat(obs, self.obs_rank), action.astype(jnp.float32)], axis=-1)
        q = [_head(1, 1.0)(MLP(self.hidden, self.activation)(x))[..., 0] for _ in range(2)]
        return jnp.stack(q)


class SACNetworks(NamedTuple):
    """The actor and the twin critics (the target critics share the critics' module), and the
    environment's action bounds that the actor's (-1, 1) is scaled to."""

    actor: Actor
    critic: TwinCritic
    action_low: tuple[float, ...]
    action_high: tuple[float, ...]


def make_networks(obs_shape: Sequence[int], action_dim: int, hidden: Sequence[int] = (256, 256),
                  activation: str = "relu", action_low=-1.0, action_high=1.0) -> SACNetworks:
    """MLPs over flattened observations of `obs_shape` for `action_dim` continuous actions in
    [action_low, action_high] (scalars or one bound per dimension)."""
    obs_rank = len(obs_shape)
    bound = lambda b: tuple(float(x) for x in np.broadcast_to(np.asarray(b, np.float32), (action_dim,)))
    return SACNetworks(Actor(action_dim, tuple(hidden), activation, obs_rank),
                       TwinCritic(tuple(hidden), activation, obs_rank), bound(action_low), bound(action_high))


def action_scale(networks: SACNetworks) -> tuple[np.ndarray, np.ndarray]:
    """(centre, half width) of the action box: env action = centre + half width * a, for a in (-1, 1)."""
    low, high = np.asarray(networks.action_low, np.float32), np.asarray(networks.action_high, np.float32)
    return (high + low) / 2, (high - low) / 2
