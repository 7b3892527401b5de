"""Action distributions as small pytrees: a policy network returns one of these.

Both carry only arrays, so they pass through `jit`, `vmap` and `shard_map`
untouched, and the PPO loss never needs to know which kind of action space it
is learning on.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Categorical:
    """Discrete actions; `logits` has shape [..., num_actions]."""

    logits: jax.Array

    def sample(self, key: jax.Array) -> jax.Array:
        # What jax.random.categorical computes, bit for bit.
        return self.sample_from_noise(jax.random.gumbel(key, self.logits.shape, self.logits.dtype))

    def sample_from_noise(self, noise: jax.Array) -> jax.Array:
        """The action that standard Gumbel `noise` (shaped like the logits) picks."""
        return jnp.argmax(noise + self.logits, axis=-1)

    def mode(self) -> jax.Array:
        return jnp.argmax(self.logits, axis=-1)

    def log_prob(self, action: jax.Array) -> jax.Array:
        # A one-hot product rather than a gather: its gradient is elementwise, where a
        # gather's is a scatter-add, which is slow on CPU.
        log_p = jax.nn.log_softmax(self.logits)
        one_hot = jax.nn.one_hot(action, self.logits.shape[-1], dtype=log_p.dtype)
        return jnp.sum(log_p * one_hot, axis=-1)

    def entropy(self) -> jax.Array:
        log_p = jax.nn.log_softmax(self.logits)
        return -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)


MASKED_LOGIT = -1e9  # finite: log_softmax and the entropy stay free of inf and NaN


def masked_logits(logits: jax.Array, legal: jax.Array) -> jax.Array:
    """`logits` with every illegal action's (`legal` false) set to a huge negative number.

    Such an action has probability 0 (exp underflows), is never sampled (Gumbel
    noise cannot make up 1e9) nor the mode, and its logit gets no gradient.
    """
    return jnp.where(legal, logits, jnp.asarray(MASKED_LOGIT, logits.dtype))


@struct.dataclass
class DiagGaussian:
    """Continuous actions; `mean` and `log_std` have shape [..., action_dim].

    Samples are unbounded: environments clip them to their action bounds, and the
    log-probability is that of the unclipped sample, as in most PPO references.
    """

    mean: jax.Array
    log_std: jax.Array

    def sample(self, key: jax.Array) -> jax.Array:
        return self.sample_from_noise(jax.random.normal(key, self.mean.shape, self.mean.dtype))

    def sample_from_noise(self, noise: jax.Array) -> jax.Array:
        """The action that standard normal `noise` (shaped like the mean) gives."""
        return self.mean + jnp.exp(self.log_std) * noise

    def mode(self) -> jax.Array:
        return self.mean

    def log_prob(self, action: jax.Array) -> jax.Array:
        z = (action - self.mean) * jnp.exp(-self.log_std)
        per_dim = -0.5 * z**2 - self.log_std - 0.5 * math.log(2 * math.pi)
        return jnp.sum(per_dim, axis=-1)

    def entropy(self) -> jax.Array:
        per_dim = self.log_std + 0.5 * (1.0 + math.log(2 * math.pi))
        return jnp.sum(jnp.broadcast_to(per_dim, self.mean.shape), axis=-1)


def sampling_noise(key: jax.Array, discrete: bool, action_dim: int) -> jax.Array:
    """The noise one action's `sample(key)` draws, drawn on its own: [action_dim].

    `dist.sample_from_noise(sampling_noise(key, ...)) == dist.sample(key)` bit for
    bit. A loop that acts many times (Anakin's rollout) draws the noise of every
    step ahead in one batched call: on XLA:CPU each PRNG draw inside the loop is a
    rolled loop of its own, a dozen kernel launches per step for a few numbers.
    """
    if discrete:
        return jax.random.gumbel(key, (action_dim,), jnp.float32)
    return jax.random.normal(key, (action_dim,), jnp.float32)


def tanh_log_det_jacobian(u: jax.Array) -> jax.Array:
    """log |d tanh(u) / du| = log(1 - tanh(u)^2), elementwise, in a form that stays finite for large |u|.

    1 - tanh(u)^2 = 4 / (e^u + e^-u)^2, so its log is 2 (log 2 - u - softplus(-2u)).
    """
    return 2.0 * (math.log(2.0) - u - jax.nn.softplus(-2.0 * u))


@struct.dataclass
class TanhGaussian:
    """A diagonal Gaussian squashed by tanh into (-1, 1)^d: SAC's policy (Haarnoja et al. 2018, appendix C).

    `mean` and `log_std` are those of the Gaussian before the squash, [..., action_dim].
    The density of a = tanh(u) is the Gaussian's at u over the Jacobian of the
    squash: log pi(a) = log N(u) - sum_i log(1 - tanh(u_i)^2).
    """

    mean: jax.Array
    log_std: jax.Array

    def sample(self, key: jax.Array) -> jax.Array:
        return self.sample_from_noise(jax.random.normal(key, self.mean.shape, self.mean.dtype))

    def sample_from_noise(self, noise: jax.Array) -> jax.Array:
        return jnp.tanh(self.mean + jnp.exp(self.log_std) * noise)

    def sample_and_log_prob(self, noise: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The action standard normal `noise` gives and its log-probability, from the same pre-squash u
        (exact where `log_prob(tanh(u))` would lose u to rounding near +-1)."""
        u = self.mean + jnp.exp(self.log_std) * noise
        return jnp.tanh(u), self.pre_squash_log_prob(u)

    def pre_squash_log_prob(self, u: jax.Array) -> jax.Array:
        """log pi(tanh(u)) of the pre-squash value u."""
        return DiagGaussian(self.mean, self.log_std).log_prob(u) - jnp.sum(tanh_log_det_jacobian(u), axis=-1)

    def log_prob(self, action: jax.Array) -> jax.Array:
        eps = jnp.finfo(action.dtype).eps
        return self.pre_squash_log_prob(jnp.arctanh(jnp.clip(action, -1.0 + eps, 1.0 - eps)))

    def mode(self) -> jax.Array:
        """tanh of the Gaussian's mean: the deterministic action."""
        return jnp.tanh(self.mean)
