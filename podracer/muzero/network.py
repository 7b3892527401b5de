"""MuZero's three networks as one flax module: representation, dynamics and prediction MLPs.

`initial(obs)` is the representation then the prediction: a hidden state and
its policy and value logits. `recurrent(state, action)` is the dynamics then
the prediction: the next hidden state, the reward logits of the step, and the
next state's policy and value logits. Values and rewards are logits over the
support -S..S (`podracer.muzero.targets`). Hidden states are min-max
normalised to [0, 1] per sample, as MuZero's, which keeps the unrolled model's
inputs on one scale.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from podracer.networks import MLP


def _normalised(state: jax.Array) -> jax.Array:
    low, high = state.min(axis=-1, keepdims=True), state.max(axis=-1, keepdims=True)
    return (state - low) / (high - low + 1e-5)


def _head(features: int) -> nn.Dense:
    # Zero logits: a uniform prior and a value and reward of exactly 0 before training.
    return nn.Dense(features, kernel_init=nn.initializers.zeros, bias_init=nn.initializers.zeros)


class MuZeroNetwork(nn.Module):
    action_dim: int
    hidden: Sequence[int] = (64, 64)
    latent_size: int = 64
    support_size: int = 10
    activation: str = "relu"

    def setup(self):
        atoms = 2 * self.support_size + 1
        self.representation = MLP(self.hidden, self.activation)
        self.representation_out = nn.Dense(self.latent_size)
        self.dynamics = MLP(self.hidden, self.activation)
        self.dynamics_out = nn.Dense(self.latent_size)
        self.reward_head = _head(atoms)
        self.prediction = MLP(self.hidden, self.activation)
        self.policy_head = _head(self.action_dim)
        self.value_head = _head(atoms)

    def predict(self, state):
        x = self.prediction(state)
        return self.policy_head(x), self.value_head(x)

    def initial(self, obs):
        """obs [B, ...] -> (state [B, latent], policy logits [B, A], value logits [B, 2S + 1])."""
        x = obs.reshape(obs.shape[0], -1).astype(jnp.float32)
        state = _normalised(self.representation_out(self.representation(x)))
        return (state, *self.predict(state))

    def recurrent(self, state, action):
        """(state [B, latent], action [B]) -> (next state, reward logits, policy logits, value logits)."""
        x = self.dynamics(jnp.concatenate([state, jax.nn.one_hot(action, self.action_dim)], axis=-1))
        next_state = _normalised(self.dynamics_out(x))
        return (next_state, self.reward_head(x), *self.predict(next_state))

    def __call__(self, obs):
        """Every layer once (what `init` traces): one step of the model from `obs`."""
        state, _, _ = self.initial(obs)
        return self.recurrent(state, jnp.zeros(obs.shape[0], jnp.int32))
