"""Q-networks and epsilon-greedy acting, shared by the value-based agents (`podracer.dqn`, `podracer.pqn`).

`QNetwork` maps observations to one value per discrete action. Vectors (and
small frames, flattened, such as MinAtar's 10x10) go through an MLP; frames of
at least 36x36 through the Nature-CNN torso. Two layouts:

- `layer_norm=True` (PQN's, where layer norm stands in for a target network):
  each hidden layer is Dense -> LayerNorm -> activation with flax's default
  initialisation, as in the PQN paper and purejaxql; a CNN torso is
  layer-normed before the head.
- `layer_norm=False` (DQN's): `podracer.networks`' orthogonally initialised
  MLP and head, and, with `action_mask`, the last `action_dim` observation
  entries mark the legal actions (an illegal action's Q-value is MASKED_LOGIT).

Acting is epsilon-greedy: per environment, `draw_exploration` draws a uniform
number and a random action, and `epsilon_greedy` takes the random action where
the number falls below epsilon, the greedy one elsewhere.
"""

from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from podracer.distributions import MASKED_LOGIT, masked_logits
from podracer.networks import ACTIVATIONS, MLP, NatureCNN, dense, split_mask


class QNetwork(nn.Module):
    """obs [N, ...] -> Q-values [N, action_dim]."""

    action_dim: int
    hidden: Sequence[int] = (64, 64)
    activation: str = "relu"
    obs_rank: int = 1  # trailing observation dimensions, flattened before the MLP
    action_mask: bool = False  # the last `action_dim` observation entries are the legal actions
    cnn: bool = False
    channels_last: bool = False
    layer_norm: bool = False

    @nn.compact
    def __call__(self, obs):
        legal = None
        if self.cnn:
            x = NatureCNN(self.channels_last)(obs)
            if self.layer_norm:
                x = nn.LayerNorm()(x)
        else:
            x, legal = split_mask(obs, self.obs_rank, self.action_dim if self.action_mask else 0)
            if self.layer_norm:
                act = ACTIVATIONS[self.activation]
                for width in self.hidden:
                    x = act(nn.LayerNorm()(nn.Dense(width)(x)))
            else:
                x = MLP(self.hidden, self.activation)(x)
        q = nn.Dense(self.action_dim)(x) if self.layer_norm else dense(self.action_dim, 1.0)(x)
        return q if legal is None else masked_logits(q, legal)


def make_q_network(obs_shape: Sequence[int], action_dim: int, hidden: Sequence[int] = (64, 64),
                   activation: str = "relu", action_mask: bool = False, layer_norm: bool = False) -> QNetwork:
    """Nature-CNN for frames big enough for its 8x8/4 first layer (as `networks.make_network`), an MLP otherwise."""
    cnn, channels_last = False, False
    if len(obs_shape) == 3 and not action_mask:  # channels-first ([C, H, W], envpool's): leading axis smallest
        channels_last = obs_shape[-1] <= obs_shape[0]
        spatial = obs_shape[:2] if channels_last else obs_shape[1:]
        cnn = min(spatial) >= 36
    return QNetwork(action_dim, tuple(hidden), activation, len(obs_shape), action_mask, cnn, channels_last,
                    layer_norm)


def legal_actions(q: jax.Array) -> jax.Array:
    """Which actions a `QNetwork`'s Q-values [..., A] allow (all, without an action mask)."""
    return q > MASKED_LOGIT / 2


def draw_exploration(key: jax.Array, num_actions: int, legal: jax.Array | None = None):
    """One environment's exploration draw: a uniform number (explore below epsilon) and a random action,
    uniform over all `num_actions`, or over the `legal` [A] ones where given."""
    uniform_key, action_key = jax.random.split(key)
    if legal is None:
        action = jax.random.randint(action_key, (), 0, num_actions)
    else:
        action = jax.random.categorical(action_key, jnp.where(legal, 0.0, MASKED_LOGIT))
    return jax.random.uniform(uniform_key), action


def epsilon_greedy(q: jax.Array, epsilon: jax.Array, uniform: jax.Array, random_action: jax.Array) -> jax.Array:
    """[B] actions: `random_action` where `uniform` < `epsilon`, else the greedy one (argmax of `q` [B, A])."""
    return jnp.where(uniform < epsilon, random_action, jnp.argmax(q, axis=-1)).astype(jnp.int32)


def act_epsilon_greedy(q: jax.Array, epsilon, keys: jax.Array, legal_only: bool = False) -> jax.Array:
    """[B] epsilon-greedy actions on Q-values [B, A], each environment drawing from its own key [B];
    with `legal_only` the random action is a legal one (`legal_actions`)."""
    legal = legal_actions(q) if legal_only else None
    uniform, random_action = jax.vmap(lambda key, ok: draw_exploration(key, q.shape[-1], ok))(keys, legal)
    return epsilon_greedy(q, epsilon, uniform, random_action)


def epsilon_greedy_log_prob(q: jax.Array, action: jax.Array, epsilon) -> jax.Array:
    """[B] log pi(action) of epsilon-greedy on Q-values [B, A]: epsilon over the legal actions, plus
    1 - epsilon for the greedy one."""
    uniform = epsilon / jnp.sum(legal_actions(q), axis=-1)
    greedy = (action == jnp.argmax(q, axis=-1)).astype(jnp.float32)
    return jnp.log(uniform + greedy * (1.0 - epsilon))


def make_epsilon_act(apply_fn: Callable, epsilon, greedy: bool = False, legal_only: bool = False) -> Callable:
    """`act_fn(params, obs [B, ...], keys [B]) -> (action, log_prob)`: a trained Q-network's policy.

    Epsilon-greedy with `epsilon` (`act_epsilon_greedy`), or with `greedy` the
    argmax; either way the log-probability is that of the epsilon-greedy
    choice (what a recorded dataset keeps, as PPO's keeps its stochastic
    policy's beside a mode).
    """

    def act_fn(params, obs, keys):
        q = apply_fn(params, obs)
        if greedy:
            action = jnp.argmax(q, axis=-1).astype(jnp.int32)
        else:
            action = act_epsilon_greedy(q, epsilon, keys, legal_only)
        return action, epsilon_greedy_log_prob(q, action, jnp.asarray(epsilon, q.dtype))

    return act_fn
