"""Host driver for Sebulba PPO: split the devices, start actors and learner, log, stop cleanly."""

from __future__ import annotations

import math
import queue
import threading
import time

import jax
import numpy as np

from podracer import parallel
from podracer.config import NetworkConfig, OptimConfig, RunConfig, make_optimizer
from podracer.checkpoint import stop_on_signals
from podracer.errors import Interrupted, PodracerError
from podracer.logger import RunLogger, prepare_run_dir
from podracer.networks import init_params, make_network
from podracer.ppo import PPOConfig, init_train_state
from podracer.sebulba.actor import ActorSettings, Trajectory, make_policy_step, run_actor
from podracer.sebulba.config import SebulbaConfig, make_layout, split_devices
from podracer.sebulba.control import Control, wait_for_threads
from podracer.sebulba.envs import EnvPoolEnvs, env_spec
from podracer.sebulba.learner import make_learner_step, run_learner, trajectory_shapes
from podracer.sebulba.params import ParamsStore
from podracer.timing import Timings, as_metrics, format_breakdown
from podracer.types import Transition


def _row_shapes(spec, rollout_len: int) -> Transition:
    """One environment's column of a trajectory, as zeros: the shapes the learner compiles for."""
    t = rollout_len
    action = np.zeros((t,), np.int32) if spec.discrete else np.zeros((t, spec.action_dim), np.float32)
    scalar = np.zeros((t,), np.float32)
    flag = np.zeros((t,), bool)
    return Transition(np.zeros((t, *spec.obs_shape), spec.obs_dtype), action, scalar, flag, flag,
                      scalar, scalar, scalar)


class _IntervalLog:
    """Aggregates updates into metrics.jsonl rows, every `log_every` updates."""

    def __init__(self, logger: RunLogger, timings: Timings, log_every: int, steps_per_update: int,
                 num_updates: int):
        self.logger, self.timings = logger, timings
        self.log_every, self.steps_per_update, self.num_updates = log_every, steps_per_update, num_updates
        self.start = time.perf_counter()
        self.last_return = None
        self.lags: list[int] = []  # every trajectory's lag, over the run
        self.updates = 0
        self.dropped = self.resets = 0
        self._reset_interval()

    def _reset_interval(self):
        self.metrics: list[dict] = []
        self.returns: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []
        self.interval_lags: list[int] = []

    def __call__(self, update: int, trajectories: list[Trajectory], metrics: dict) -> None:
        # Update u is the (u+1)-th; the parameters it changes have had u updates.
        lags = [update - t.policy_version for t in trajectories]
        self.newest_version = max(t.policy_version for t in trajectories)
        self.updates = update + 1
        self.lags += lags
        self.interval_lags += lags
        self.metrics.append(metrics)
        self.returns += [t.episode_returns for t in trajectories]
        self.lengths += [t.episode_lengths for t in trajectories]
        self.dropped += sum(t.dropped_steps for t in trajectories)
        self.resets += sum(t.reset_steps for t in trajectories)
        if (update + 1) % self.log_every and update + 1 < self.num_updates:
            return
        returns, lengths = np.concatenate(self.returns), np.concatenate(self.lengths)
        env_steps = (update + 1) * self.steps_per_update
        row = {name: float(np.mean([m[name] for m in self.metrics])) for name in self.metrics[0]}
        row.update(
            env_steps=env_steps,
            sps=env_steps / (time.perf_counter() - self.start),
            episode_return_mean=float(returns.mean()) if returns.size else None,
            episode_length_mean=float(lengths.mean()) if lengths.size else None,
            episodes=int(returns.size),
            policy_lag_mean=float(np.mean(self.interval_lags)),
            policy_lag_max=int(np.max(self.interval_lags)),
            policy_version=self.newest_version,
            updates=update + 1,
            **as_metrics(self.timings.totals()))
        if returns.size:
            self.last_return = row["episode_return_mean"]
        self.logger.log(row)
        self._reset_interval()


def train_ppo(run: RunConfig, ppo_config: PPOConfig, sebulba: SebulbaConfig,
              optim: OptimConfig, net: NetworkConfig, devices=None):
    """Train PPO with Sebulba on `devices` (default: this host's); returns (summary, final state).

    Actor threads step envpool environments on the host and act on their actor
    device; the learner updates on the learner devices. Ctrl-C, SIGTERM or a
    failure in any thread stops every thread within seconds and propagates.
    """
    if run.total_steps <= 0:
        raise PodracerError(f"--total-steps must be positive, got {run.total_steps}")
    spec = env_spec(run.env)
    split = split_devices(sebulba, jax.local_devices() if devices is None else devices)
    layout = make_layout(sebulba, ppo_config, split)
    num_updates = max(1, math.ceil(run.total_steps / layout.steps_per_update))
    prepare_run_dir(run.run_dir)
    logger = RunLogger(run.run_dir, num_updates * layout.steps_per_update)

    network = make_network(spec.obs_shape, spec.action_dim, spec.discrete, net.hidden, net.activation)
    optimizer = make_optimizer(optim, num_updates * ppo_config.epochs * ppo_config.minibatches)
    mesh = parallel.make_mesh(split.learner)
    param_key, actor_key, learner_key = jax.random.split(jax.random.PRNGKey(run.seed), 3)
    # One jitted call: eager initialisation would compile every small op on its own.
    state = jax.jit(lambda key: init_train_state(init_params(network, spec.obs_shape, spec.obs_dtype, key),
                                                 optimizer, spec.obs_shape),
                    out_shardings=parallel.replicated(mesh))(param_key)

    compile_start = time.perf_counter()
    batch, bootstrap = trajectory_shapes(_row_shapes(spec, sebulba.rollout_len), layout.envs_per_thread, mesh)
    step_fn = make_learner_step(network.apply, optimizer, ppo_config, mesh).lower(
        state, (batch,) * layout.num_actor_threads, (bootstrap,) * layout.num_actor_threads,
        learner_key).compile()
    compile_s = time.perf_counter() - compile_start

    control, timings = Control(), Timings()
    store = ParamsStore(split.actor)
    store.publish(state, 0)
    policy_step = make_policy_step(network.apply, ppo_config)
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
            args=(actor_id, envs, settings, device, policy_step, store, queues[actor_id], mesh,
                  jax.random.fold_in(actor_key, actor_id), control, timings),
            name=f"sebulba-actor-{actor_id}", daemon=True))

    log = _IntervalLog(logger, timings, sebulba.log_every, layout.steps_per_update, num_updates)
    final = []

    def learn():
        final.append(run_learner(step_fn, state, queues, store, num_updates, learner_key, control,
                                 timings, log))

    learner = threading.Thread(target=control.guard(learn, "learner thread"), name="sebulba-learner",
                               daemon=True)
    train_start = time.perf_counter()
    log.start = train_start
    with stop_on_signals() as signalled:
        for thread in (*actors, learner):
            thread.start()
        wait_for_threads(control, learner, actors, interrupted=lambda: bool(signalled))
    train_s = time.perf_counter() - train_start
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
        "policy_lag_mean": float(np.mean(log.lags)) if log.lags else None,
        "policy_lag_max": int(np.max(log.lags)) if log.lags else None,
        "dropped_steps": log.dropped,
        "reset_steps": log.resets,
        "compile_s": compile_s,
        "train_s": train_s,
        **as_metrics(totals),
    })
    if logger.enabled:
        logger.stream.write(format_breakdown(totals, train_s))
        logger.stream.flush()
    if signalled:
        raise Interrupted(signalled.signal, f"stopped by signal {signalled.signal} after {log.updates} "
                                            f"updates ({env_steps:,} env steps); Sebulba keeps no "
                                            f"checkpoint, so a new run starts over")
    return summary, final[0]
