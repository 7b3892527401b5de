"""Anakin ES: what is its own (the population's jitted generations, its log row and summary keys).

The host sequence is the run session's (`podracer.session.session`), the call
loop Anakin's (`podracer.anakin.calls`).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import jax

from podracer.anakin.calls import Calls, Init, Program, open_with_programs, run_calls
from podracer.envs.jax_envs import make_env
from podracer import population
from podracer.envs.spec import check_masked_inputs
from podracer.anakin.es import make_anakin_es, make_anakin_es_phases, make_es_layout
from podracer.anakin.population import agent_inputs, make_anakin_es_population, make_anakin_es_population_phases
from podracer.acting import es_policy
from podracer.anakin.profiled import NOTE, compile_es_phases, make_profiled_es_step
from podracer.es.metrics import ES_FIX, es_row
from podracer.networks import make_policy_network
from podracer.protocol import parallel
from podracer.session.session import RunSession, placed_for

if TYPE_CHECKING:  # the command line's run spec, built above this layer
    from podracer.orchestrate.spec import RunSpec


def build(configs: RunSpec, devices=None, profile: bool = False) -> Program:
    """Environment, sizes, the jitted `init`/`step` and, to profile, the step's phases."""
    run, es_config, net = configs.run, configs.agent, configs.network
    env = make_env(run.env)
    mesh = parallel.make_mesh(devices)
    layout = make_es_layout(es_config, env, mesh)
    steps_per_call = layout.steps_per_generation * es_config.generations_per_call
    num_calls = max(1, math.ceil(run.total_steps / steps_per_call))
    check_masked_inputs(env.spec, es_config.normalize_observations)
    policy = make_policy_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete,
                                 net.hidden, net.activation, env.spec.action_mask)
    if population.is_population(configs):
        # One agent's step with its settings, vmapped over the agents (and so are the phases).
        members = population.agents(configs)
        config_for = lambda hparams: population.configs_for(configs, hparams).agent
        init, step = make_anakin_es_population(env, policy, config_for, mesh)
        keys, hparams = agent_inputs(members)
        phases = make_anakin_es_population_phases(env, policy, config_for, mesh) if profile else None
        return Program(env, policy, layout, Calls(0, num_calls, steps_per_call),
                       Init(init, lambda _key: (keys, hparams)), step, phases)
    init, step = make_anakin_es(env, policy, es_config, mesh)
    phases = make_anakin_es_phases(env, policy, es_config, mesh) if profile else None
    return Program(env, policy, layout, Calls(0, num_calls, steps_per_call), Init.of_key(init), step, phases)


def train_es(configs: RunSpec, devices=None):
    """Train a policy with evolution strategies on Anakin; returns (summary, final runner).

    `configs` is the run's `RunSpec` (`podracer.orchestrate.cli.parse_configs`). A run
    directory with a checkpoint resumes from it.

    `env_steps` counts the steps the population simulates (`population *
    episodes_per_member * horizon` per generation, steps after an episode's end
    included: they are computed and masked); the evaluation episodes of the mean
    parameters are extra and not counted. `episode_return_mean` is the mean
    fitness of the population over the call's generations, `mean_params_return`
    the return of the mean parameters after the call. With `--profile`, the
    step's phases run as separate programs, timed apart
    (`podracer.anakin.profiled`).
    """
    session = RunSession(configs)
    run, es_config = configs.run, configs.agent
    generations_per_call = es_config.generations_per_call
    built = build(configs, devices, profile=session.profiler is not None)
    runner, meta, step, compile_s = open_with_programs(session, built, run.seed)
    calls = built.calls._replace(start=int(meta.get("calls", 0)))
    members = population.agents(configs)
    pop_log = (session.population_log(members, "mean_params_return")
               if population.is_population(configs) else None)
    if session.profiler:
        compile_start = time.perf_counter()
        hparams = runner.hparams if pop_log is not None else None
        step = make_profiled_es_step(compile_es_phases(built.phases, runner, hparams), session.measure,
                                     agents=pop_log is not None)
        compile_s += time.perf_counter() - compile_start
    else:
        runner = placed_for(step, runner)
    session.start(calls.total * calls.steps_per_call, compile_s)
    last_row: dict = {}

    def record(call: int, metrics) -> None:
        if pop_log is None:
            row = es_row(metrics)
        else:
            host = parallel.to_host(metrics)
            row = pop_log.row([es_row(jax.tree.map(lambda x: x[i], host)) for i in range(len(members))])
        done, elapsed = call + 1 - calls.start, session.elapsed()
        generations = (call + 1) * generations_per_call
        env_steps = (call + 1) * calls.steps_per_call
        session.check_finite(row.pop("finite"), f"generation {generations}", env_steps, ES_FIX)
        row.update(env_steps=env_steps, generations=generations,
                   sps=done * calls.steps_per_call / elapsed,
                   generations_per_s=done * generations_per_call / elapsed)
        if pop_log is not None:
            row["population_sps"] = row["sps"] * len(members)
        session.log(row)
        last_row.update(row)

    outcome = run_calls(session, step, runner, calls, record, NOTE if session.profiler else None)
    new_calls = outcome.calls - calls.start
    strategy = outcome.runner.strategy
    summary = session.finish(
        env_steps=outcome.calls * calls.steps_per_call,
        new_steps=new_calls * calls.steps_per_call,
        episode_return_mean=last_row.get("episode_return_mean"),
        fingerprint_of=strategy.mean,
        devices={"devices": built.layout.num_devices},
        extra={
            "variant": es_config.variant,
            "mean_params_return": last_row.get("mean_params_return"),
            "generations": outcome.calls * generations_per_call,
            "generations_per_s": (new_calls * generations_per_call / session.train_s
                                  if session.train_s > 0 and new_calls else None),
            "population": es_config.population,
            "horizon": built.layout.horizon,
            "num_params": int(strategy.mean.shape[-1]),
            **(session.population_summary(pop_log) if pop_log else {}),
        },
        stopped=outcome.stopped,
        policy=lambda: es_policy(strategy.mean, outcome.runner.obs_stats, es_config, configs.network,
                                 built.env.spec))
    return summary, outcome.runner
