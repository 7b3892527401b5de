"""Anakin ES: what is its own (sizes from its section, the mean parameters' evaluation, its log row and summary).

ES is an agent on the contract (`podracer.es.agent`): Anakin's one builder
(`podracer.anakin.loop.make_programs`) runs its generations, a population of
ES runs and `--profile`'s phases as it runs any agent's updates. What stays
here is what a user of ES reads: the episode return of the search
distribution's mean after every call (`mean_params_return`), the log row
(`podracer.es.metrics.es_row`) and the summary's keys. The host sequence is
the run session's (`podracer.session.session`), the call loop Anakin's
(`podracer.anakin.calls`).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, PartitionSpec as P

from podracer import population
from podracer.acting import es_policy
from podracer.anakin.calls import Calls, Init, Program, open_with_programs, run_calls
from podracer.anakin.loop import AnakinConfig, make_programs
from podracer.anakin.population import agent_inputs
from podracer.anakin.profiled import NOTE, compile_agent_phases, make_profiled_train
from podracer.envs.jax_envs import GymnaxEnv, make_env
from podracer.envs.spec import check_masked_inputs
from podracer.es.agent import ESState, episode_horizon, make_agent, members_per_device
from podracer.es.config import ESConfig
from podracer.es.metrics import ES_FIX, es_row
from podracer.networks import make_policy_network
from podracer.normalize import ars_normalize
from podracer.protocol import parallel
from podracer.session.session import RunSession, placed_for

if TYPE_CHECKING:  # the command line's run spec, built above this layer
    from podracer.orchestrate.spec import RunSpec


class ESLayout(NamedTuple):
    """Sizes derived from the ES section, the environment and the mesh."""

    num_devices: int
    members_per_device: int
    horizon: int
    steps_per_generation: int  # global env steps simulated by the population


def make_episode(env: GymnaxEnv, apply: Callable, horizon: int, normalize: bool, axis_names=()) -> Callable:
    """`episode(params, obs_stats, key) -> return` of one episode of a deterministic policy.

    `apply(params, obs) -> action`; rewards count up to the episode's first end
    (terminated or truncated), and it is cut at `horizon` steps. ARS V2
    (`normalize`) feeds the policy observations normalised by `obs_stats`.
    After the end the environment starts again from its first state
    (`GymnaxEnv.draw_restarting`): those steps only fill the fixed-length scan.
    `axis_names`: the mesh axes the caller runs under, if any.
    """

    def episode(params, obs_stats, key):
        reset_key, steps_key = jax.random.split(key)
        env_state, first = env.reset(reset_key)
        first_state = env_state

        def step(carry, step_key):
            env_state, obs, total, alive = carry
            policy_obs = ars_normalize(obs_stats, obs.reshape(-1)).reshape(obs.shape) if normalize else obs
            draws = env.draw_restarting(step_key, first.obs, first_state)
            env_state, ts = env.step_with(draws, env_state, apply(params, policy_obs))
            total = total + alive * ts.reward
            alive = alive * (1.0 - jnp.logical_or(ts.terminated, ts.truncated).astype(jnp.float32))
            return (env_state, ts.obs, total, alive), None

        carry = parallel.vary((env_state, first.obs, jnp.zeros(()), jnp.ones(())), axis_names)
        (_, _, total, _), _ = jax.lax.scan(step, carry, jax.random.split(steps_key, horizon))
        return total

    return episode


def make_mean_evaluation(env: GymnaxEnv, policy, config: ESConfig, horizon: int, mesh: Mesh,
                         agents: bool = False) -> Callable:
    """Jitted `evaluate(state: ESState) -> mean return` of the search distribution's mean.

    `config.eval_episodes` episodes of the mean's deterministic policy
    (`make_episode`), split over the devices by global index so that the
    figure does not depend on the device count. The episodes' keys come from
    the state's key and generation, so a resumed run evaluates as it would have.
    With `agents` the state has a leading agent axis and so has the result.
    """
    per_device = -(-config.eval_episodes // mesh.devices.size)
    axes = (parallel.DATA_AXIS,)
    dummy_obs = jnp.zeros(env.spec.obs_shape, env.spec.obs_dtype)
    _, unravel = ravel_pytree(policy.init(jax.random.PRNGKey(0), dummy_obs))
    episode = make_episode(env, policy.apply, horizon, config.normalize_observations, axes)

    def evaluate(state: ESState):
        key = jax.random.fold_in(jax.random.split(state.key)[1], state.strategy.generation)
        index = parallel.axis_offset(per_device, axes) + jnp.arange(per_device)
        keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, index)
        returns = jax.vmap(episode, in_axes=(None, None, 0))(unravel(state.strategy.mean), state.obs_stats, keys)
        total = parallel.psum(jnp.sum(jnp.where(index < config.eval_episodes, returns, 0.0)), axes)
        return total / config.eval_episodes

    evaluate = jax.vmap(evaluate) if agents else evaluate
    return jax.jit(jax.shard_map(evaluate, mesh=mesh, in_specs=P(), out_specs=P(),
                                 check_vma=getattr(env, "check_vma", True)))


def build(configs: RunSpec, devices=None, profile: bool = False) -> Program:
    """Environment, sizes, the ES agent's jitted `init`/`train` (and its phases, to profile)."""
    run, es_config, net = configs.run, configs.agent, configs.network
    env = make_env(run.env)
    mesh = parallel.make_mesh(devices)
    horizon = episode_horizon(env, es_config)
    layout = ESLayout(mesh.devices.size, members_per_device(es_config, mesh.devices.size), horizon,
                      es_config.population * es_config.episodes_per_member * horizon)
    steps_per_call = layout.steps_per_generation * es_config.generations_per_call
    num_calls = max(1, math.ceil(run.total_steps / steps_per_call))
    check_masked_inputs(env.spec, es_config.normalize_observations)
    policy = make_policy_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete,
                                 net.hidden, net.activation, env.spec.action_mask)
    # A generation is one rollout: each environment one episode of its member.
    sizes = AnakinConfig(num_envs=es_config.population * es_config.episodes_per_member, rollout_len=horizon,
                         updates_per_call=es_config.generations_per_call)
    # Each agent's generations with its swept settings (none for one run); a population's agents are
    # all on every device, the members of each one's generation split over the devices as for one.
    is_population = population.is_population(configs)
    agent_for = lambda hparams, axes: make_agent(policy, None, population.configs_for(configs, hparams).agent,
                                                 env.spec, horizon, axes)
    programs = make_programs(env, agent_for, sizes, mesh, population=is_population)
    init = Init.of_key(programs.init)
    if is_population:
        keys, hparams = agent_inputs(population.agents(configs))
        init = Init(programs.init, lambda _key: (keys, hparams))
    phases = (programs.act, programs.learn) if profile else None
    return Program(env, policy, layout, Calls(0, num_calls, steps_per_call), init, programs.train, phases)


def _call_metrics(metrics, mean_params_return) -> dict:
    """One call's metrics as `es_row` reads them: the strategy's, stacked over its generations.

    The loop's episode counts are left out: an ES generation's episodes are its
    members' fitness, which the strategy's metrics already give.
    """
    metrics = {k: v for k, v in parallel.to_host(metrics).items()
               if k not in ("episodes", "episode_return_sum", "episode_length_sum")}
    return dict(metrics, mean_params_return=parallel.to_host(mean_params_return))


def train_es(configs: RunSpec, devices=None):
    """Train a policy with evolution strategies on Anakin; returns (summary, final runner).

    `configs` is the run's `RunSpec` (`podracer.orchestrate.cli.parse_configs`). A run
    directory with a checkpoint resumes from it.

    `env_steps` counts the steps the population simulates (`population *
    episodes_per_member * horizon` per generation, steps after an episode's end
    included: they are computed and masked); the evaluation episodes of the mean
    parameters are extra and not counted. `episode_return_mean` is the mean
    fitness of the population over the call's generations, `mean_params_return`
    the return of the mean parameters after the call. With `--profile`, acting
    (the population's episodes), learning (`tell`) and the mean's evaluation
    run as separate programs, timed apart (`podracer.anakin.profiled`).
    """
    session = RunSession(configs)
    run, es_config = configs.run, configs.agent
    generations_per_call = es_config.generations_per_call
    built = build(configs, devices, profile=session.profiler is not None)
    runner, meta, train, compile_s = open_with_programs(session, built, run.seed)
    calls = built.calls._replace(start=int(meta.get("calls", 0)))
    members = population.agents(configs)
    pop_log = (session.population_log(members, "mean_params_return")
               if population.is_population(configs) else None)
    compile_start = time.perf_counter()
    if session.profiler:
        train = make_profiled_train(*compile_agent_phases(*built.phases, runner), generations_per_call,
                                    session.measure, names=("evaluate", "tell"))
    else:
        runner = placed_for(train, runner)
    evaluate_mean = make_mean_evaluation(built.env, built.network, es_config, built.layout.horizon,
                                         parallel.make_mesh(devices), population.is_population(configs))
    evaluate_mean = evaluate_mean.lower(runner.train).compile()
    compile_s += time.perf_counter() - compile_start

    def step(runner):
        runner, metrics = train(runner)
        with session.measure("evaluate_mean") if session.profiler else contextlib.nullcontext():
            mean_return = evaluate_mean(runner.train)
            if session.profiler:
                jax.block_until_ready(mean_return)
        return runner, (metrics, mean_return)

    session.start(calls.total * calls.steps_per_call, compile_s)
    last_row: dict = {}

    def record(call: int, outputs) -> None:
        metrics = _call_metrics(*outputs)
        if pop_log is None:
            row = es_row(metrics)
        else:  # [generations, agents] (the mean's return: [agents])
            agent = lambda i: {k: (v[i] if k == "mean_params_return" else np.take(v, i, axis=1))
                               for k, v in metrics.items()}
            row = pop_log.row([es_row(agent(i)) for i in range(len(members))])
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
    state: ESState = outcome.runner.train
    summary = session.finish(
        env_steps=outcome.calls * calls.steps_per_call,
        new_steps=new_calls * calls.steps_per_call,
        episode_return_mean=last_row.get("episode_return_mean"),
        fingerprint_of=state.strategy.mean,
        devices={"devices": built.layout.num_devices},
        extra={
            "variant": es_config.variant,
            "mean_params_return": last_row.get("mean_params_return"),
            "generations": outcome.calls * generations_per_call,
            "generations_per_s": (new_calls * generations_per_call / session.train_s
                                  if session.train_s > 0 and new_calls else None),
            "population": es_config.population,
            "horizon": built.layout.horizon,
            "num_params": int(state.strategy.mean.shape[-1]),
            **(session.population_summary(pop_log) if pop_log else {}),
        },
        stopped=outcome.stopped,
        policy=lambda: es_policy(state.strategy.mean, state.obs_stats, es_config, configs.network,
                                 built.env.spec))
    return summary, outcome.runner

