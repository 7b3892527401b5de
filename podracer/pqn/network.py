"""PQN's Q-network: layer norm after every hidden layer, which stands in for a target network."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

from podracer.errors import PodracerError
from podracer.networks import ACTIVATIONS, NatureCNN


class QNetwork(nn.Module):
    """Observations [B, ...] -> Q-values [B, num_actions].

    Vectors (and small frames, flattened, such as MinAtar's 10x10) go through
    an MLP of `hidden` layers, each Dense -> LayerNorm -> activation, as in the
    paper; frames of at least 36x36 go through the Nature-CNN torso (`cnn`),
    layer-normed before the head.
    """

    num_actions: int
    hidden: Sequence[int] = (128, 128)
    activation: str = "relu"
    obs_rank: int = 1
    cnn: bool = False
    channels_last: bool = False

    @nn.compact
    def __call__(self, obs):
        act = ACTIVATIONS[self.activation]
        if self.cnn:
            x = nn.LayerNorm()(NatureCNN(self.channels_last)(obs))
        else:
            x = obs.reshape(obs.shape[: obs.ndim - self.obs_rank] + (-1,)).astype(jnp.float32)
            for width in self.hidden:
                x = act(nn.LayerNorm()(nn.Dense(width)(x)))
        return nn.Dense(self.num_actions)(x)


def make_q_network(spec, net) -> QNetwork:
    """`QNetwork` for an environment's spec and the run's `NetworkConfig` (--hidden, --activation)."""
    if not spec.discrete:
        raise PodracerError("--algo=pqn picks among discrete actions; use --algo=ppo for continuous ones")
    if spec.action_mask:
        raise PodracerError("--algo=pqn does not read this environment's legal-action mask; use --algo=ppo")
    if net.network != "mlp":
        raise PodracerError(f"--network={net.network} trains with --algo=ppo only; use --network=mlp")
    obs_shape = tuple(spec.obs_shape)
    cnn, channels_last = False, False
    if len(obs_shape) == 3:  # frames: channels-first ([C, H, W], envpool's) when the leading axis is smallest
        channels_last = obs_shape[-1] <= obs_shape[0]
        cnn = min(obs_shape[:2] if channels_last else obs_shape[1:]) >= 36
    return QNetwork(spec.action_dim, tuple(net.hidden), net.activation, len(obs_shape), cnn, channels_last)
