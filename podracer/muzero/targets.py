"""MuZero's target maths: the value transform, the two-hot categorical projection, n-step value targets.

Values and rewards are learned as distributions over a support of the
integers -S..S in a transformed space (Schrittwieser et al. 2020, appendix F;
the transform is Pohlen et al. 2018's): a scalar x is squashed with
h(x) = sign(x)(sqrt(|x| + 1) - 1) + eps x, then projected onto its two nearest
support points ("two-hot"), and a prediction is read back as h^-1 of the
expected support point. All functions are pure and unbatched unless they say
otherwise.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

EPS = 1e-3  # the transform's linear term: keeps h invertible and Lipschitz


def value_transform(x: jax.Array, eps: float = EPS) -> jax.Array:
    """h(x) = sign(x)(sqrt(|x| + 1) - 1) + eps x."""
    return jnp.sign(x) * (jnp.sqrt(jnp.abs(x) + 1.0) - 1.0) + eps * x


def inverse_value_transform(y: jax.Array, eps: float = EPS) -> jax.Array:
    """h^-1(y) = sign(y)(((sqrt(1 + 4 eps (|y| + 1 + eps)) - 1) / (2 eps))^2 - 1)."""
    root = (jnp.sqrt(1.0 + 4.0 * eps * (jnp.abs(y) + 1.0 + eps)) - 1.0) / (2.0 * eps)
    return jnp.sign(y) * (root ** 2 - 1.0)


def two_hot(y: jax.Array, support_size: int) -> jax.Array:
    """[..., 2S + 1]: `y` (transformed, clipped to [-S, S]) split between its two nearest integers.

    The weights are linear in the distance, so the expected support point is `y` itself.
    """
    y = jnp.clip(y, -support_size, support_size)
    low = jnp.floor(y)
    upper_weight = (y - low)[..., None]
    index = (low + support_size).astype(jnp.int32)
    atoms = 2 * support_size + 1
    # At y = S the upper index is past the support, where one_hot is all zeros and its weight 0.
    return (1.0 - upper_weight) * jax.nn.one_hot(index, atoms) + upper_weight * jax.nn.one_hot(index + 1, atoms)


def scalar_to_support(x: jax.Array, support_size: int) -> jax.Array:
    """The categorical target [..., 2S + 1] of a scalar value or reward: two_hot(h(x))."""
    return two_hot(value_transform(x), support_size)


def support_to_scalar(logits: jax.Array, support_size: int) -> jax.Array:
    """The scalar a categorical prediction [..., 2S + 1] stands for: h^-1 of its expected support point."""
    support = jnp.arange(-support_size, support_size + 1, dtype=jnp.float32)
    return inverse_value_transform(jnp.sum(jax.nn.softmax(logits) * support, axis=-1))


def support_limit(support_size: int, eps: float = EPS) -> float:
    """The largest |value| a support of -S..S holds: h^-1(S), in plain Python (configs check it before
    JAX starts)."""
    root = (math.sqrt(1.0 + 4.0 * eps * (support_size + 1.0 + eps)) - 1.0) / (2.0 * eps)
    return root ** 2 - 1.0


def support_needed(value: float, eps: float = EPS) -> int:
    """The smallest support size S whose -S..S holds |value|: ceil(h(|value|)), in plain Python."""
    value = abs(value)
    return math.ceil(math.sqrt(value + 1.0) - 1.0 + eps * value)


def n_step_targets(reward: jax.Array, terminated: jax.Array, truncated: jax.Array, value: jax.Array,
                   final_value: jax.Array, gamma: float, td_steps: int, num_targets: int) -> jax.Array:
    """[num_targets]: the n-step value target of each of the first `num_targets` rows of one sequence [L].

    z_k = sum_{i<m} gamma^i r_{k+i} + gamma^m v, over m = n steps, or fewer where
    the episode ends first: after a termination at row k+i nothing is added
    (m = i + 1, v = 0); after a truncation v is the value of the observation that
    ended it (`final_value[k+i]`); otherwise v = `value[k+n]`, the target
    network's value of the observation n rows on. Needs L >= num_targets + n.
    """
    discounts = gamma ** jnp.arange(td_steps, dtype=jnp.float32)
    done = jnp.logical_or(terminated, truncated).astype(jnp.float32)
    window = lambda x, k: jax.lax.dynamic_slice_in_dim(x, k, td_steps)

    def target(k):
        ended = window(done, k)
        # alive[i]: no episode ended in rows k..k+i-1, so row k+i still belongs to row k's episode.
        alive = jnp.cumprod(jnp.concatenate([jnp.ones(1), 1.0 - ended[:-1]]))
        rewards = jnp.sum(alive * discounts * window(reward, k))
        truncations = jnp.sum(alive * discounts * gamma * window(truncated.astype(jnp.float32), k)
                              * window(final_value, k))
        bootstrap = alive[-1] * (1.0 - ended[-1]) * gamma ** td_steps * value[k + td_steps]
        return rewards + truncations + bootstrap

    return jax.vmap(target)(jnp.arange(num_targets))
