"""Anakin populations: many agents (actor-critic or ES) vmapped inside the one sharded program.

Every agent is a `RunnerState` of its own (key, parameters, optimizer state,
environments), stacked along a leading agent axis, with its swept settings
(`podracer.population`) as traced scalars beside it. The per-device program
vmaps one agent's `updates_per_call` updates (the `_make_steps` of
`podracer.anakin.loop`, unchanged) over the agents. When the number of agents
is a multiple of the device count, agents are split over the devices (each
device steps all environments of its agents, and no collective runs);
otherwise every device holds every agent and the environments are split as for
one agent, gradients averaged with `pmean`. ES agents are replicated, each
generation's members split over the devices as for one agent.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

import flax.linen as nn

from podracer.anakin.env import GymnaxEnv
from podracer.anakin.es import ESPhases, ESRunner, _make_step, make_anakin_es_phases
from podracer.anakin.loop import AnakinConfig, Experience, RunnerState
from podracer.normalize import RunningStats
from podracer import population
from podracer.protocol import parallel


def agent_inputs(members: list[population.Agent]) -> tuple[jax.Array, dict]:
    """What a population's `init` takes: each agent's key (from its seed) and swept settings, stacked [A]."""
    keys = jnp.stack([jax.random.PRNGKey(m.seed) for m in members])
    return keys, {k: jnp.asarray(v) for k, v in population.hyperparameters(members).items()}


class PopulationRunner(NamedTuple):
    """A `RunnerState` per agent, stacked on a leading axis [A, ...], and the agents' swept settings."""

    train: Any  # TrainState [A, ...]
    env_state: Any  # [A, num_envs, ...]
    obs: Any  # [A, num_envs, ...]
    key: Any  # [A, ...]
    carry: Any  # a recurrent network's state [A, num_envs, ...]; () for a feed-forward one
    hparams: dict  # swept setting -> [A] float32


StepsFor = Callable[[dict, bool], tuple]  # (hparams, agents_sharded) -> loop._make_steps(...)


def _specs(sharded: bool):
    """Runner, experience and metrics specs: the agent axis split over devices, or not."""
    if sharded:
        agents = P(parallel.DATA_AXIS)
        return (PopulationRunner(agents, agents, agents, agents, agents, agents),
                Experience(agents, agents, agents, agents, agents), agents)
    envs = P(None, parallel.DATA_AXIS)
    return (PopulationRunner(P(), envs, envs, P(), envs, P()),
            Experience(P(None, None, parallel.DATA_AXIS), envs, P(), P(), envs), P())


def _agent(runner: PopulationRunner) -> RunnerState:
    return RunnerState(runner.train, runner.env_state, runner.obs, runner.key, runner.carry)


def make_anakin_population(steps_for: StepsFor, config: AnakinConfig, mesh: Mesh, sharded: bool):
    """Jitted `init(keys [A], hparams) -> runner` and `train(runner) -> (runner, metrics [U, A, ...])`.

    `steps_for(hparams, sharded)` builds one agent's per-device `init, act,
    learn, axes` with its settings (traced scalars inside the program).
    Metrics come out update-major, as each agent's scan stacks them: agent-major,
    XLA:CPU would transpose every metric into a copy kernel of its own, whose
    fully unrolled loop took longer to compile than most of the program (86 ms
    for a [8, 122] one).
    """
    runner_specs, _, agent_metric_specs = _specs(sharded)
    metric_specs = P(None, *agent_metric_specs)  # [U, A, ...]: the updates' axis before the agents'
    init_one = steps_for({}, sharded)[0]
    axes = steps_for({}, sharded)[3]

    def init(keys, hparams):
        # One agent after the other, not vmapped: the orthogonal initialisers' QR
        # factorisations, batched, run as a parallel map on XLA:CPU's thread pool,
        # which deadlocked with several devices' programs holding its threads.
        agents = jax.lax.map(init_one, keys)
        return PopulationRunner(*agents, hparams)

    def train_agent(runner: RunnerState, hparams):
        _, act, learn, _ = steps_for(hparams, sharded)

        def train_step(runner, _):
            runner, experience = act(runner)
            train, metrics = learn(runner.train, experience)
            return runner._replace(train=train), metrics

        return jax.lax.scan(train_step, runner, length=config.updates_per_call)

    def train(runner: PopulationRunner):
        agents, metrics = jax.vmap(train_agent, out_axes=(0, 1))(_agent(runner), runner.hparams)
        return PopulationRunner(*agents, runner.hparams), metrics

    check = bool(axes)  # agents split over devices: no collective, nothing to prove
    key_spec = runner_specs.key
    init_sharded = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=(key_spec, runner_specs.hparams),
                                         out_specs=runner_specs, check_vma=check),
                           compiler_options=parallel.run_once_options(mesh))
    train_sharded = jax.jit(jax.shard_map(train, mesh=mesh, in_specs=(runner_specs,),
                                          out_specs=(runner_specs, metric_specs), check_vma=check),
                            donate_argnums=0, compiler_options=parallel.actor_critic_options(mesh))
    return init_sharded, train_sharded


def make_anakin_population_phases(steps_for: StepsFor, mesh: Mesh, sharded: bool):
    """One update of every agent as two programs (profile mode): `act` and `learn`, each vmapped.

    `act(runner) -> (runner, (experience, hparams))`; `learn(train, (experience,
    hparams)) -> (train, metrics)`: the shapes `podracer.anakin.profiled` expects.
    """
    runner_specs, experience_specs, metric_specs = _specs(sharded)
    axes = steps_for({}, sharded)[3]
    check = bool(axes)  # agents split over devices: no collective, nothing to prove

    def act(runner: PopulationRunner):
        def one(agent, hparams):
            return steps_for(hparams, sharded)[1](agent)

        agents, experience = jax.vmap(one)(_agent(runner), runner.hparams)
        return PopulationRunner(*agents, runner.hparams), (experience, runner.hparams)

    def learn(train, experience_and_hparams):
        experience, hparams = experience_and_hparams

        def one(train, experience, hparams):
            return steps_for(hparams, sharded)[2](train, experience)

        return jax.vmap(one)(train, experience, hparams)

    carried = (experience_specs, runner_specs.hparams)
    act_sharded = jax.jit(jax.shard_map(act, mesh=mesh, in_specs=(runner_specs,),
                                        out_specs=(runner_specs, carried), check_vma=check),
                          compiler_options=parallel.actor_critic_options(mesh))
    learn_sharded = jax.jit(jax.shard_map(learn, mesh=mesh, in_specs=(runner_specs.train, carried),
                                          out_specs=(runner_specs.train, metric_specs), check_vma=check),
                            compiler_options=parallel.actor_critic_options(mesh))
    return act_sharded, learn_sharded


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
