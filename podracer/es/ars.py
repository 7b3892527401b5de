"""Augmented Random Search (Mania, Guy & Recht 2018, arXiv:1803.07055).

Basic random search on the parameters with three augmentations: the step is
scaled by the standard deviation of the returns used (V1), only the `b` best of
the `N` directions are used (V1-t / V2-t), and observations are normalised by a
running mean and variance (V2; see `podracer.normalize`). The update here is
the same for V1 and V2: V2 is V1 with the policy reading
`ars_normalize(obs_stats, obs)` instead of `obs`. Fitness is MAXIMISED.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from podracer.es.noise import all_pair_noise, pair_noise, population_noise, split_pairs
from podracer.es.strategy import Perturbation, Strategy, check_positive, fitness_metrics
from podracer.errors import PodracerError


class ARSState(NamedTuple):
    """Mean of the linear (or any flat) policy's parameters."""

    mean: chex.Array  # [num_dims] float32
    generation: chex.Array  # int32 scalar


def ars_step(
    key: chex.PRNGKey, fitness: chex.Array, top_directions: int, step_size: float, num_dims: int
) -> tuple[chex.Array, chex.Array]:
    """ARS update of the mean (Mania et al. 2018, Algorithm 2, step 7), for ASCENT.

        step = alpha / (b sigma_R) * sum_{k in top b} (r_{k,+} - r_{k,-}) delta_k

    where directions are ranked by `max(r_{k,+}, r_{k,-})` and `sigma_R` is the
    (population) standard deviation of the `2b` returns of the kept directions.
    There is no division by the exploration noise `nu`, as in the paper. When
    all kept returns are equal (`sigma_R = 0`) the step is zero.

    Args:
      key: the generation key given to `ask`; `delta_k = pair_noise(key, k)`.
      fitness: [2N] returns in member order: member 2k is `+delta_k`, 2k+1 `-delta_k`.
      top_directions: b, with 1 <= b <= N.
      step_size: alpha.
      num_dims: parameter count.

    Returns:
      ([num_dims] step to ADD to the mean, sigma_R).
    """
    chex.assert_rank(fitness, 1)
    returns_plus, returns_minus = split_pairs(fitness)
    _, top = jax.lax.top_k(jnp.maximum(returns_plus, returns_minus), top_directions)
    kept_plus, kept_minus = returns_plus[top], returns_minus[top]
    returns_std = jnp.std(jnp.concatenate([kept_plus, kept_minus]))
    deltas = jax.vmap(pair_noise, in_axes=(None, 0, None))(key, top, num_dims)
    direction = (kept_plus - kept_minus) @ deltas
    scale = jnp.where(returns_std > 0, step_size / (top_directions * returns_std), 0.0)
    return scale * direction, returns_std


def make_ars(num_directions: int, top_directions: int, step_size: float, sigma: float) -> Strategy:
    """ARS as `init / ask / tell` over a flat float32 parameter vector.

    A generation has `2 * num_directions` members: member `2k` evaluates
    `mean + sigma * delta_k` and member `2k + 1` evaluates `mean - sigma * delta_k`
    (`sigma` is the paper's exploration noise `nu`). `tell` adds `ars_step` to the
    mean: plain gradient ascent, as in the paper, so there is no optimizer.
    `top_directions == num_directions` gives ARS V1/V2; fewer gives V1-t/V2-t.

    Args:
      num_directions: N, directions sampled per generation.
      top_directions: b, directions kept for the update (1 <= b <= N).
      step_size: alpha.
      sigma: nu, the exploration noise.

    Returns:
      A `Strategy` whose state is an `ARSState`; population is `2 * num_directions`.
    """
    if num_directions < 1:
        raise PodracerError(f"num_directions must be >= 1, got {num_directions}")
    if not 1 <= top_directions <= num_directions:
        raise PodracerError(
            f"top_directions={top_directions} must be between 1 and num_directions={num_directions}"
        )
    check_positive(step_size, "step_size")
    check_positive(sigma, "sigma")
    population_size = 2 * num_directions

    def init(mean: chex.Array) -> ARSState:
        chex.assert_rank(mean, 1)
        return ARSState(jnp.asarray(mean, jnp.float32), jnp.zeros((), jnp.int32))

    def ask(state: ARSState, key: chex.PRNGKey, member_indices: chex.Array) -> chex.Array:
        return state.mean + sigma * population_noise(key, member_indices, state.mean.shape[0])

    def tell(state: ARSState, key: chex.PRNGKey, fitness: chex.Array):
        chex.assert_shape(fitness, (population_size,))
        step, returns_std = ars_step(key, fitness, top_directions, step_size, state.mean.shape[0])
        metrics = fitness_metrics(fitness) | {
            "returns_std": returns_std,
            "update_norm": jnp.linalg.norm(step),
        }
        return ARSState(state.mean + step, state.generation + 1), metrics

    def perturb(state: ARSState, key: chex.PRNGKey, first_pair, num_pairs: int) -> Perturbation:
        noise = all_pair_noise(key, num_pairs, state.mean.shape[0], first_pair)
        return Perturbation(state.mean, jnp.asarray(sigma, jnp.float32), noise)

    return Strategy(init, ask, tell, population_size, perturb)
