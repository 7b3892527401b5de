"""The shape every evolution strategy here shares: `init / ask / tell`.

A strategy is three pure functions over a small state pytree (the evosax
interface, optax-style: functions are passed around, state holds arrays only).
Fitness is MAXIMISED throughout: higher is better.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import chex
import jax.numpy as jnp

from podracer.errors import PodracerError

InitFn = Callable[[chex.Array], Any]
AskFn = Callable[[Any, chex.PRNGKey, chex.Array], chex.Array]
TellFn = Callable[[Any, chex.PRNGKey, chex.Array], tuple[Any, dict[str, chex.Array]]]


class Perturbation(NamedTuple):
    """Antithetic pairs around one mean, unmaterialised.

    Pair `k` is members `2k` (`mean + scale * noise[k]`) and `2k + 1`
    (`mean - scale * noise[k]`): what `ask` returns for them, factored so that an
    evaluator can share work between members (every member's `x @ mean`, and one
    `x @ noise[k]` for both halves of a pair) instead of building each member's
    parameters.
    """

    mean: chex.Array  # [num_dims]
    scale: chex.Array  # scalar
    noise: Any  # [num_pairs, num_dims]; low-rank noise: per leaf (`es.low_rank_pair_factors`)


PerturbFn = Callable[[Any, chex.PRNGKey, chex.Array, int], Perturbation]


class Strategy(NamedTuple):
    """An evolution strategy over a flat float32 parameter vector.

    Attributes:
      init: `init(mean [num_dims]) -> state`.
      ask: `ask(state, key, member_indices [n]) -> params [n, num_dims]`: the
        perturbed parameters of just those members of the generation `key`;
        any device can call it for its own slice of the population.
      tell: `tell(state, key, fitness [population_size]) -> (state, metrics)`:
        the update from the whole generation's fitness (maximised), with the
        same `key` as `ask`. It regenerates every member's noise from `key`, so
        it needs the fitness scalars and nothing parameter-sized.
      population_size: members per generation (even: antithetic pairs).
      perturb: optional `perturb(state, key, first_pair, num_pairs) -> Perturbation`:
        the pairs `[first_pair, first_pair + num_pairs)` of the generation `key`,
        factored; member for member the parameters `ask` returns. `None` for a
        strategy whose members are not antithetic pairs around one mean.
    """

    init: InitFn
    ask: AskFn
    tell: TellFn
    population_size: int
    perturb: PerturbFn | None = None


def check_positive(value: float, name: str) -> None:
    """One-line error unless `value > 0`."""
    if not value > 0:
        raise PodracerError(f"{name} must be positive, got {value}")


def check_population(population_size: int) -> None:
    """Antithetic sampling needs an even population of at least one pair."""
    if population_size < 2 or population_size % 2:
        raise PodracerError(
            f"population_size={population_size} must be even and >= 2 (antithetic pairs); "
            f"use e.g. {max(2, population_size + population_size % 2)}"
        )


def fitness_metrics(fitness: chex.Array) -> dict[str, chex.Array]:
    """Summary of one generation's fitness vector (no communication needed)."""
    return {
        "fitness_mean": jnp.mean(fitness),
        "fitness_std": jnp.std(fitness),
        "fitness_max": jnp.max(fitness),
        "fitness_min": jnp.min(fitness),
    }
