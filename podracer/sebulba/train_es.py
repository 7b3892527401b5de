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
import signal
import threading
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from podracer import es
from podracer.protocol import parallel
from podracer.anakin.train_es import es_row
from podracer.session.checkpoint import Checkpointer, check_resumable, config_record, stop_on_signals
from podracer.config import LogConfig, used_configs
from podracer.errors import Interrupted
from podracer.es.config import make_strategy
from podracer.session.logger import RunLogger
from podracer.networks import make_policy_network
from podracer.session.profile import make_profiler
from podracer.sebulba.config import DeviceSplit, split_devices
from podracer.sebulba.control import Control, wait_for_threads
from podracer.sebulba.envs import EnvPoolEnvs, env_spec
from podracer.sebulba.es import (ESLayout, generation_key, global_thread, make_es_layout,
                                 make_es_learner_step, make_slot_act, make_slot_params)
from podracer.sebulba.es_actor import Evaluation, SearchPolicy, run_es_actor
from podracer.sebulba.learner import take_one_each
from podracer.sebulba.params import ParamsStore
from podracer.session.run_dir import prepare_run_dir
from podracer.sebulba.train import env_seed
from podracer.session.timing import Timings, as_metrics, format_breakdown


class ESSetup(NamedTuple):
    """Everything built (and compiled) before a thread starts."""

    spec: Any
    split: DeviceSplit
    layout: ESLayout
    mesh: Any  # the learner devices of every process
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
    spec = env_spec(run.env)
    split = split_devices(sebulba, jax.local_devices() if devices is None else devices)
    layout = make_es_layout(es_config, sebulba, split, jax.process_count())
    policy = make_policy_network(spec.obs_shape, spec.action_dim, spec.discrete, net.hidden,
                                 net.activation)
    strategy = make_strategy(es_config)
    normalize = es_config.normalize_observations
    # The same initial mean as Anakin ES for the same seed.
    param_key, es_key = jax.random.split(jax.random.PRNGKey(run.seed))
    no_obs = jnp.zeros(spec.obs_shape, spec.obs_dtype)
    flat, unravel = ravel_pytree(policy.init(param_key, no_obs))
    mesh = parallel.make_mesh(parallel.process_major(split.learner))
    everywhere = parallel.replicated(mesh)
    # Made inside one jitted call, so that the state is a global array on several processes.
    state = jax.jit(lambda key: strategy.init(ravel_pytree(policy.init(key, no_obs))[0]),
                    out_shardings=everywhere)(param_key)
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


def learner_inputs(es_key: jax.Array, generation: int, fitness: np.ndarray, seen: es.RunningStats,
                   mesh) -> tuple:
    """`(key, fitness, seen)` of one generation as arrays replicated over the learner mesh.

    Every process passes the same values (the gathered fitness vector), so each
    holds the whole array, as a replicated global array needs.
    """
    key = np.asarray(generation_key(es_key, generation))
    return parallel.from_host((key, fitness, seen), parallel.replicated(mesh))


class Generation(NamedTuple):
    """One generation's results from every actor thread of every process, on the host."""

    fitness: np.ndarray  # [population] float32, in member order
    mean_returns: np.ndarray  # returns of the mean parameters' evaluation episodes
    seen: es.RunningStats  # per-thread observation statistics stacked along the first axis
    member_steps: int
    eval_steps: int
    ignored_steps: int


def gather_generation(evaluations: Sequence[Evaluation]) -> Generation:
    """This process's evaluations, joined with every other process's (in process order).

    Threads are numbered process by process, and each holds a consecutive block
    of members, so process order is member order. The gather is scalars per
    member and the small statistics: never parameters.
    """
    local = {
        # Thread t holds members [t * m, (t + 1) * m): actor order is member order.
        "fitness": np.concatenate([e.fitness for e in evaluations]).astype(np.float32),
        "mean_returns": np.concatenate([e.mean_returns for e in evaluations]).astype(np.float32),
        "seen": jax.tree.map(lambda *parts: np.stack(parts), *(e.seen for e in evaluations)),
        "steps": np.asarray([[e.member_steps, e.eval_steps, e.ignored_steps] for e in evaluations],
                            np.int64),
    }
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        local = jax.tree.map(lambda x: np.asarray(x).reshape(-1, *x.shape[2:]),
                             multihost_utils.process_allgather(local, tiled=False))
    member_steps, eval_steps, ignored_steps = (int(n) for n in local["steps"].sum(axis=0))
    return Generation(local["fitness"], local["mean_returns"], local["seen"], member_steps, eval_steps,
                      ignored_steps)


class Progress(NamedTuple):
    """Counters of a run so far: what a checkpoint keeps besides the state."""

    generations: int = 0
    env_steps: int = 0  # agent steps of the members' episodes
    eval_steps: int = 0  # of the mean parameters' evaluation episodes
    ignored_steps: int = 0  # of slots whose episode was over, waiting for the others


class GenerationLog:
    """Called after every generation; writes a metrics.jsonl row every `log_every` and after the last.

    Rows carry the keys of Anakin ES (`es_row`): `episode_return_mean` is the
    population's mean fitness over the interval's generations,
    `mean_params_return` the mean return of the last generation's evaluation
    episodes of the mean parameters that generation was sampled around. A
    resumed run counts on from `start`; its rates count only the work since.
    """

    def __init__(self, logger: RunLogger, timings: Timings, log_every: int, start: Progress = Progress()):
        self.logger, self.timings, self.log_every = logger, timings, log_every
        self.start = time.perf_counter()
        self.first = start
        self.generations, self.env_steps, self.eval_steps, self.ignored_steps = start
        self.mean_params_return: float | None = None
        self.last_row: dict = {}
        self._interval: list[dict] = []

    @property
    def progress(self) -> Progress:
        return Progress(self.generations, self.env_steps, self.eval_steps, self.ignored_steps)

    def __call__(self, generation: int, result: Generation, metrics: dict, last: bool) -> None:
        with self.timings.measure("logging"):
            self._record(generation, result, metrics, last)

    def _record(self, generation: int, result: Generation, metrics: dict, last: bool) -> None:
        self.generations = generation + 1
        self.env_steps += result.member_steps
        self.eval_steps += result.eval_steps
        self.ignored_steps += result.ignored_steps
        self.mean_params_return = float(np.mean(result.mean_returns))
        self._interval.append(metrics)
        if self.generations % self.log_every and not last:
            return
        stacked = {name: np.asarray([m[name] for m in self._interval]) for name in self._interval[0]}
        row = es_row({**stacked, "mean_params_return": self.mean_params_return})
        elapsed = time.perf_counter() - self.start
        row.update(env_steps=self.env_steps, generations=self.generations,
                   sps=(self.env_steps - self.first.env_steps) / elapsed,
                   generations_per_s=(self.generations - self.first.generations) / elapsed,
                   **as_metrics(self.timings.totals()))
        self.logger.log(row)
        self.last_row = row
        self._interval = []


def run_es_learner(setup: ESSetup, sources: Sequence[queue.Queue], store: ParamsStore,
                   total_steps: int, control: Control, timings: Timings,
                   on_generation: Callable[[int, Generation, dict, bool], None],
                   start: Progress = Progress(), save: Callable[[Any, Any], None] | None = None,
                   save_every: int = 0, interrupted: Callable[[], bool] = lambda: False):
    """Gather each generation's evaluations, tell, publish; until the members played `total_steps`.

    Starts after `start.generations` generations (a resumed run, whose state
    `setup` holds). `save(state, obs_stats)` runs after the generation that
    passes each multiple of `save_every` env steps (0: never periodically) and
    at the end, also when `interrupted()` (a signal) ends the run early; on
    several processes all of them decide together to stop, after the same
    generation. Returns the last (strategy state, obs_stats), early and
    unsaved if `control.stop` is set (a failure elsewhere).
    """
    state, obs_stats = setup.state, setup.obs_stats
    generation, env_steps = start.generations, start.env_steps
    saved_generation, saved_steps = generation, env_steps
    while env_steps < total_steps:
        evaluations = take_one_each(sources, control, timings, interrupted)
        if control.stop.is_set():
            return state, obs_stats
        if parallel.any_process(interrupted()):
            break
        with timings.measure("fitness_gather"):
            result = gather_generation(evaluations)
        with timings.measure("learner_update"):
            state, obs_stats, metrics = setup.learner_step(state, obs_stats, *learner_inputs(
                setup.es_key, generation, result.fitness, result.seen, setup.mesh))
            metrics = {name: float(value) for name, value in parallel.to_host(metrics).items()}
        env_steps += result.member_steps
        generation += 1
        with timings.measure("params_to_actors"):
            store.publish(SearchPolicy(state, obs_stats), generation)
        on_generation(generation - 1, result, metrics, env_steps >= total_steps)
        if save is not None and save_every and env_steps // save_every > saved_steps // save_every:
            with timings.measure("checkpoint"):
                save(state, obs_stats)
            saved_generation, saved_steps = generation, env_steps
    if save is not None and generation > saved_generation:
        with timings.measure("checkpoint"):
            save(state, obs_stats)
    return state, obs_stats


def train_es(configs: dict[str, Any], devices=None):
    """Train a policy with evolution strategies on Sebulba; returns (summary, (state, obs_stats)).

    `configs` maps section names to config dataclasses (`run`, `es`, `sebulba`,
    `network`, and optionally `checkpoint`, `logging`), as
    `podracer.orchestrate.cli.parse_configs` returns them. The run ends after the
    generation in which the members' episodes reach `total_steps` agent steps
    (`env_steps`; the mean parameters' evaluation episodes and the ignored
    steps of slots waiting for the others are counted apart). With a
    `checkpoint` section the learner saves into `run.run_dir` and a run
    directory with a checkpoint resumes from it. SIGINT/SIGTERM make the
    learner save and stop every thread, then raise `Interrupted` after the
    summary is written; a failure in any thread stops every thread and is
    re-raised.
    """
    wall_start = time.perf_counter()
    run, es_config, sebulba = configs["run"], configs["es"], configs["sebulba"]
    checkpoint = configs.get("checkpoint")
    resuming = checkpoint is not None and check_resumable(run.run_dir, checkpoint, configs)
    setup = build(configs, devices)
    layout, split = setup.layout, setup.split
    prepare_run_dir(run.run_dir)
    checkpointer = Checkpointer(run.run_dir, checkpoint, configs) if checkpoint is not None else None
    start = Progress()
    if resuming:
        restored, meta = checkpointer.restore({"es": setup.state, "obs_stats": setup.obs_stats})
        setup = setup._replace(state=restored["es"], obs_stats=restored["obs_stats"])
        start = Progress(*(int(meta[name]) for name in Progress._fields))
    logger = RunLogger(run.run_dir, run.total_steps, enabled=parallel.is_main_process(),
                       resume_steps=start.env_steps)
    logger.compiled(setup.compile_s)

    profiler = make_profiler(configs.get("logging", LogConfig()), run.run_dir)
    control, timings = Control(), profiler or Timings()
    store = ParamsStore(split.actor)
    # A policy's version is its generation: the number of updates applied to the mean.
    store.publish(SearchPolicy(setup.state, setup.obs_stats), start.generations)
    queues = [queue.Queue(maxsize=1) for _ in range(layout.num_actor_threads)]
    actors = []
    for actor_id in range(layout.num_actor_threads):
        numbered = global_thread(actor_id, layout, jax.process_index())
        # Made here rather than in the thread: a bad environment fails before anything starts.
        envs = EnvPoolEnvs(run.env, layout.slots_per_thread, layout.slots_per_thread,
                           sebulba.env_threads, seed=env_seed(run.seed, numbered, start.generations))
        device = split.actor[actor_id // sebulba.actor_threads]
        actors.append(threading.Thread(
            target=control.guard(run_es_actor, f"actor thread {actor_id}"),
            args=(numbered, envs, layout, es_config.episodes_per_member, device, setup.slot_params,
                  setup.act, store, queues[actor_id], setup.es_key, control, timings),
            name=f"sebulba-es-actor-{actor_id}", daemon=True))

    log = GenerationLog(logger, timings, sebulba.log_every, start)

    def save(state, obs_stats):
        progress = log.progress
        checkpointer.save(progress.env_steps, {"es": state, "obs_stats": obs_stats},
                          progress._asdict())

    final = []
    with stop_on_signals() as signalled:

        def learn():
            final.append(run_es_learner(
                setup, queues, store, run.total_steps, control, timings, log, start,
                save=save if checkpointer else None,
                save_every=checkpoint.checkpoint_every if checkpoint else 0,
                interrupted=lambda: bool(signalled)))

        learner = threading.Thread(target=control.guard(learn, "learner thread"),
                                   name="sebulba-es-learner", daemon=True)
        if profiler:
            profiler.start()
        train_start = log.start = time.perf_counter()
        try:
            for thread in (*actors, learner):
                thread.start()
            # The learner notices a signal itself, so that it saves, and on several
            # processes stops after the same generation as the others.
            wait_for_threads(control, learner, actors)
            # The threads are done: the time breakdown's window ends here, not after the last
            # save has reached the disk (the main thread's wait below).
            train_s = time.perf_counter() - train_start
            profiled = {"profile": profiler.stop()} if profiler else {}
        finally:
            # Whatever stopped the run, a save already started is completed, never left half-written.
            if checkpointer:
                checkpointer.wait()
                checkpointer.close()
    totals = timings.totals()
    state, _ = final[0] if final else (setup.state, setup.obs_stats)
    new_steps = log.env_steps - start.env_steps
    summary = logger.summary({
        "arch": "sebulba", "algo": "es", "variant": es_config.variant, "env": run.env,
        "env_steps": log.env_steps,
        "sps": new_steps / train_s,
        "episode_return_mean": log.last_row.get("episode_return_mean"),
        "mean_params_return": log.mean_params_return,
        "generations": log.generations,
        "generations_per_s": (log.generations - start.generations) / train_s,
        "population": es_config.population,
        "num_params": setup.num_params,
        "processes": jax.process_count(),
        "actor_devices": len(split.actor),
        "learner_devices": len(split.learner),
        "actor_threads": layout.num_actor_threads,
        "eval_steps": log.eval_steps,
        "ignored_steps": log.ignored_steps,
        "resumed_from_env_steps": start.env_steps if resuming else None,
        # Every process must hold the same mean; one hash per process proves it.
        "params_fingerprints": parallel.process_fingerprints(state.mean),
        "compile_s": setup.compile_s,
        "train_s": train_s,
        **as_metrics(totals),
        "wall_s": time.perf_counter() - wall_start,
        **profiled,
        "config": config_record(used_configs(configs)),
    })
    if logger.enabled and not profiler:  # a profile prints its own, fuller table
        logger.stream.write(format_breakdown(totals, train_s))
        logger.stream.flush()
    if log.env_steps < run.total_steps:
        signum = signalled.signal or signal.SIGTERM  # another process may have received it
        saved = (f"checkpoint saved; resume with --run-dir={run.run_dir}"
                 if checkpointer and log.generations else "nothing saved")
        raise Interrupted(signum, f"stopped by signal {signum} after {log.generations} generations "
                                  f"({log.env_steps:,} env steps); {saved}")
    return summary, (final[0] if final else (setup.state, setup.obs_stats))
