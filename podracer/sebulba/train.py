"""Host driver for Sebulba PPO and IMPALA (one driver, the update a parameter): split the devices, start actors and learner, log, checkpoint, stop cleanly.

Checkpoints hold what the learner owns: its train state (parameters, optimiser
state, observation statistics), its RNG key and the number of updates, which
is also the version of the policy it publishes. The environments are not
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
from typing import Any, NamedTuple

import jax
import numpy as np

from podracer.acting import ppo_policy
from podracer.algorithms import algorithm
from podracer.config import make_optimizer
from podracer.envs.spec import check_masked_inputs
from podracer.networks import carry_width, init_params, is_recurrent, make_network
from podracer.ppo import init_train_state
from podracer.protocol import parallel
from podracer.sebulba.actor import Actor, ActorSettings, make_policy_step, run_actor
from podracer.sebulba.config import DeviceSplit, SebulbaLayout, make_layout, split_devices
from podracer.sebulba.control import Control
from podracer.sebulba.envs import EnvPoolEnvs, env_spec
from podracer.sebulba.learner import Learning, make_learner_step, run_learner, trajectory_shapes
from podracer.sebulba.metrics import IntervalLog
from podracer.sebulba.params import ParamsStore
from podracer.sebulba.threads import actor_thread, run_threads
from podracer.session.session import RunSession
from podracer.types import TrainState, Transition

class Setup(NamedTuple):
    """Everything built before a thread starts: sizes, network, learner state and its compiled step."""

    spec: Any
    split: DeviceSplit
    layout: SebulbaLayout
    num_updates: int
    network: Any
    mesh: Any  # the learner devices of every process
    state: TrainState  # replicated over the learner mesh
    step_fn: Any  # compiled `make_learner_step` for one trajectory per actor thread
    compile_s: float


def _column_shapes(spec, rollout_len: int) -> Transition:
    """One environment's column of a trajectory, as zeros: the shapes the learner compiles for."""
    t = rollout_len
    action = np.zeros((t,), np.int32) if spec.discrete else np.zeros((t, spec.action_dim), np.float32)
    scalar, flag = np.zeros((t,), np.float32), np.zeros((t,), bool)
    return Transition(np.zeros((t, *spec.obs_shape), spec.obs_dtype), action, scalar, flag, flag,
                      scalar, scalar, scalar)


def build(configs: dict[str, Any], devices=None) -> Setup:
    """Check the configs against the devices, then build and compile the learner."""
    run, sebulba = configs["run"], configs["sebulba"]
    algo, ppo_config = algorithm(configs)
    optim, net = configs["optimizer"], configs["network"]
    spec = env_spec(run.env)
    split = split_devices(sebulba, jax.local_devices() if devices is None else devices)
    network = make_network(spec.obs_shape, spec.action_dim, spec.discrete, net.hidden, net.activation,
                           network=net.network, action_mask=spec.action_mask)
    layout = make_layout(sebulba, ppo_config, split, jax.process_count(), is_recurrent(network))
    num_updates = max(1, math.ceil(run.total_steps / layout.steps_per_update))
    check_masked_inputs(spec, ppo_config.normalize_observations)
    optimizer = make_optimizer(optim, num_updates * ppo_config.epochs * ppo_config.minibatches)
    mesh = parallel.make_mesh(parallel.process_major(split.learner))
    # One jitted call: eager initialisation would compile every small op on its own.
    init = jax.jit(lambda key: init_train_state(
        init_params(network, spec.obs_shape, spec.obs_dtype, key), optimizer, spec.obs_shape),
        out_shardings=parallel.replicated(mesh), compiler_options=parallel.run_once_options(mesh))
    state = init(jax.random.fold_in(jax.random.PRNGKey(run.seed), 0))
    compile_start = time.perf_counter()
    # One actor thread of every process fills one global trajectory.
    batch, bootstrap = trajectory_shapes(_column_shapes(spec, sebulba.rollout_len),
                                         layout.envs_per_thread * jax.process_count(), mesh)
    threads = layout.num_actor_threads
    carries = ()
    if is_recurrent(network):  # each trajectory's initial state: flat [N, K], split like the bootstrap
        carries = ((jax.ShapeDtypeStruct(bootstrap.shape + (carry_width(network),), np.float32,
                                         sharding=bootstrap.sharding),) * threads,)
    step_fn = make_learner_step(network.apply, optimizer, ppo_config, mesh, algo.make_update,
                                network).lower(
        state, (batch,) * threads, (bootstrap,) * threads, jax.random.PRNGKey(0), *carries).compile()
    return Setup(spec, split, layout, num_updates, network, mesh, state, step_fn,
                 time.perf_counter() - compile_start)


def env_seed(seed: int, actor: int, first_update: int) -> int:
    """envpool's seed for one actor thread (numbered over every process).

    A resumed run gets other environments than the run it resumes, which would
    otherwise replay the episodes it started with.
    """
    entropy = [seed, actor, first_update] if first_update else [seed, actor]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0] >> 1)


def train_actor_critic(configs: dict[str, Any], devices=None):
    """Train PPO or IMPALA (`--algo`) with Sebulba on `devices` (default: this host's); returns (summary, final state).

    `configs` maps section names to config dataclasses, as
    `podracer.orchestrate.cli.parse_configs` returns them. Actor threads step
    envpool environments on the host and act on their actor device; the
    learner updates on the learner devices and saves checkpoints into the run
    directory. SIGINT/SIGTERM make the learner save and stop every thread; a
    failure in any thread stops every thread and is re-raised.
    """
    session = RunSession(configs)
    run, sebulba = configs["run"], configs["sebulba"]
    algo, ppo_config = algorithm(configs)
    setup = build(configs, devices)
    layout, split, steps = setup.layout, setup.split, setup.layout.steps_per_update
    actor_key, learner_key = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(run.seed), 1))
    # Saved with the train state, so replicated over the learner mesh like it.
    learner, meta = session.open(
        {"train": setup.state,
         "key": parallel.from_host(np.asarray(learner_key), parallel.replicated(setup.mesh))})
    first_update = int(meta.get("updates", 0))
    learner["train"] = session.warm_start(learner["train"], setup.spec, setup.network, ppo_config)
    control, timings = Control(), session.timings
    store = ParamsStore(split.actor)
    store.publish(learner["train"], first_update)  # a policy's version: the updates applied to it
    policy_step = make_policy_step(setup.network.apply, ppo_config, setup.network)
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
                       policy_step, store, queues[actor_id], setup.mesh,
                       jax.random.fold_in(actor_key, numbered), control, timings,
                       carry_width(setup.network))
        actors.append(actor_thread(control, run_actor, record, actor_id, "sebulba-actor"))

    logger = session.start(setup.num_updates * steps, setup.compile_s)
    log = IntervalLog(logger, timings, sebulba.log_every, steps, setup.num_updates, first_update)
    every = session.configs["checkpoint"].checkpoint_every
    learning = Learning(
        setup.step_fn, queues, store, setup.num_updates, learner["key"], control, timings, log,
        first_update=first_update,
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
        policy=lambda: ppo_policy(final, setup.network.apply, ppo_config,
                                  session.data.record_deterministic, algo.name),
        breakdown=True)
    return summary, final


train_ppo = train_actor_critic  # PPO's name, from before IMPALA shared the driver
