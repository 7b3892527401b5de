"""Host driver for Sebulba ES: envpool actors evaluate the population, the learner tells.

Generations run in lock step: actor threads evaluate generation `g` with the
mean published as version `g`, the learner gathers every thread's fitness into
the `[population]` vector, runs the strategy's `tell` on the learner devices
and publishes version `g + 1`. The update is a few fitness scalars' worth of
work, so there is nothing to overlap it with; the actors' episodes are the run.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from podracer import es, parallel
from podracer.anakin.train_es import es_row
from podracer.checkpoint import stop_on_signals
from podracer.config import LogConfig
from podracer.errors import Interrupted, PodracerError
from podracer.es.config import make_strategy
from podracer.logger import RunLogger, prepare_run_dir
from podracer.networks import make_policy_network
from podracer.profile import make_profiler
from podracer.sebulba.config import DeviceSplit, split_devices
from podracer.sebulba.control import Control, wait_for_threads
from podracer.sebulba.envs import EnvPoolEnvs, env_spec
from podracer.sebulba.es import (ESLayout, generation_key, make_es_layout, make_es_learner_step,
                                 make_slot_act, make_slot_params)
from podracer.sebulba.es_actor import Evaluation, SearchPolicy, run_es_actor
from podracer.sebulba.learner import get_until_stopped
from podracer.sebulba.params import ParamsStore
from podracer.sebulba.train import run_cpu_work_inline
from podracer.timing import Timings, as_metrics, format_breakdown


class ESSetup(NamedTuple):
    """Everything built (and compiled) before a thread starts."""

    spec: Any
    split: DeviceSplit
    layout: ESLayout
    state: Any  # the strategy state, replicated over the learner mesh
    obs_stats: es.RunningStats  # likewise
    es_key: jax.Array  # generation g asks and tells with generation_key(es_key, g)
    learner_step: Callable
    slot_params: Callable
    act: Callable
    num_params: int
    compile_s: float


def build(configs: dict[str, Any], devices=None) -> ESSetup:
    """Check the configs against the devices, build the pure pieces, compile them on their devices."""
    run, es_config, sebulba, net = configs["run"], configs["es"], configs["sebulba"], configs["network"]
    if run.total_steps <= 0:
        raise PodracerError(f"--total-steps must be positive, got {run.total_steps}")
    if jax.process_count() > 1:
        raise PodracerError("Sebulba ES across processes is not available yet; run it in one "
                            "process (drop --num-processes and --coordinator)")
    spec = env_spec(run.env)
    split = split_devices(sebulba, jax.local_devices() if devices is None else devices)
    layout = make_es_layout(es_config, sebulba, split)
    policy = make_policy_network(spec.obs_shape, spec.action_dim, spec.discrete, net.hidden,
                                 net.activation)
    strategy = make_strategy(es_config)
    normalize = es_config.normalize_observations
    # The same initial mean as Anakin ES for the same seed.
    param_key, es_key = jax.random.split(jax.random.PRNGKey(run.seed))
    flat, unravel = ravel_pytree(policy.init(param_key, jnp.zeros(spec.obs_shape, spec.obs_dtype)))
    mesh = parallel.make_mesh(split.learner)
    everywhere = parallel.replicated(mesh)
    state = jax.jit(strategy.init, out_shardings=everywhere)(flat)
    obs_dim = math.prod(spec.obs_shape)
    obs_stats = jax.device_put(es.init_running_stats(obs_dim), everywhere)
    learner_step = make_es_learner_step(strategy, mesh, normalize)
    slot_params = make_slot_params(strategy, unravel, layout, es_config.episodes_per_member)
    act = make_slot_act(policy.apply, normalize)

    # Compile every function once, on the devices and shapes the threads will use.
    compile_start = time.perf_counter()
    no_observations = es.init_running_stats(obs_dim)
    stacked = jax.tree.map(lambda x: np.stack([x] * layout.num_actor_threads), no_observations)
    jax.block_until_ready(learner_step(state, obs_stats, es_key,
                                       np.zeros(es_config.population, np.float32), stacked))
    for device in dict.fromkeys(split.actor):
        actor_state, actor_stats, seen = jax.device_put((state, obs_stats, no_observations), device)
        members = jax.device_put(np.arange(layout.members_per_thread, dtype=np.int32), device)
        params = slot_params(actor_state, es_key, members)
        obs = np.zeros((layout.slots_per_thread, *spec.obs_shape), spec.obs_dtype)
        jax.block_until_ready(act(params, actor_stats, obs, np.ones(layout.slots_per_thread, bool), seen))
    return ESSetup(spec, split, layout, state, obs_stats, es_key, learner_step, slot_params, act,
                   int(flat.shape[0]), time.perf_counter() - compile_start)


class GenerationLog:
    """Called after every generation; writes a metrics.jsonl row every `log_every` and after the last.

    Rows carry the keys of Anakin ES (`es_row`): `episode_return_mean` is the
    population's mean fitness over the interval's generations,
    `mean_params_return` the mean return of the last generation's evaluation
    episodes of the mean parameters that generation was sampled around.
    """

    def __init__(self, logger: RunLogger, timings: Timings, log_every: int):
        self.logger, self.timings, self.log_every = logger, timings, log_every
        self.start = time.perf_counter()
        self.generations = self.env_steps = self.eval_steps = self.ignored_steps = 0
        self.mean_params_return: float | None = None
        self.last_row: dict = {}
        self._interval: list[dict] = []

    def __call__(self, generation: int, evaluations: Sequence[Evaluation], metrics: dict,
                 last: bool) -> None:
        with self.timings.measure("logging"):
            self._record(generation, evaluations, metrics, last)

    def _record(self, generation: int, evaluations: Sequence[Evaluation], metrics: dict,
                last: bool) -> None:
        self.generations = generation + 1
        self.env_steps += sum(e.member_steps for e in evaluations)
        self.eval_steps += sum(e.eval_steps for e in evaluations)
        self.ignored_steps += sum(e.ignored_steps for e in evaluations)
        self.mean_params_return = float(np.mean(np.concatenate([e.mean_returns for e in evaluations])))
        self._interval.append(metrics)
        if self.generations % self.log_every and not last:
            return
        stacked = {name: np.asarray([m[name] for m in self._interval]) for name in self._interval[0]}
        row = es_row({**stacked, "mean_params_return": self.mean_params_return})
        elapsed = time.perf_counter() - self.start
        row.update(env_steps=self.env_steps, generations=self.generations,
                   sps=self.env_steps / elapsed, generations_per_s=self.generations / elapsed,
                   **as_metrics(self.timings.totals()))
        self.logger.log(row)
        self.last_row = row
        self._interval = []


def run_es_learner(setup: ESSetup, sources: Sequence[queue.Queue], store: ParamsStore,
                   total_steps: int, control: Control, timings: Timings,
                   on_generation: Callable[[int, list[Evaluation], dict, bool], None]):
    """Gather each generation's evaluations, tell, publish; until the members played `total_steps`.

    Returns the last (strategy state, obs_stats), early if stopped.
    """
    state, obs_stats = setup.state, setup.obs_stats
    env_steps, generation = 0, 0
    while env_steps < total_steps:
        evaluations = []
        for source in sources:
            with timings.measure("learner_queue_wait"):
                evaluation = get_until_stopped(source, control.stop)
            if evaluation is None:
                return state, obs_stats
            evaluations.append(evaluation)
        # Thread t holds members [t * m, (t + 1) * m): actor order is member order.
        fitness = np.concatenate([e.fitness for e in evaluations]).astype(np.float32)
        seen = jax.tree.map(lambda *parts: np.stack(parts), *(e.seen for e in evaluations))
        with timings.measure("learner_update"):
            state, obs_stats, metrics = setup.learner_step(
                state, obs_stats, generation_key(setup.es_key, generation), fitness, seen)
            metrics = {name: float(value) for name, value in jax.device_get(metrics).items()}
        env_steps += sum(e.member_steps for e in evaluations)
        with timings.measure("params_to_actors"):
            store.publish(SearchPolicy(state, obs_stats), generation + 1)
        on_generation(generation, evaluations, metrics, env_steps >= total_steps)
        generation += 1
    return state, obs_stats


def train_es_from_configs(configs: dict[str, Any]):
    """The launcher's entry point: `train_es` with CPU work inline (see `run_cpu_work_inline`)."""
    run_cpu_work_inline()
    return train_es(configs)


def train_es(configs: dict[str, Any], devices=None):
    """Train a policy with evolution strategies on Sebulba; returns (summary, (state, obs_stats)).

    `configs` maps section names to config dataclasses (`run`, `es`, `sebulba`,
    `network`), as `podracer.cli.parse_configs` returns them. The run ends
    after the generation in which the members' episodes reach `total_steps`
    agent steps (`env_steps`; the mean parameters' evaluation episodes and
    the ignored steps of slots waiting for the others are counted apart).
    SIGINT/SIGTERM stop every thread and raise `Interrupted` after the summary
    is written; a failure in any thread stops every thread and is re-raised.
    """
    wall_start = time.perf_counter()
    run, es_config, sebulba = configs["run"], configs["es"], configs["sebulba"]
    setup = build(configs, devices)
    layout, split = setup.layout, setup.split
    prepare_run_dir(run.run_dir)
    logger = RunLogger(run.run_dir, run.total_steps)

    profiler = make_profiler(configs.get("logging", LogConfig()), run.run_dir)
    control, timings = Control(), profiler or Timings()
    store = ParamsStore(split.actor)
    store.publish(SearchPolicy(setup.state, setup.obs_stats), 0)
    queues = [queue.Queue(maxsize=1) for _ in range(layout.num_actor_threads)]
    actors = []
    for actor_id in range(layout.num_actor_threads):
        # Made here rather than in the thread: a bad environment fails before anything starts.
        envs = EnvPoolEnvs(run.env, layout.slots_per_thread, layout.slots_per_thread,
                           sebulba.env_threads,
                           seed=int(np.random.SeedSequence([run.seed, actor_id]).generate_state(1)[0] >> 1))
        device = split.actor[actor_id // sebulba.actor_threads]
        actors.append(threading.Thread(
            target=control.guard(run_es_actor, f"actor thread {actor_id}"),
            args=(actor_id, envs, layout, es_config.episodes_per_member, device, setup.slot_params,
                  setup.act, store, queues[actor_id], setup.es_key, control, timings),
            name=f"sebulba-es-actor-{actor_id}", daemon=True))

    log = GenerationLog(logger, timings, sebulba.log_every)
    final = []

    def learn():
        final.append(run_es_learner(setup, queues, store, run.total_steps, control, timings, log))

    learner = threading.Thread(target=control.guard(learn, "learner thread"),
                               name="sebulba-es-learner", daemon=True)
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
    summary = logger.summary({
        "arch": "sebulba", "algo": "es", "variant": es_config.variant, "env": run.env,
        "env_steps": log.env_steps,
        "sps": log.env_steps / train_s,
        "episode_return_mean": log.last_row.get("episode_return_mean"),
        "mean_params_return": log.mean_params_return,
        "generations": log.generations,
        "generations_per_s": log.generations / train_s,
        "population": es_config.population,
        "num_params": setup.num_params,
        "actor_devices": len(split.actor),
        "learner_devices": len(split.learner),
        "actor_threads": layout.num_actor_threads,
        "eval_steps": log.eval_steps,
        "ignored_steps": log.ignored_steps,
        "compile_s": setup.compile_s,
        "train_s": train_s,
        **as_metrics(totals),
        "wall_s": time.perf_counter() - wall_start,
        **profiled,
    })
    if logger.enabled and not profiler:  # a profile prints its own, fuller table
        logger.stream.write(format_breakdown(totals, train_s))
        logger.stream.flush()
    if signalled:
        raise Interrupted(signalled.signal, f"stopped by signal {signalled.signal} after "
                                            f"{log.generations} generations ({log.env_steps:,} env "
                                            f"steps); Sebulba keeps no checkpoint, so a new run "
                                            f"starts over")
    return summary, (final[0] if final else (setup.state, setup.obs_stats))
