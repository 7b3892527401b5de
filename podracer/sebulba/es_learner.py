"""The Sebulba ES learner: gather every thread's fitness, `tell`, publish the new mean.

Generations run in lock step: actor threads evaluate generation `g` with the
mean published as version `g`, the learner gathers every thread's fitness into
the `[population]` vector (from every process: the only data that crosses
processes, with ARS V2's observation statistics), runs the strategy's `tell`
on the learner devices and publishes version `g + 1`.
"""

from __future__ import annotations

import math
import queue
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from podracer import es
from podracer.es.metrics import es_row
from podracer.protocol import parallel
from podracer.sebulba.control import Control
from podracer.sebulba.es import generation_key
from podracer.sebulba.es_actor import Evaluation, SearchPolicy
from podracer.sebulba.learner import take_one_each
from podracer.sebulba.params import ParamsStore
from podracer.session.logger import RunLogger
from podracer.session.timing import Timings, as_metrics


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
        row.pop("finite")  # the learner's guard has checked every generation
        elapsed = time.perf_counter() - self.start
        row.update(env_steps=self.env_steps, generations=self.generations,
                   sps=(self.env_steps - self.first.env_steps) / elapsed,
                   generations_per_s=(self.generations - self.first.generations) / elapsed,
                   **as_metrics(self.timings.totals()))
        self.logger.log(row)
        self.last_row = row
        self._interval = []


class ESLearning(NamedTuple):
    """What the ES learner thread runs with: one record rather than a dozen arguments."""

    learner_step: Callable  # `make_es_learner_step`
    es_key: jax.Array  # generation g asks and tells with generation_key(es_key, g)
    mesh: Any  # the learner devices of every process
    sources: Sequence[queue.Queue]  # one per actor thread, in actor order
    store: ParamsStore
    total_steps: int
    control: Control
    timings: Timings
    on_generation: Callable[[int, Generation, dict, bool], None]
    start: Progress = Progress()
    save: Callable[[Any, Any], None] | None = None  # (state, obs_stats)
    save_every: int = 0  # env steps
    interrupted: Callable[[], bool] = lambda: False
    guard: Callable[[bool, int], None] = lambda finite, generation: None  # the NaN guard


def run_es_learner(learning: ESLearning, state, obs_stats):
    """Gather each generation's evaluations, tell, publish; until the members played `total_steps`.

    Starts after `start.generations` generations (a resumed run, whose state
    and statistics are given). `save(state, obs_stats)` runs after the
    generation that passes each multiple of `save_every` env steps (0: never
    periodically) and at the end, also when `interrupted()` (a signal) ends the
    run early; on several processes all of them decide together to stop, after
    the same generation. `guard(finite, generation)` raises before a
    non-finite mean is published or saved. Returns the last (strategy state,
    obs_stats), early and unsaved if `control.stop` is set (a failure elsewhere).
    """
    (learner_step, es_key, mesh, sources, store, total_steps, control, timings, on_generation,
     start, save, save_every, interrupted, guard) = learning
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
            state, obs_stats, metrics = learner_step(state, obs_stats, *learner_inputs(
                es_key, generation, result.fitness, result.seen, mesh))
            metrics = {name: float(value) for name, value in parallel.to_host(metrics).items()}
        finite = metrics.pop("params_finite", 1.0) == 1.0
        guard(finite and all(math.isfinite(v) for v in metrics.values()), generation + 1)
        env_steps += result.member_steps
        generation += 1
        with timings.measure("params_to_actors"):
            store.publish(SearchPolicy(state, obs_stats), generation)
        on_generation(generation - 1, result, metrics, env_steps >= total_steps)
        if save is not None and save_every and env_steps // save_every > saved_steps // save_every:
            save(state, obs_stats)
            saved_generation, saved_steps = generation, env_steps
    if save is not None and generation > saved_generation:
        save(state, obs_stats)
    return state, obs_stats
