"""Host driver for Sebulba PPO: split the devices, start actors and learner, log, stop cleanly."""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from podracer import parallel
from podracer.checkpoint import stop_on_signals
from podracer.config import LogConfig, NetworkConfig, OptimConfig, RunConfig, make_optimizer
from podracer.errors import Interrupted, PodracerError
from podracer.logger import RunLogger, prepare_run_dir
from podracer.networks import init_params, make_network
from podracer.profile import make_profiler
from podracer.ppo import PPOConfig, init_train_state
from podracer.sebulba.actor import ActorSettings, make_policy_step, run_actor
from podracer.sebulba.config import DeviceSplit, Layout, SebulbaConfig, make_layout, split_devices
from podracer.sebulba.control import Control, wait_for_threads
from podracer.sebulba.envs import EnvPoolEnvs, env_spec
from podracer.sebulba.learner import make_learner_step, run_learner, trajectory_shapes
from podracer.sebulba.metrics import IntervalLog
from podracer.sebulba.params import ParamsStore
from podracer.timing import Timings, as_metrics, format_breakdown
from podracer.types import TrainState, Transition


class Setup(NamedTuple):
    """Everything built before a thread starts: sizes, network, learner state and its compiled step."""

    spec: Any
    split: DeviceSplit
    layout: Layout
    num_updates: int
    network: Any
    mesh: Any
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
    if run.total_steps <= 0:
        raise PodracerError(f"--total-steps must be positive, got {run.total_steps}")
    spec = env_spec(run.env)
    split = split_devices(sebulba, jax.local_devices() if devices is None else devices)
    layout = make_layout(sebulba, ppo_config, split)
    num_updates = max(1, math.ceil(run.total_steps / layout.steps_per_update))
    network = make_network(spec.obs_shape, spec.action_dim, spec.discrete, net.hidden, net.activation)
    optimizer = make_optimizer(optim, num_updates * ppo_config.epochs * ppo_config.minibatches)
    mesh = parallel.make_mesh(split.learner)
    # One jitted call: eager initialisation would compile every small op on its own.
    init = jax.jit(lambda key: init_train_state(
        init_params(network, spec.obs_shape, spec.obs_dtype, key), optimizer, spec.obs_shape),
        out_shardings=parallel.replicated(mesh))
    state = init(jax.random.fold_in(jax.random.PRNGKey(run.seed), 0))
    compile_start = time.perf_counter()
    batch, bootstrap = trajectory_shapes(_column_shapes(spec, sebulba.rollout_len), layout.envs_per_thread,
                                         mesh)
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
    """The launcher's entry point: `train_ppo` on the config sections, CPU work inline."""
    run_cpu_work_inline()
    return train_ppo(configs["run"], configs["ppo"], configs["sebulba"], configs["optimizer"],
                     configs["network"], log_config=configs["logging"])


def train_ppo(run: RunConfig, ppo_config: PPOConfig, sebulba: SebulbaConfig,
              optim: OptimConfig, net: NetworkConfig, devices=None, log_config: LogConfig = LogConfig()):
    """Train PPO with Sebulba on `devices` (default: this host's); returns (summary, final state).

    Actor threads step envpool environments on the host and act on their actor
    device; the learner updates on the learner devices. SIGINT/SIGTERM stop
    every thread and raise `Interrupted` (after writing the summary); a failure
    in any thread stops every thread and is re-raised. With `log_config.profile`
    the summary gets a per-thread time breakdown (`podracer.profile`).
    """
    setup = build(run, ppo_config, sebulba, optim, net, devices)
    layout, split = setup.layout, setup.split
    prepare_run_dir(run.run_dir)
    logger = RunLogger(run.run_dir, setup.num_updates * layout.steps_per_update)
    actor_key, learner_key = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(run.seed), 1))

    profiler = make_profiler(log_config, run.run_dir)
    control, timings = Control(), profiler or Timings()
    store = ParamsStore(split.actor)
    store.publish(setup.state, 0)
    policy_step = make_policy_step(setup.network.apply, ppo_config)
    queues = [queue.Queue(maxsize=1) for _ in range(layout.num_actor_threads)]
    settings = ActorSettings(sebulba.rollout_len, sebulba.synchronous)
    actors = []
    for actor_id in range(layout.num_actor_threads):
        # Made here rather than in the thread: a bad environment fails before anything starts.
        envs = EnvPoolEnvs(run.env, layout.envs_per_thread, layout.env_batch, sebulba.env_threads,
                           seed=int(np.random.SeedSequence([run.seed, actor_id]).generate_state(1)[0] >> 1))
        device = split.actor[actor_id // sebulba.actor_threads]
        actors.append(threading.Thread(
            target=control.guard(run_actor, f"actor thread {actor_id}"),
            args=(actor_id, envs, settings, device, policy_step, store, queues[actor_id], setup.mesh,
                  jax.random.fold_in(actor_key, actor_id), control, timings),
            name=f"sebulba-actor-{actor_id}", daemon=True))

    log = IntervalLog(logger, timings, sebulba.log_every, layout.steps_per_update, setup.num_updates)
    final = []

    def learn():
        final.append(run_learner(setup.step_fn, setup.state, queues, store, setup.num_updates,
                                 learner_key, control, timings, log))

    learner = threading.Thread(target=control.guard(learn, "learner thread"), name="sebulba-learner",
                               daemon=True)
    if profiler:
        profiler.start()
    train_start = log.start = time.perf_counter()
    with stop_on_signals() as signalled:
        for thread in (*actors, learner):
            thread.start()
        wait_for_threads(control, learner, actors, interrupted=lambda: bool(signalled))
    train_s = time.perf_counter() - train_start
    profiled = {"profile": profiler.stop()} if profiler else {}
    totals = timings.totals()
    env_steps = log.updates * layout.steps_per_update
    summary = logger.summary({
        "arch": "sebulba", "algo": "ppo", "env": run.env,
        "env_steps": env_steps,
        "sps": env_steps / train_s,
        "episode_return_mean": log.last_return,
        "updates": log.updates,
        "actor_devices": len(split.actor),
        "learner_devices": len(split.learner),
        "actor_threads": layout.num_actor_threads,
        **log.run_summary(),
        "compile_s": setup.compile_s,
        "train_s": train_s,
        **as_metrics(totals),
        **profiled,
    })
    if logger.enabled and not profiler:  # a profile prints its own, fuller table
        logger.stream.write(format_breakdown(totals, train_s))
        logger.stream.flush()
    if signalled:
        raise Interrupted(signalled.signal, f"stopped by signal {signalled.signal} after {log.updates} "
                                            f"updates ({env_steps:,} env steps); Sebulba keeps no "
                                            f"checkpoint, so a new run starts over")
    return summary, final[0]
