"""OpenAI-ES (Salimans, Ho, Chen, Sidor & Sutskever 2017, arXiv:1703.03864).

Natural-evolution-strategy gradient of the Gaussian-smoothed fitness, with
antithetic pairs, centred-rank fitness shaping and L2 weight decay on the mean,
stepped by any optax optimizer. Fitness is MAXIMISED.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax.numpy as jnp
import optax

import jax

from podracer.es.noise import (LowRank, all_pair_noise, antithetic_sign, low_rank_pair_factors,
                               low_rank_pair_noise, population_noise, split_pairs)
from podracer.es.strategy import Perturbation, Strategy, check_population, check_positive, fitness_metrics
from podracer.errors import PodracerError


class OpenAIESState(NamedTuple):
    """Search distribution `N(mean, sigma^2 I)` and the optimizer stepping its mean."""

    mean: chex.Array  # [num_dims] float32
    opt_state: optax.OptState
    generation: chex.Array  # int32 scalar


def centred_ranks(fitness: chex.Array) -> chex.Array:
    """Centred-rank fitness shaping (Salimans et al. 2017, sec. 2.2).

        u_i = rank(F_i) / (n - 1) - 1/2,   rank in {0, ..., n - 1}

    so the worst member gets -1/2 and the best +1/2, whatever the fitness scale.
    Tied members share their mean rank, so a generation of equal fitness gives
    all-zero weights (and a zero gradient) rather than an arbitrary one.

    Args:
      fitness: [n] fitness of every member, higher is better; n >= 2.

    Returns:
      [n] float32 shaped fitness in [-1/2, 1/2], summing to zero.
    """
    chex.assert_rank(fitness, 1)
    n = fitness.shape[0]
    sorted_fitness = jnp.sort(fitness)
    below = jnp.searchsorted(sorted_fitness, fitness, side="left")
    below_or_tied = jnp.searchsorted(sorted_fitness, fitness, side="right")
    ranks = (below + below_or_tied - 1).astype(jnp.float32) / 2.0
    return ranks / (n - 1) - 0.5


def openai_es_gradient(
    key: chex.PRNGKey, shaped_fitness: chex.Array, sigma: float, num_dims: int
) -> chex.Array:
    """Search-gradient estimate of the smoothed fitness, for ASCENT.

        g = 1 / (n sigma) * sum_i u_i eps_i
          = 1 / (n sigma) * sum_k (u_{2k} - u_{2k+1}) eps_k     (antithetic pairs)

    with `eps_i = member_noise(key, i, num_dims)`. Every device regenerates the
    `n / 2` pair directions from `key`; only the `[n]` weights are needed.

    Args:
      key: the generation key given to `ask`.
      shaped_fitness: [n] weights u_i, in member order (n even).
      sigma: perturbation scale.
      num_dims: parameter count.

    Returns:
      [num_dims] float32 estimate of grad_mean E[F(mean + sigma eps)].
    """
    chex.assert_rank(shaped_fitness, 1)
    weight_plus, weight_minus = split_pairs(shaped_fitness)
    eps = all_pair_noise(key, weight_plus.shape[0], num_dims)
    return (weight_plus - weight_minus) @ eps / (shaped_fitness.shape[0] * sigma)


def low_rank_gradient(key: chex.PRNGKey, shaped_fitness: chex.Array, sigma: float,
                      shapes, rank: int) -> chex.Array:
    """`openai_es_gradient` for low-rank pair noise (`low_rank_pair_factors`).

    The same estimate, `1 / (n sigma) sum_k (u_{2k} - u_{2k+1}) eps_k`, summed
    leaf by leaf from the factors: a matrix's `sum_k w_k A_k B_k^T` is one
    `[m, P r] @ [P r, n]` product, never the `P` dense perturbations.
    """
    weight_plus, weight_minus = split_pairs(shaped_fitness)
    weights = (weight_plus - weight_minus) / (shaped_fitness.shape[0] * sigma)
    pairs = jnp.arange(weights.shape[0])
    factors = jax.vmap(lambda k: low_rank_pair_factors(key, k, shapes, rank))(pairs)
    parts = []
    for f in factors:
        if isinstance(f, LowRank):  # a [P, m, r], b [P, n, r]
            parts.append(jnp.einsum("p,pmr,pnr->mn", weights, f.a, f.b).reshape(-1))
        else:
            parts.append((weights @ f.reshape(f.shape[0], -1)))
    return jnp.concatenate(parts)


def make_openai_es(
    population_size: int,
    sigma: float,
    optimizer: optax.GradientTransformation,
    weight_decay: float = 0.0,
    low_rank: int = 0,
    param_shapes=None,
) -> Strategy:
    """OpenAI-ES as `init / ask / tell` over a flat float32 parameter vector.

    Member `i` evaluates `mean + sigma * eps_i` (antithetic: eps_{2k+1} = -eps_{2k}).
    `tell` shapes the fitness with `centred_ranks`, estimates the ascent
    direction `g` (`openai_es_gradient`) and, because optax MINIMISES while ES
    MAXIMISES fitness, feeds the optimizer the gradient of the loss
    `-F(mean) + weight_decay / 2 * ||mean||^2`, i.e.

        optimizer.update(-g + weight_decay * mean)

    as in the reference implementation (`l2coeff`). With `optax.sgd(lr)` the
    mean moves by `lr * (g - weight_decay * mean)`.

    Args:
      population_size: members per generation; even (antithetic pairs).
      sigma: standard deviation of the perturbations.
      optimizer: any optax transformation, e.g. `optax.adam(1e-2)`.
      weight_decay: L2 coefficient on the mean (0 disables it).
      low_rank: 0 for full-rank Gaussian noise (the paper's). `r > 0` draws each
        matrix's perturbation as a rank-`r` product `A B^T / sqrt(r)` of Gaussian
        factors (`es.low_rank_pair_factors`; EGGROLL-style low-rank evolution
        strategies), other parameters full rank: a different search
        distribution, which an evaluator that knows the factors (Anakin ES's
        pair path) applies at a fraction of the cost.
      param_shapes: with `low_rank`, the shapes of the parameter leaves in
        `ravel_pytree` order (which leaves are matrices).

    Returns:
      A `Strategy` whose state is an `OpenAIESState`.
    """
    check_population(population_size)
    check_positive(sigma, "sigma")
    if weight_decay < 0:
        raise PodracerError(f"weight_decay must be >= 0, got {weight_decay}")
    if low_rank < 0:
        raise PodracerError(f"low_rank must be >= 0, got {low_rank}")
    if low_rank and param_shapes is None:
        raise PodracerError("low-rank noise needs the parameters' shapes (param_shapes=...)")
    shapes = None if param_shapes is None else [tuple(int(d) for d in s) for s in param_shapes]

    def member_noise_of(key, member_indices, num_dims):
        if not low_rank:
            return population_noise(key, member_indices, num_dims)
        pair = jax.vmap(lambda k: low_rank_pair_noise(key, k, shapes, low_rank))(member_indices // 2)
        return antithetic_sign(member_indices)[:, None] * pair

    def init(mean: chex.Array) -> OpenAIESState:
        chex.assert_rank(mean, 1)
        mean = jnp.asarray(mean, jnp.float32)
        return OpenAIESState(mean, optimizer.init(mean), jnp.zeros((), jnp.int32))

    def ask(state: OpenAIESState, key: chex.PRNGKey, member_indices: chex.Array) -> chex.Array:
        noise = member_noise_of(key, member_indices, state.mean.shape[0])
        return state.mean + sigma * noise

    def tell(state: OpenAIESState, key: chex.PRNGKey, fitness: chex.Array):
        chex.assert_shape(fitness, (population_size,))
        shaped = centred_ranks(fitness)
        if low_rank:
            ascent = low_rank_gradient(key, shaped, sigma, shapes, low_rank)
        else:
            ascent = openai_es_gradient(key, shaped, sigma, state.mean.shape[0])
        loss_gradient = -ascent + weight_decay * state.mean
        updates, opt_state = optimizer.update(loss_gradient, state.opt_state, state.mean)
        mean = optax.apply_updates(state.mean, updates)
        metrics = fitness_metrics(fitness) | {
            "gradient_norm": jnp.linalg.norm(ascent),
            "update_norm": jnp.linalg.norm(updates),
        }
        return OpenAIESState(mean, opt_state, state.generation + 1), metrics

    def perturb(state: OpenAIESState, key: chex.PRNGKey, first_pair, num_pairs: int) -> Perturbation:
        if low_rank:  # leaf by leaf, matrices as factors
            pairs = first_pair + jnp.arange(num_pairs)
            noise = jax.vmap(lambda k: low_rank_pair_factors(key, k, shapes, low_rank))(pairs)
        else:
            noise = all_pair_noise(key, num_pairs, state.mean.shape[0], first_pair)
        return Perturbation(state.mean, jnp.asarray(sigma, jnp.float32), noise)

    return Strategy(init, ask, tell, population_size, perturb)
