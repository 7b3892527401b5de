"""Host driver for Sebulba PPO: split the devices, start actors and learner, log, checkpoint, stop cleanly.

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
import signal
import threading
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from podracer.protocol import parallel
from podracer.session.checkpoint import (CheckpointConfig, Checkpointer, check_resumable, config_record,
                                 stop_on_signals)
from podracer.config import (LogConfig, NetworkConfig, OptimConfig, RunConfig, make_optimizer,
                             used_configs)
from podracer.errors import Interrupted
from podracer.session.logger import RunLogger
from podracer.networks import init_params, make_network
from podracer.session.profile import make_profiler
from podracer.ppo import PPOConfig, init_train_state
from podracer.sebulba.actor import ActorSettings, make_policy_step, run_actor
from podracer.sebulba.config import DeviceSplit, Layout, SebulbaConfig, make_layout, split_devices
from podracer.sebulba.control import Control, wait_for_threads
from podracer.sebulba.envs import EnvPoolEnvs, env_spec
from podracer.sebulba.learner import Saving, make_learner_step, run_learner, trajectory_shapes
from podracer.sebulba.metrics import IntervalLog
from podracer.sebulba.params import ParamsStore
from podracer.session.run_dir import prepare_run_dir
from podracer.session.timing import Timings, as_metrics, format_breakdown
from podracer.types import TrainState, Transition


class Setup(NamedTuple):
    """Everything built before a thread starts: sizes, network, learner state and its compiled step."""

    spec: Any
    split: DeviceSplit
    layout: Layout
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


def build(run: RunConfig, ppo_config: PPOConfig, sebulba: SebulbaConfig, optim: OptimConfig,
          net: NetworkConfig, devices=None) -> Setup:
    """Check the configs against the devices, then build and compile the learner."""
    spec = env_spec(run.env)
    split = split_devices(sebulba, jax.local_devices() if devices is None else devices)
    layout = make_layout(sebulba, ppo_config, split, jax.process_count())
    num_updates = max(1, math.ceil(run.total_steps / layout.steps_per_update))
    network = make_network(spec.obs_shape, spec.action_dim, spec.discrete, net.hidden, net.activation)
    optimizer = make_optimizer(optim, num_updates * ppo_config.epochs * ppo_config.minibatches)
    mesh = parallel.make_mesh(parallel.process_major(split.learner))
    # One jitted call: eager initialisation would compile every small op on its own.
    init = jax.jit(lambda key: init_train_state(
        init_params(network, spec.obs_shape, spec.obs_dtype, key), optimizer, spec.obs_shape),
        out_shardings=parallel.replicated(mesh))
    state = init(jax.random.fold_in(jax.random.PRNGKey(run.seed), 0))
    compile_start = time.perf_counter()
    # One actor thread of every process fills one global trajectory.
    batch, bootstrap = trajectory_shapes(_column_shapes(spec, sebulba.rollout_len),
                                         layout.envs_per_thread * jax.process_count(), mesh)
    threads = layout.num_actor_threads
    step_fn = make_learner_step(network.apply, optimizer, ppo_config, mesh).lower(
        state, (batch,) * threads, (bootstrap,) * threads, jax.random.PRNGKey(0)).compile()
    return Setup(spec, split, layout, num_updates, network, mesh, state, step_fn,
                 time.perf_counter() - compile_start)


def run_cpu_work_inline() -> None:
    """Execute CPU computations on the thread that calls them (`jax_cpu_enable_async_dispatch`).

    Every Sebulba thread waits for its own computation at once (an actor needs
    its actions, the learner its metrics), so handing each small policy call to
    XLA's worker threads only adds a thread wake-up per environment step; on a
    2-core CPU, inline execution measured 15-35% more steps/s. Effective only
    before JAX's CPU backend starts; a process-wide setting, hence the launcher's
    to make, never a library import's.
    """
    jax.config.update("jax_cpu_enable_async_dispatch", False)


def train_ppo_from_configs(configs: dict[str, Any]):
    """The launcher's entry point: `train_ppo` on the config sections (the launcher has run
    `run_cpu_work_inline` before JAX started)."""
    return train_ppo(configs["run"], configs["ppo"], configs["sebulba"], configs["optimizer"],
                     configs["network"], checkpoint=configs["checkpoint"],
                     log_config=configs["logging"])


def env_seed(seed: int, actor: int, first_update: int) -> int:
    """envpool's seed for one actor thread (numbered over every process).

    A resumed run gets other environments than the run it resumes, which would
    otherwise replay the episodes it started with.
    """
    entropy = [seed, actor, first_update] if first_update else [seed, actor]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0] >> 1)


def train_ppo(run: RunConfig, ppo_config: PPOConfig, sebulba: SebulbaConfig,
              optim: OptimConfig, net: NetworkConfig, devices=None,
              checkpoint: CheckpointConfig = CheckpointConfig(), log_config: LogConfig = LogConfig()):
    """Train PPO with Sebulba on `devices` (default: this host's); returns (summary, final state).

    Actor threads step envpool environments on the host and act on their actor
    device; the learner updates on the learner devices and saves checkpoints
    into `run.run_dir` (every `checkpoint.checkpoint_every` env steps, at the
    end, and on a signal). A run directory with a checkpoint resumes from it.
    SIGINT/SIGTERM make the learner save and stop every thread, then raise
    `Interrupted` (after writing the summary); a failure in any thread stops
    every thread and is re-raised. With `log_config.profile` the summary gets a
    per-thread time breakdown (`podracer.session.profile`).
    """
    wall_start = time.perf_counter()
    configs = {"run": run, "ppo": ppo_config, "sebulba": sebulba, "optimizer": optim, "network": net,
               "checkpoint": checkpoint, "logging": log_config}
    resuming = check_resumable(run.run_dir, checkpoint, configs)
    setup = build(run, ppo_config, sebulba, optim, net, devices)
    layout, split = setup.layout, setup.split
    prepare_run_dir(run.run_dir)
    checkpointer = Checkpointer(run.run_dir, checkpoint, configs)
    actor_key, learner_key = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(run.seed), 1))
    # Saved with the train state, so replicated over the learner mesh like it.
    learner = {"train": setup.state,
               "key": parallel.from_host(np.asarray(learner_key), parallel.replicated(setup.mesh))}
    first_update = 0
    if resuming:
        learner, meta = checkpointer.restore(learner)
        first_update = int(meta["updates"])
    steps = layout.steps_per_update
    main_process = parallel.is_main_process()
    logger = RunLogger(run.run_dir, setup.num_updates * steps, enabled=main_process,
                       resume_steps=first_update * steps)
    logger.compiled(setup.compile_s)

    profiler = make_profiler(log_config, run.run_dir)
    control, timings = Control(), profiler or Timings()
    store = ParamsStore(split.actor)
    # A policy's version is the number of updates applied to it.
    store.publish(learner["train"], first_update)
    policy_step = make_policy_step(setup.network.apply, ppo_config)
    queues = [queue.Queue(maxsize=1) for _ in range(layout.num_actor_threads)]
    settings = ActorSettings(sebulba.rollout_len, sebulba.synchronous, time_transfers=bool(profiler))
    if first_update:
        actor_key = jax.random.fold_in(actor_key, first_update)
    actors = []
    for actor_id in range(layout.num_actor_threads):
        # Numbered over every process: each process's environments and keys are its own.
        numbered = jax.process_index() * layout.num_actor_threads + actor_id
        # Made here rather than in the thread: a bad environment fails before anything starts.
        envs = EnvPoolEnvs(run.env, layout.envs_per_thread, layout.env_batch, sebulba.env_threads,
                           seed=env_seed(run.seed, numbered, first_update))
        device = split.actor[actor_id // sebulba.actor_threads]
        actors.append(threading.Thread(
            target=control.guard(run_actor, f"actor thread {actor_id}"),
            args=(actor_id, envs, settings, device, policy_step, store, queues[actor_id], setup.mesh,
                  jax.random.fold_in(actor_key, numbered), control, timings),
            name=f"sebulba-actor-{actor_id}", daemon=True))

    log = IntervalLog(logger, timings, sebulba.log_every, steps, setup.num_updates, first_update)
    every = checkpoint.checkpoint_every
    saving = Saving(lambda updates, state: checkpointer.save(
        updates * steps, {"train": state, "key": learner["key"]}, {"updates": updates}),
        every=math.ceil(every / steps) if every else 0)
    final = []

    def learn():
        final.append(run_learner(setup.step_fn, learner["train"], queues, store, setup.num_updates,
                                 learner["key"], control, timings, log, first_update=first_update,
                                 saving=saving, interrupted=lambda: bool(signalled),
                                 steps_per_update=steps))

    learner_thread = threading.Thread(target=control.guard(learn, "learner thread"),
                                      name="sebulba-learner", daemon=True)
    if profiler:
        profiler.start()
    train_start = log.start = time.perf_counter()
    try:
        with stop_on_signals() as signalled:
            for thread in (*actors, learner_thread):
                thread.start()
            # The learner notices a signal itself, so that it saves, and on several
            # processes stops after the same update as the others.
            wait_for_threads(control, learner_thread, actors)
        # The threads are done: the time breakdown's window ends here, not after the last save
        # has reached the disk (the main thread's wait below).
        train_s = time.perf_counter() - train_start
        profiled = {"profile": profiler.stop()} if profiler else {}
    finally:
        # Whatever stopped the run, a save already started is completed, never left half-written.
        checkpointer.wait()
        checkpointer.close()
    totals = timings.totals()
    env_steps = log.updates * steps
    new_steps = (log.updates - first_update) * steps
    stopped = log.updates < setup.num_updates
    summary = logger.summary({
        "arch": "sebulba", "algo": "ppo", "env": run.env,
        "env_steps": env_steps,
        "sps": new_steps / train_s if new_steps else None,
        "episode_return_mean": log.last_return if log.last_return is not None else logger.last_return,
        "updates": log.updates,
        # Over every process, as the sizes are.
        "actor_devices": len(split.actor) * jax.process_count(),
        "learner_devices": setup.mesh.devices.size,
        "actor_threads": layout.num_actor_threads * jax.process_count(),
        **log.run_summary(),
        "compile_s": setup.compile_s,
        "train_s": train_s,
        "resumed_from_env_steps": first_update * steps if resuming else None,
        "processes": jax.process_count(),
        # Every process must hold the same parameters; one hash per process proves it.
        "params_fingerprints": parallel.process_fingerprints(final[0].params),
        **as_metrics(totals),
        "wall_s": time.perf_counter() - wall_start,
        **profiled,
        "config": config_record(used_configs(configs)),
    })
    if logger.enabled and not profiler:  # a profile prints its own, fuller table
        logger.stream.write(format_breakdown(totals, train_s))
        logger.stream.flush()
    if stopped:
        signum = signalled.signal or signal.SIGTERM  # another process may have received it
        saved = (f"checkpoint saved; resume with --run-dir={run.run_dir}" if log.updates
                 else "nothing to save yet")
        raise Interrupted(signum, f"stopped by signal {signum} after {log.updates} updates "
                                  f"({env_steps:,} env steps); {saved}")
    return summary, final[0]
