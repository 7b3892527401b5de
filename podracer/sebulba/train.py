"""Host driver for any agent on Sebulba (`--algo`, `podracer.algorithms`): split the devices, start actors and learner, log, checkpoint, stop cleanly.

Actor threads run the agent's `act` and `prepare` (`podracer.agent`), the
learner its `learn`; the driver never names an algorithm. Checkpoints hold
what the learner owns: the agent's state (for PPO: parameters, optimiser
state, observation statistics), its RNG key and the number of updates, which
is also the version of the acting state it publishes. The environments are not
saved (envpool cannot restore an environment's state): a resumed run continues
from the last learner step with fresh environments, and policy versions keep
counting from the checkpoint's.

On several processes (`jax.distributed`), the learner mesh spans the learner
devices of all of them, in process order; each process's actors stay on its
own devices and ship their trajectories to its part of that mesh, so a global
batch is every process's trajectories side by side. Every process's learner
runs the same updates in lockstep; process 0 logs.
"""

from __future__ import annotations

import math
import queue
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from podracer.agent import Agent
from podracer.algorithms import algorithm
from podracer.config import make_optimizer
from podracer.envs.spec import check_masked_inputs
from podracer.networks import is_recurrent
from podracer.protocol import parallel
from podracer.sebulba.actor import Acting, Actor, ActorSettings, make_acting, run_actor, thread_env_index, warm_up
from podracer.sebulba.config import DeviceSplit, SebulbaLayout, make_layout, split_devices
from podracer.sebulba.control import Control
from podracer.sebulba.envs import EnvPoolEnvs, env_spec
from podracer.sebulba.learner import Learning, make_learn_step, run_learner, shipment_shapes
from podracer.sebulba.metrics import IntervalLog
from podracer.sebulba.params import ParamsStore
from podracer.sebulba.threads import actor_thread, run_threads
from podracer.session.session import RunSession

if TYPE_CHECKING:  # the command line's run spec, built above this layer
    from podracer.orchestrate.spec import RunSpec


class Setup(NamedTuple):
    """Everything built before a thread starts: sizes, network, agent, learner state and its compiled step."""

    spec: Any
    split: DeviceSplit
    layout: SebulbaLayout
    num_updates: int
    network: Any
    agent: Agent  # its `learn` averages over the learner mesh; `act` and `prepare` run on one actor device
    acting: Acting  # the agent's acting, jitted for the actor threads
    mesh: Any  # the learner devices of every process
    state: Any  # the agent's state, replicated over the learner mesh
    step_fn: Any  # compiled `make_learn_step` for one shipment per actor thread
    compile_s: float


def build(configs: RunSpec, devices=None) -> Setup:
    """Check the configs against the devices, then build the agent and compile its learner step."""
    run, sebulba = configs.run, configs.sebulba
    algo, algo_config = algorithm(configs)
    spec = env_spec(run.env)
    algo.check_env(spec, run.env)
    split = split_devices(sebulba, jax.local_devices() if devices is None else devices)
    network = algo.make_network(spec, configs.network)
    layout = make_layout(sebulba, algo_config, split, jax.process_count(), is_recurrent(network))
    num_updates = max(1, math.ceil(run.total_steps / layout.steps_per_update))
    check_masked_inputs(spec, getattr(algo_config, "normalize_observations", False))
    optimizer = make_optimizer(configs.optimizer, num_updates * algo.optimizer_steps(algo_config))
    agent = algo.make_agent(network, optimizer, algo_config, spec, sebulba.rollout_len, (parallel.DATA_AXIS,),
                            num_envs=sebulba.num_envs)
    mesh = parallel.make_mesh(parallel.process_major(split.learner))
    state, acting, step_fn, compile_s = compile_agent(
        agent, jax.random.fold_in(jax.random.PRNGKey(run.seed), 0), spec, split, mesh, layout, sebulba.rollout_len)
    return Setup(spec, split, layout, num_updates, network, agent, acting, mesh, state, step_fn, compile_s)


def compile_agent(agent: Agent, key: jax.Array, spec: Any, split: DeviceSplit, mesh: Any, layout: Any,
                  rollout_len: int) -> tuple[Any, Acting, Any, float]:
    """`agent`'s initial state (from `key`, replicated over the learner `mesh`), its acting and its learner
    step compiled for `layout`'s threads: `(state, acting, step_fn, compile_s)`. `layout` has the
    `num_actor_threads`, `envs_per_thread` and `env_batch` of a `SebulbaLayout` (or ES's `ESLayout`)."""
    # One jitted call: eager initialisation would compile every small op on its own.
    init = jax.jit(agent.init, out_shardings=parallel.replicated(mesh),
                   compiler_options=parallel.run_once_options(mesh))
    state = init(key)
    compile_start = time.perf_counter()
    acting_state = jax.eval_shape(agent.acting_state, state)
    acting = make_acting(agent, acting_state, spec, layout.envs_per_thread)
    # One actor thread of every process fills one global shipment.
    shipment = shipment_shapes(agent, acting, acting_state, rollout_len, layout.envs_per_thread, mesh,
                               jax.process_count())
    threads = layout.num_actor_threads
    step_fn = make_learn_step(agent.learn, mesh, agent.check_vma, agent.learned_state).lower(
        state, *((part,) * threads for part in shipment[:2]), jax.random.PRNGKey(0),
        (shipment[2],) * threads).compile()
    for device in dict.fromkeys(split.actor):
        warm_up(acting, parallel.local_replica(agent.acting_state(state)), device, layout.env_batch,
                layout.envs_per_thread, rollout_len)
    return state, acting, step_fn, time.perf_counter() - compile_start


def env_seed(seed: int, actor: int, first_update: int) -> int:
    """envpool's seed for one actor thread (numbered over every process).

    A resumed run gets other environments than the run it resumes, which would
    otherwise replay the episodes it started with.
    """
    entropy = [seed, actor, first_update] if first_update else [seed, actor]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0] >> 1)


def train_agent(configs: RunSpec, devices=None):
    """Train the agent of `--algo` with Sebulba on `devices` (default: this host's); returns (summary, final state).

    `configs` is the run's `RunSpec` (`podracer.orchestrate.cli.parse_configs`). Actor
    threads step envpool environments on the host and run the agent's `act` and `prepare`
    on their actor device; the learner runs its `learn` on the learner devices and saves
    checkpoints into the run directory. SIGINT/SIGTERM make the learner save and stop
    every thread; a failure in any thread stops every thread and is re-raised.
    """
    session = RunSession(configs)
    run, sebulba = configs.run, configs.sebulba
    algo, algo_config = algorithm(configs)
    setup = build(configs, devices)
    layout, split, steps = setup.layout, setup.split, setup.layout.steps_per_update
    actor_key, learner_key = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(run.seed), 1))
    # Saved with the train state, so replicated over the learner mesh like it.
    learner, meta = session.open(
        {"train": setup.state,
         "key": parallel.from_host(np.asarray(learner_key), parallel.replicated(setup.mesh))})
    first_update = int(meta.get("updates", 0))
    if algo.clones:
        learner["train"] = session.warm_start(learner["train"], setup.spec, setup.network, algo_config)
    control, timings = Control(), session.timings
    store = ParamsStore(split.actor)
    # An acting state's version: the updates applied to it.
    store.publish(setup.agent.acting_state(learner["train"]), first_update)
    queues = [queue.Queue(maxsize=1) for _ in range(layout.num_actor_threads)]
    settings = ActorSettings(sebulba.rollout_len, sebulba.synchronous,
                             time_transfers=session.profiler is not None)
    if first_update:
        actor_key = jax.random.fold_in(actor_key, first_update)
    actors = []
    for actor_id in range(layout.num_actor_threads):
        # Numbered over every process: each process's environments and keys are its own.
        numbered = jax.process_index() * layout.num_actor_threads + actor_id
        # Made here rather than in the thread: a bad environment fails before anything starts.
        envs = EnvPoolEnvs(run.env, layout.envs_per_thread, layout.env_batch, sebulba.env_threads,
                           seed=env_seed(run.seed, numbered, first_update))
        record = Actor(actor_id, envs, settings, split.actor[actor_id // sebulba.actor_threads],
                       setup.acting, store, queues[actor_id], setup.mesh,
                       jax.random.fold_in(actor_key, numbered), control, timings,
                       thread_env_index(numbered, layout.envs_per_thread))
        actors.append(actor_thread(control, run_actor, record, actor_id, "sebulba-actor"))

    logger = session.start(setup.num_updates * steps, setup.compile_s)
    log = IntervalLog(logger, timings, sebulba.log_every, steps, setup.num_updates, first_update)
    every = session.checkpoint.checkpoint_every
    learning = Learning(
        setup.step_fn, queues, store, setup.num_updates, learner["key"], control, timings, log,
        acting_state=setup.agent.acting_state, first_update=first_update,
        save=lambda updates, state: session.save(updates * steps, {"train": state, "key": learner["key"]},
                                                 {"updates": updates}),
        save_every=math.ceil(every / steps) if every else 0,
        interrupted=lambda: bool(session.stop),
        guard=lambda finite, update: session.check_finite(finite, f"update {update}", update * steps,
                                                          algo.fix))
    log.start = time.perf_counter()
    final = run_threads(session, control, actors, lambda: run_learner(learning, learner["train"]),
                        "sebulba-learner")
    processes = jax.process_count()
    summary = session.finish(
        env_steps=log.updates * steps,
        new_steps=(log.updates - first_update) * steps,
        episode_return_mean=log.last_return if log.last_return is not None else logger.last_return,
        fingerprint_of=final.params,
        devices={"devices": len(set(split.actor) | set(split.learner)) * processes,
                 # Over every process, as the sizes are.
                 "actor_devices": len(split.actor) * processes,
                 "learner_devices": setup.mesh.devices.size,
                 "actor_threads": layout.num_actor_threads * processes},
        extra={"updates": log.updates, **log.run_summary()},
        stopped=log.updates < setup.num_updates,
        policy=lambda: algo.policy(final, setup.network, algo_config, session.data.record_deterministic),
        breakdown=True)
    return summary, final


train_actor_critic = train_ppo = train_agent  # the names from before every agent shared the driver
