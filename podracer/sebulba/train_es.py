"""Host driver for Sebulba ES: envpool actors evaluate the population, the learner tells.

Generations run in lock step: actor threads evaluate generation `g` with the
mean published as version `g`, the learner gathers every thread's fitness into
the `[population]` vector, runs the strategy's `tell` on the learner devices
and publishes version `g + 1`. The update is a few fitness scalars' worth of
work, so there is nothing to overlap it with; the actors' episodes are the run.

On several processes each evaluates its share of the population with its own
actor threads; the learners gather the fitness vector (and ARS V2's
observation statistics) from every process, the only data that crosses
processes, and run one `tell` over the learner devices of all of them.

The learner saves the strategy state, the observation statistics and the
counters (`podracer.session.checkpoint`) every `--checkpoint-every` env steps, at the
end and on a signal; a run directory with a checkpoint resumes from it.
"""

from __future__ import annotations

import math
import queue
import time
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from podracer import es
from podracer.acting import es_policy
from podracer.envs.spec import check_masked_inputs
from podracer.es.config import make_strategy
from podracer.es.metrics import ES_FIX
from podracer.networks import make_policy_network
from podracer.protocol import parallel
from podracer.sebulba.config import DeviceSplit, split_devices
from podracer.sebulba.control import Control
from podracer.sebulba.envs import EnvPoolEnvs, env_spec
from podracer.sebulba.es import (SebulbaESLayout, global_thread, make_es_layout, make_es_learner_step,
                                 make_slot_act, make_slot_params)
from podracer.sebulba.es_actor import ESActor, SearchPolicy, run_es_actor
from podracer.sebulba.es_learner import ESLearning, GenerationLog, Progress, learner_inputs, run_es_learner
from podracer.sebulba.params import ParamsStore
from podracer.sebulba.threads import actor_thread, run_threads
from podracer.sebulba.train import env_seed
from podracer.session.session import RunSession

if TYPE_CHECKING:  # the command line's run spec, built above this layer
    from podracer.orchestrate.spec import RunSpec


class ESSetup(NamedTuple):
    """Everything built (and compiled) before a thread starts."""

    spec: Any
    split: DeviceSplit
    layout: SebulbaESLayout
    mesh: Any  # the learner devices of every process
    state: Any  # the strategy state, replicated over the learner mesh
    obs_stats: es.RunningStats  # likewise
    es_key: jax.Array  # generation g asks and tells with generation_key(es_key, g)
    learner_step: Callable
    slot_params: Callable
    act: Callable
    num_params: int
    compile_s: float


def build(configs: RunSpec, devices=None) -> ESSetup:
    """Check the configs against the devices, build the pure pieces, compile them on their devices."""
    run, es_config, sebulba, net = configs.run, configs.agent, configs.sebulba, configs.network
    spec = env_spec(run.env)
    split = split_devices(sebulba, jax.local_devices() if devices is None else devices)
    layout = make_es_layout(es_config, sebulba, split, jax.process_count())
    check_masked_inputs(spec, es_config.normalize_observations)
    policy = make_policy_network(spec.obs_shape, spec.action_dim, spec.discrete, net.hidden,
                                 net.activation, spec.action_mask)
    no_obs = jnp.zeros(spec.obs_shape, spec.obs_dtype)
    param_shapes = [leaf.shape for leaf in jax.tree.leaves(
        jax.eval_shape(policy.init, jax.random.key(0), no_obs))]
    strategy = make_strategy(es_config, param_shapes)
    normalize = es_config.normalize_observations
    # The same initial mean as Anakin ES for the same seed.
    param_key, es_key = jax.random.split(jax.random.PRNGKey(run.seed))
    flat, unravel = ravel_pytree(policy.init(param_key, no_obs))
    mesh = parallel.make_mesh(parallel.process_major(split.learner))
    everywhere = parallel.replicated(mesh)
    # Made inside one jitted call, so that the state is a global array on several processes.
    state = jax.jit(lambda key: strategy.init(ravel_pytree(policy.init(key, no_obs))[0]),
                    out_shardings=everywhere, compiler_options=parallel.run_once_options(mesh))(param_key)
    obs_dim = math.prod(spec.obs_shape)
    no_observations = es.init_running_stats(obs_dim)
    obs_stats = parallel.from_host(no_observations, everywhere)
    learner_step = make_es_learner_step(strategy, mesh, normalize)
    slot_params = make_slot_params(strategy, unravel, layout, es_config.episodes_per_member)
    act = make_slot_act(policy.apply, normalize)

    # Compile every function once, on the devices and shapes the threads will use.
    compile_start = time.perf_counter()
    threads = layout.num_actor_threads * layout.num_processes
    stacked = jax.tree.map(lambda x: np.stack([x] * threads), no_observations)
    jax.block_until_ready(learner_step(state, obs_stats, *learner_inputs(
        es_key, 0, np.zeros(es_config.population, np.float32), stacked, mesh)))
    for device in dict.fromkeys(split.actor):
        actor_state, actor_stats = jax.device_put(parallel.local_replica((state, obs_stats)), device)
        seen = jax.device_put(no_observations, device)
        members = jax.device_put(np.arange(layout.members_per_thread, dtype=np.int32), device)
        params = slot_params(actor_state, es_key, members)
        obs = np.zeros((layout.slots_per_thread, *spec.obs_shape), spec.obs_dtype)
        jax.block_until_ready(act(params, actor_stats, obs, np.ones(layout.slots_per_thread, bool), seen))
    return ESSetup(spec, split, layout, mesh, state, obs_stats, es_key, learner_step, slot_params, act,
                   int(flat.shape[0]), time.perf_counter() - compile_start)


def train_es(configs: RunSpec, devices=None):
    """Train a policy with evolution strategies on Sebulba; returns (summary, (state, obs_stats)).

    `configs` is the run's `RunSpec` (`podracer.orchestrate.cli.parse_configs`). The run
    ends after the generation in which the members' episodes reach `total_steps` agent
    steps (`env_steps`; the mean parameters' evaluation episodes and the ignored steps of
    slots waiting for the others are counted apart). SIGINT/SIGTERM make the learner save
    and stop every thread; a failure in any thread stops every thread and is re-raised.
    """
    session = RunSession(configs)
    run, es_config, sebulba = configs.run, configs.agent, configs.sebulba
    setup = build(configs, devices)
    layout, split = setup.layout, setup.split
    restored, meta = session.open({"strategy": setup.state, "obs_stats": setup.obs_stats})
    start = Progress(*(int(meta[name]) for name in Progress._fields)) if meta else Progress()
    control, timings = Control(), session.timings
    store = ParamsStore(split.actor)
    # A policy's version is its generation: the number of updates applied to the mean.
    store.publish(SearchPolicy(restored["strategy"], restored["obs_stats"]), start.generations)
    queues = [queue.Queue(maxsize=1) for _ in range(layout.num_actor_threads)]
    actors = []
    for actor_id in range(layout.num_actor_threads):
        numbered = global_thread(actor_id, layout, jax.process_index())
        # Made here rather than in the thread: a bad environment fails before anything starts.
        envs = EnvPoolEnvs(run.env, layout.slots_per_thread, layout.slots_per_thread,
                           sebulba.env_threads, seed=env_seed(run.seed, numbered, start.generations))
        record = ESActor(numbered, envs, layout, es_config.episodes_per_member,
                         split.actor[actor_id // sebulba.actor_threads], setup.slot_params, setup.act,
                         store, queues[actor_id], setup.es_key, control, timings)
        actors.append(actor_thread(control, run_es_actor, record, actor_id, "sebulba-es-actor"))

    logger = session.start(run.total_steps, setup.compile_s)
    log = GenerationLog(logger, timings, sebulba.log_every, start)

    def save(state, obs_stats):
        progress = log.progress
        session.save(progress.env_steps, {"strategy": state, "obs_stats": obs_stats}, progress._asdict())

    learning = ESLearning(
        setup.learner_step, setup.es_key, setup.mesh, queues, store, run.total_steps, control,
        timings, log, start, save=save, save_every=session.checkpoint.checkpoint_every,
        interrupted=lambda: bool(session.stop),
        guard=lambda finite, generation: session.check_finite(
            finite, f"generation {generation}", log.env_steps, ES_FIX))
    log.start = time.perf_counter()
    final = run_threads(session, control, actors,
                        lambda: run_es_learner(learning, restored["strategy"], restored["obs_stats"]),
                        "sebulba-es-learner")
    state, obs_stats = final or (restored["strategy"], restored["obs_stats"])
    processes = jax.process_count()
    summary = session.finish(
        env_steps=log.env_steps,
        new_steps=log.env_steps - start.env_steps,
        episode_return_mean=log.last_row.get("episode_return_mean"),
        fingerprint_of=state.mean,
        devices={"devices": len(set(split.actor) | set(split.learner)) * processes,
                 # Over every process, as Sebulba PPO counts them.
                 "actor_devices": len(split.actor) * processes,
                 "learner_devices": setup.mesh.devices.size,
                 "actor_threads": layout.num_actor_threads * processes},
        extra={
            "variant": es_config.variant,
            "mean_params_return": log.mean_params_return,
            "generations": log.generations,
            "generations_per_s": ((log.generations - start.generations) / session.train_s
                                  if session.train_s > 0 else None),
            "population": es_config.population,
            "num_params": setup.num_params,
            "eval_steps": log.eval_steps,
            "ignored_steps": log.ignored_steps,
        },
        stopped=log.env_steps < run.total_steps,
        policy=lambda: es_policy(state.mean, obs_stats, es_config, configs.network, setup.spec),
        breakdown=True)
    return summary, (state, obs_stats)
