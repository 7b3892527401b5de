"""Antithetic Gaussian noise that any device can regenerate from an index.

Member `i` of a generation perturbs the mean by `sign(i) * eps_{i // 2}`, with
`eps_k ~ N(0, I)` drawn from `fold_in(key, k)` and `sign(i) = +1` for even `i`,
`-1` for odd `i`. Members `2k` and `2k + 1` are therefore an antithetic pair
(mirrored sampling, Salimans et al. 2017; Mania et al. 2018), and a device that
holds members `[i0, i0 + n)` draws exactly their noise from the shared
generation key, without ever receiving a parameter-sized perturbation.

Low-rank noise (`low_rank_pair_factors`) replaces each matrix's `eps` by a
rank-`r` product of Gaussian factors; an evaluator that knows the factors
computes `x @ eps` as `(x @ A) @ B^T`.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import chex
import jax
import jax.numpy as jnp


def pair_noise(key: chex.PRNGKey, pair_index: chex.Numeric, num_dims: int) -> chex.Array:
    """`eps_k ~ N(0, I)` of antithetic pair `k`: float32 `[num_dims]`."""
    return jax.random.normal(jax.random.fold_in(key, pair_index), (num_dims,), jnp.float32)


def antithetic_sign(member_index: chex.Numeric) -> chex.Array:
    """`+1.` for even members (the `+eps` half of a pair), `-1.` for odd ones."""
    return 1.0 - 2.0 * jnp.asarray(member_index % 2, jnp.float32)


def member_noise(key: chex.PRNGKey, member_index: chex.Numeric, num_dims: int) -> chex.Array:
    """Unit perturbation of one member: `sign(i) * eps_{i // 2}`, float32 `[num_dims]`."""
    return antithetic_sign(member_index) * pair_noise(key, member_index // 2, num_dims)


def population_noise(key: chex.PRNGKey, member_indices: chex.Array, num_dims: int) -> chex.Array:
    """Unit perturbations of the members `member_indices` ([n] ints): `[n, num_dims]`.

    Equal to `member_noise` of each index. When the indices are one contiguous
    block (what a device of the sharded step asks for), both members of a pair
    share one draw: `n / 2 + 1` draws instead of `n`, and drawing the noise is
    most of the cost of `ask`. Any other indices take the general path.
    """
    chex.assert_rank(member_indices, 1)
    count = member_indices.shape[0]

    def each_member(key):
        return jax.vmap(member_noise, in_axes=(None, 0, None))(key, member_indices, num_dims)

    def contiguous_block(key):
        pairs = member_indices // 2
        first_pair = pairs[0]
        block = all_pair_noise(key, count // 2 + 1, num_dims, first_pair)
        return antithetic_sign(member_indices)[:, None] * block[pairs - first_pair]

    if count < 2:
        return each_member(key)
    contiguous = jnp.all(jnp.diff(member_indices) == 1)
    return jax.lax.cond(contiguous, contiguous_block, each_member, key)


def all_pair_noise(
    key: chex.PRNGKey, num_pairs: int, num_dims: int, first_pair: chex.Numeric = 0
) -> chex.Array:
    """`eps_k` of the pairs `first_pair <= k < first_pair + num_pairs`: `[num_pairs, num_dims]`."""
    pairs = first_pair + jnp.arange(num_pairs)
    return jax.vmap(pair_noise, in_axes=(None, 0, None))(key, pairs, num_dims)


def split_pairs(member_values: chex.Array) -> tuple[chex.Array, chex.Array]:
    """`[2P]` per-member values -> (`+eps` halves `[P]`, `-eps` halves `[P]`)."""
    chex.assert_rank(member_values, 1)
    return member_values[0::2], member_values[1::2]


class LowRank(NamedTuple):
    """A matrix perturbation `a @ b.T` (`a` [m, r] already scaled by `1 / sqrt(r)`, `b` [n, r])."""

    a: chex.Array
    b: chex.Array


def low_rank_pair_factors(key: chex.PRNGKey, pair_index: chex.Numeric,
                          shapes: Sequence[tuple[int, ...]], rank: int) -> list:
    """`eps_k` of antithetic pair `k`, leaf by leaf, with rank-`rank` matrices.

    The parameters are the leaves `shapes` (in `ravel_pytree` order). A matrix
    leaf `[m, n]` gets `A B^T / sqrt(r)` with `A` [m, r] and `B` [n, r] standard
    normal (EGGROLL-style low-rank perturbations: every entry still has unit
    variance, entries of a matrix are correlated), as a `LowRank(A / sqrt(r),
    B)`; any other leaf a standard normal array of its shape. Drawn from
    `fold_in(fold_in(key, k), leaf)`: any device regenerates any pair.
    """
    pair_key = jax.random.fold_in(key, pair_index)
    factors = []
    for leaf, shape in enumerate(shapes):
        leaf_key = jax.random.fold_in(pair_key, leaf)
        if len(shape) == 2:
            m, n = shape
            draws = jax.random.normal(leaf_key, ((m + n) * rank,), jnp.float32)
            a = draws[: m * rank].reshape(m, rank) / math.sqrt(rank)
            factors.append(LowRank(a, draws[m * rank:].reshape(n, rank)))
        else:
            factors.append(jax.random.normal(leaf_key, shape, jnp.float32))
    return factors


def flatten_factors(factors: list) -> chex.Array:
    """The flat `[num_dims]` vector the leaf-by-leaf noise stands for (`ravel_pytree` order)."""
    return jnp.concatenate([(f.a @ f.b.T if isinstance(f, LowRank) else f).reshape(-1) for f in factors])


def low_rank_pair_noise(key: chex.PRNGKey, pair_index: chex.Numeric,
                        shapes: Sequence[tuple[int, ...]], rank: int) -> chex.Array:
    """`low_rank_pair_factors` of pair `k` as one flat float32 `[num_dims]` vector."""
    return flatten_factors(low_rank_pair_factors(key, pair_index, shapes, rank))
