"""Anakin populations: their agents' inputs, and ES populations.

An agent on the contract (`podracer.agent`) gets its population from Anakin's
one builder (`podracer.anakin.loop.make_programs`). ES runs its own program
(`podracer.anakin.es`): each agent is an `ESRunner` with its swept settings
(`podracer.population`) as traced scalars beside it, vmapped over the agents,
replicated, each generation's members split over the devices as for one agent.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import flax.linen as nn

from podracer.envs.jax_envs import GymnaxEnv
from podracer.anakin.es import ESPhases, ESRunner, _make_step, make_anakin_es_phases
from podracer.normalize import RunningStats
from podracer import population
from podracer.protocol import parallel


def agent_inputs(members: list[population.Agent]) -> tuple[jax.Array, dict]:
    """What a population's `init` takes: each agent's key (from its seed) and swept settings, stacked [A]."""
    keys = jnp.stack([jax.random.PRNGKey(m.seed) for m in members])
    return keys, {k: jnp.asarray(v) for k, v in population.hyperparameters(members).items()}


class ESPopulationRunner(NamedTuple):
    """An `ESRunner` per agent, stacked on a leading axis [A, ...], and the agents' swept settings."""

    strategy: Any
    obs_stats: RunningStats
    key: jax.Array
    hparams: dict  # swept setting -> [A] float32


def make_anakin_es_population(env: GymnaxEnv, policy: nn.Module, config_for: Callable, mesh: Mesh):
    """Jitted `init(keys [A], hparams) -> runner` and `step(runner) -> (runner, metrics [A, ...])`.

    Every agent runs `make_anakin_es`'s step with the ES config `config_for(hparams)`
    (its swept settings traced), vmapped over the agents; each generation's
    population is split over the devices as for one agent.
    """
    parts, _ = _make_step(env, policy, config_for({}), mesh)

    def init(keys, hparams):
        # One agent after the other: batched initialisers' QR runs as a parallel map on
        # XLA:CPU's thread pool, which can deadlock with several devices' programs.
        return ESPopulationRunner(*jax.lax.map(parts.init, keys), hparams)

    def step(runner: ESPopulationRunner):
        def one(agent, hparams):
            return _make_step(env, policy, config_for(hparams), mesh)[1](agent)

        agents, metrics = jax.vmap(one)(ESRunner(runner.strategy, runner.obs_stats, runner.key),
                                        runner.hparams)
        return ESPopulationRunner(*agents, runner.hparams), metrics

    everywhere = parallel.replicated(mesh)
    return (jax.jit(init, out_shardings=everywhere, compiler_options=parallel.run_once_options(mesh)),
            jax.jit(step, in_shardings=everywhere, out_shardings=everywhere, donate_argnums=0))


def make_anakin_es_population_phases(env: GymnaxEnv, policy: nn.Module, config_for: Callable,
                                     mesh: Mesh) -> ESPhases:
    """`make_anakin_es_phases` for every agent at once (profile mode), each phase vmapped.

    Each phase takes the agents' swept settings first, `phase(hparams, *args)`,
    every argument and result with a leading agent axis; run in order they
    compute what `make_anakin_es_population`'s fused step computes.
    """
    everywhere = parallel.replicated(mesh)

    def vmapped(name: str):
        def run(hparams, *args):
            def one(hparams, *args):
                return getattr(make_anakin_es_phases(env, policy, config_for(hparams), mesh), name)(*args)

            return jax.vmap(one)(hparams, *args)

        return jax.jit(run, in_shardings=everywhere, out_shardings=everywhere)

    return ESPhases(*(vmapped(name) for name in ESPhases._fields))
