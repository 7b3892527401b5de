"""Evolution strategies: OpenAI-ES and ARS as pure `init / ask / tell`, and their protocol.

Fitness is MAXIMISED everywhere. Parameters are one flat float32 vector; flatten
a network's parameters with `jax.flatten_util.ravel_pytree`:

    flat, unravel = ravel_pytree(params)
    strategy = es.make_openai_es(64, sigma=0.05, optimizer=optax.adam(1e-2))
    state = strategy.init(flat)
    members = jnp.arange(strategy.population_size)
    population = strategy.ask(state, key, members)  # [64, num_dims]
    fitness = jax.vmap(lambda p: episode_return(unravel(p)))(population)
    state, metrics = strategy.tell(state, key, fitness)  # same key as `ask`

Over a mesh: `step = es.make_sharded_step(strategy, fitness_fn, mesh)`. From
settings: `strategy = es.make_strategy(es.ESConfig(variant="ars_v1"))`. ES as an agent on
the contract is `es.make_agent` (`podracer.es.agent`): Anakin's one program builder
(`podracer.anakin.loop.make_programs`) runs it on gymnax rollouts over every device; Sebulba ES
(envpool actor threads) is `podracer.sebulba.train_es.train_es`.
"""

from podracer.es.agent import ESState, make_agent
from podracer.es.ars import ARSState, ars_step, make_ars
from podracer.es.config import VARIANTS, ESConfig, make_strategy
from podracer.es.noise import (
    LowRank,
    all_pair_noise,
    antithetic_sign,
    flatten_factors,
    low_rank_pair_factors,
    low_rank_pair_noise,
    member_noise,
    pair_noise,
    population_noise,
    split_pairs,
)
from podracer.es.openai_es import OpenAIESState, centred_ranks, make_openai_es, openai_es_gradient
from podracer.es.sharded import make_sharded_phases, make_sharded_step, make_sharded_step_normalized
from podracer.es.strategy import Perturbation, Strategy, fitness_metrics

# ARS V2's observation statistics are the package-wide ones PPO also uses.
from podracer.normalize import (
    RunningStats,
    ars_normalize,
    init_running_stats,
    merge_stats,
    observation_stats,
    psum_stats,
    reduce_stats,
)

__all__ = (
    "ARSState",
    "ESConfig",
    "ESState",
    "OpenAIESState",
    "RunningStats",
    "LowRank",
    "Perturbation",
    "Strategy",
    "VARIANTS",
    "all_pair_noise",
    "antithetic_sign",
    "ars_normalize",
    "ars_step",
    "centred_ranks",
    "fitness_metrics",
    "init_running_stats",
    "make_agent",
    "make_ars",
    "make_openai_es",
    "flatten_factors",
    "low_rank_pair_factors",
    "low_rank_pair_noise",
    "make_sharded_phases",
    "make_sharded_step",
    "make_sharded_step_normalized",
    "make_strategy",
    "member_noise",
    "merge_stats",
    "observation_stats",
    "openai_es_gradient",
    "pair_noise",
    "population_noise",
    "psum_stats",
    "reduce_stats",
    "split_pairs",
)
