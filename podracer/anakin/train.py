"""Anakin for any agent: what is its own (environment, network, the jitted act-learn program, its log row).

The host sequence (resume, run directory, logging, profile window, signals,
checkpoints, dataset hooks, summary) is the run session's
(`podracer.session.session`), and the call loop is Anakin's (`podracer.anakin.calls`).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import jax
import numpy as np

from podracer.anakin.calls import Calls, Init, Program, open_with_programs, run_calls
from podracer.envs.jax_envs import make_env
from podracer.envs.spec import check_masked_inputs
from podracer.anakin.loop import make_layout, make_programs
from podracer.anakin.population import agent_inputs
from podracer.algorithms import algorithm
from podracer.anakin.profiled import NOTE, compile_agent_phases, make_profiled_train
from podracer.config import make_optimizer
from podracer import pbt, population
from podracer.networks import is_recurrent
from podracer.protocol import parallel
from podracer.session.session import RunSession, placed_for

if TYPE_CHECKING:  # the command line's run spec, built above this layer
    from podracer.orchestrate.spec import RunSpec


def _interval_metrics(metrics) -> dict:
    """Reduce one call's stacked per-update metrics to one log row."""
    metrics = parallel.to_host(metrics)
    episodes = int(np.sum(metrics.pop("episodes")))
    return_sum = float(np.sum(metrics.pop("episode_return_sum")))
    length_sum = float(np.sum(metrics.pop("episode_length_sum")))
    finite = bool(np.all(metrics.pop("params_finite"))) and all(
        np.all(np.isfinite(value)) for value in metrics.values())
    row = {key: float(np.mean(value)) for key, value in metrics.items()}
    row["episodes"] = episodes
    row["episode_return_mean"] = return_sum / episodes if episodes else None
    row["episode_length_mean"] = length_sum / episodes if episodes else None
    row["finite"] = finite
    return row


def build(configs: RunSpec, devices=None, profile: bool = False) -> Program:
    """Environment, mesh, sizes, network, the jitted `init`/`train` and, to profile, its phases.

    The algorithm is an agent on the contract (`podracer.agent`), found in
    `podracer.algorithms.ALGORITHMS` with its network and sizes; a population
    (`podracer.population`) is its program vmapped over the agents, each built
    with its swept settings, and its `init` ignores the key it is given (each
    agent has its own seed).
    """
    run, anakin = configs.run, configs.anakin
    algo, algo_config = algorithm(configs)
    env = make_env(run.env)
    algo.check_env(env.spec, run.env)
    mesh = parallel.make_mesh(devices)
    members = population.agents(configs)
    is_population = population.is_population(configs)
    sharded = population.check_agents(len(members), mesh.devices.size)
    check_masked_inputs(env.spec, getattr(algo_config, "normalize_observations", False))
    network = algo.make_network(env.spec, configs.network)
    layout = make_layout(anakin, algo_config, mesh.devices.size, is_recurrent(network), sharded)
    steps_per_call = layout.steps_per_update * anakin.updates_per_call
    num_calls = max(1, math.ceil(run.total_steps / steps_per_call))
    num_updates = num_calls * anakin.updates_per_call
    optimizer_steps = num_updates * algo.optimizer_steps(algo_config)

    def agent_for(hparams, axis_names):
        settings = population.configs_for(configs, hparams)  # its swept settings: traced scalars
        optimizer = make_optimizer(settings.optimizer, optimizer_steps)
        return algo.make_agent(network, optimizer, settings.agent, env.spec, anakin.rollout_len, axis_names,
                               num_envs=anakin.num_envs)

    pbt_config = pbt.config_of(configs)
    programs = make_programs(env, agent_for, anakin, mesh, is_population, sharded, pbt_config)
    init = Init.of_key(programs.init)
    if is_population:
        keys, hparams = agent_inputs(members)
        init = Init(programs.init, lambda key: (keys, hparams, *((key,) if pbt_config else ())))
    phases = (programs.act, programs.learn) if profile else None
    return Program(env, network, layout, Calls(0, num_calls, steps_per_call), init, programs.train, phases)


def _agent_rows(metrics, num_agents: int) -> tuple[list[dict], list[dict]]:
    """One call's metrics [U, A, ...] as one log row per agent, and its PBT events (`pbt_events`)."""
    metrics = parallel.to_host(metrics)
    donor, settings = metrics.pop("pbt_donor", None), metrics.pop("pbt_settings", {})
    rows = [_interval_metrics(jax.tree.map(lambda x: np.take(x, i, axis=1), metrics))
            for i in range(num_agents)]
    for i, row in enumerate(rows):  # each agent's settings now (TensorBoard's agent_I/setting/NAME)
        row.update({f"setting/{name}": float(values[-1, i]) for name, values in settings.items()})
    return rows, [] if donor is None else pbt_events(donor[-1], settings)


def pbt_events(donor: np.ndarray, settings: dict[str, np.ndarray]) -> list[dict]:
    """The exploit events of one call: each agent that copied another, and its settings after."""
    return [{"from": int(d), "to": i, "settings": {name: float(v[-1, i]) for name, v in settings.items()}}
            for i, d in enumerate(donor) if d != pbt.NO_DONOR]


def train_agent(configs: RunSpec, devices=None):
    """Train the agent of `--algo` (`podracer.algorithms`) with Anakin on `devices` (default: all); returns (summary, final runner).

    `configs` is the run's `RunSpec` (`podracer.orchestrate.cli.parse_configs`). A run
    directory with a checkpoint resumes from it; a new run can clone its initial policy
    from a dataset (`--init-from-dataset`), and a finished one records its policy
    (`--record-dataset`). With `--profile`, acting and learning run as two programs, timed
    apart (`podracer.anakin.profiled`).
    """
    session = RunSession(configs)
    run, updates_per_call = configs.run, configs.anakin.updates_per_call
    algo, algo_config = algorithm(configs)
    built = build(configs, devices, profile=session.profiler is not None)
    runner, meta, step, compile_s = open_with_programs(session, built, run.seed)
    calls = built.calls._replace(start=int(meta.get("calls", 0)))
    members = population.agents(configs)
    pop_log = session.population_log(members) if population.is_population(configs) else None
    if pop_log is None and algo.clones:
        runner = runner._replace(train=session.warm_start(runner.train, built.env.spec, built.network,
                                                          algo_config))
    if session.profiler:
        compile_start = time.perf_counter()
        train = make_profiled_train(*compile_agent_phases(*built.phases, runner), updates_per_call,
                                        session.measure)
        compile_s += time.perf_counter() - compile_start
    else:
        train, runner = step, placed_for(step, runner)
    session.start(calls.total * calls.steps_per_call, compile_s)

    def record(call: int, metrics) -> None:
        if pop_log is None:
            row = _interval_metrics(metrics)
        else:
            rows, events = _agent_rows(metrics, len(members))
            update = (call + 1) * updates_per_call
            row = pop_log.row(rows, [{"update": update, **event} for event in events])
        env_steps = (call + 1) * calls.steps_per_call
        session.check_finite(row.pop("finite"), f"update {(call + 1) * updates_per_call}", env_steps,
                             algo.fix)
        row.update(env_steps=env_steps,
                   sps=(call + 1 - calls.start) * calls.steps_per_call / session.elapsed())
        if pop_log is not None:
            row["population_sps"] = row["sps"] * len(members)
        session.log(row)

    outcome = run_calls(session, train, runner, calls, record, NOTE if session.profiler else None)
    summary = session.finish(
        env_steps=outcome.calls * calls.steps_per_call,
        new_steps=(outcome.calls - calls.start) * calls.steps_per_call,
        episode_return_mean=session.logger.last_return,
        fingerprint_of=outcome.runner.train.params,
        devices={"devices": built.layout.num_devices},
        extra={"updates": outcome.calls * updates_per_call,
               **(session.population_summary(pop_log) if pop_log else {})},
        stopped=outcome.stopped,
        policy=lambda: algo.policy(outcome.runner.train, built.network, algo_config,
                                   session.data.record_deterministic))
    return summary, outcome.runner


train_actor_critic = train_ppo = train_agent  # the names from before every agent shared the driver
