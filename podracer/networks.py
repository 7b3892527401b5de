"""Actor-critic networks: an MLP for vector observations, Nature-CNN for pixels.

Every actor-critic maps a batch of observations to `(distribution, value)`, which
is the `apply_fn` contract used by PPO, the actors and `load_policy`. Evolution
strategies use `make_policy_network` instead: a deterministic policy, no critic.
"""

from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from podracer.distributions import Categorical, DiagGaussian, masked_logits

ACTIVATIONS: dict[str, Callable] = {"tanh": nn.tanh, "relu": nn.relu}


def _dense(features: int, scale: float) -> nn.Dense:
    return nn.Dense(features, kernel_init=nn.initializers.orthogonal(scale),
                    bias_init=nn.initializers.zeros)


class MLP(nn.Module):
    hidden: Sequence[int]
    activation: str = "tanh"

    @nn.compact
    def __call__(self, x):
        act = ACTIVATIONS[self.activation]
        for width in self.hidden:
            x = act(_dense(width, np.sqrt(2))(x))
        return x


class PolicyHead(nn.Module):
    """Categorical logits for `num_actions`, or a state-independent-std Gaussian."""

    action_dim: int
    discrete: bool

    @nn.compact
    def __call__(self, x, legal=None):
        out = _dense(self.action_dim, 0.01)(x)
        if self.discrete:
            return Categorical(logits=out if legal is None else masked_logits(out, legal))
        log_std = self.param("log_std", nn.initializers.zeros, (self.action_dim,))
        return DiagGaussian(mean=out, log_std=jnp.broadcast_to(log_std, out.shape))


class MLPActorCritic(nn.Module):
    """Separate actor and critic MLPs (sharing hurts on small control tasks)."""

    action_dim: int
    discrete: bool
    hidden: Sequence[int] = (64, 64)
    activation: str = "tanh"
    obs_rank: int = 1  # trailing observation dimensions, flattened before the MLP
    action_mask: bool = False  # the last `action_dim` inputs are the legal actions (0/1)

    @nn.compact
    def __call__(self, obs):
        x, legal = _split_mask(obs, self.obs_rank, self.action_dim if self.action_mask else 0)
        dist = PolicyHead(self.action_dim, self.discrete)(MLP(self.hidden, self.activation)(x), legal)
        value = _dense(1, 1.0)(MLP(self.hidden, self.activation)(x))[..., 0]
        return dist, value


def _split_mask(obs, obs_rank: int, mask_dim: int):
    """Flattened float features, and the legal-action mask from the last `mask_dim` of them (or None)."""
    x = obs.reshape(obs.shape[: obs.ndim - obs_rank] + (-1,)).astype(jnp.float32)
    if not mask_dim:
        return x, None
    return x[..., :-mask_dim], x[..., -mask_dim:] > 0.5


class NatureCNN(nn.Module):
    """The DQN torso (Mnih et al. 2015) on [..., H, W, C] or [..., C, H, W] uint8 frames."""

    channels_last: bool = False

    @nn.compact
    def __call__(self, frames):
        x = frames.astype(jnp.float32) / 255.0
        if not self.channels_last:  # envpool yields [C, H, W]
            x = jnp.moveaxis(x, -3, -1)
        for features, kernel, stride in ((32, 8, 4), (64, 4, 2), (64, 3, 1)):
            x = nn.relu(nn.Conv(features, (kernel, kernel), (stride, stride), padding="VALID",
                                kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        x = x.reshape(x.shape[:-3] + (-1,))
        return nn.relu(_dense(512, np.sqrt(2))(x))


class CNNActorCritic(nn.Module):
    """Nature-CNN torso shared by a categorical policy head and a value head."""

    action_dim: int
    channels_last: bool = False

    @nn.compact
    def __call__(self, frames):
        hidden = NatureCNN(self.channels_last)(frames)
        dist = PolicyHead(self.action_dim, discrete=True)(hidden)
        value = _dense(1, 1.0)(hidden)[..., 0]
        return dist, value


def make_network(obs_shape: Sequence[int], action_dim: int, discrete: bool,
                 hidden: Sequence[int] = (64, 64), activation: str = "tanh",
                 action_mask: bool = False) -> nn.Module:
    """Nature-CNN for frames big enough for its 8x8/4 first layer, an MLP otherwise.

    Frames are channels-first ([C, H, W], envpool's layout) when the leading
    dimension is the smallest, channels-last ([H, W, C]) otherwise. With
    `action_mask` (a flat observation whose last `action_dim` entries are the
    legal actions), the MLP masks the policy's logits.
    """
    if action_mask:
        return MLPActorCritic(action_dim, discrete, tuple(hidden), activation, len(obs_shape), True)
    if len(obs_shape) == 3 and discrete:
        channels_last = obs_shape[-1] <= obs_shape[0]
        spatial = obs_shape[:2] if channels_last else obs_shape[1:]
        if min(spatial) >= 36:
            return CNNActorCritic(action_dim, channels_last=channels_last)
    return MLPActorCritic(action_dim, discrete, tuple(hidden), activation, len(obs_shape))


class MLPPolicy(nn.Module):
    """Deterministic policy for evolution strategies: observation -> action.

    The actor MLP and head of `MLPActorCritic` without the critic, whose
    parameters ES would only perturb for nothing. Discrete actions are the argmax
    of the logits; continuous actions are the head's output, which the
    environment clips to its bounds (the mode of the PPO policy's Gaussian).
    """

    action_dim: int
    discrete: bool
    hidden: Sequence[int] = (64, 64)
    activation: str = "tanh"
    obs_rank: int = 1
    action_mask: bool = False  # as MLPActorCritic's: the argmax is over legal actions only

    @nn.compact
    def __call__(self, obs):
        x, legal = _split_mask(obs, self.obs_rank, self.action_dim if self.action_mask else 0)
        out = _dense(self.action_dim, 0.01)(MLP(self.hidden, self.activation)(x))
        if legal is not None:
            out = masked_logits(out, legal)
        return jnp.argmax(out, axis=-1) if self.discrete else out


def make_policy_network(obs_shape: Sequence[int], action_dim: int, discrete: bool,
                        hidden: Sequence[int] = (64, 64), activation: str = "tanh",
                        action_mask: bool = False) -> nn.Module:
    """`MLPPolicy` for any observation shape (frames are flattened)."""
    return MLPPolicy(action_dim, discrete, tuple(hidden), activation, len(obs_shape), action_mask)


def init_params(network: nn.Module, obs_shape: Sequence[int], obs_dtype, key: jax.Array):
    """Parameters for `network`, initialised from a single dummy observation."""
    return network.init(key, jnp.zeros((1, *obs_shape), obs_dtype))
