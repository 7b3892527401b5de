"""Sebulba ES: the ES agent (`podracer.es.agent`) on Sebulba's actor threads and learner, as any agent.

A generation is one trajectory of every actor thread (`podracer.sebulba.actor`):
the agent's `fresh_episodes` has each thread reset its envpool batch and play
every environment's first episode, cut at the environment's time limit (the
trajectory's length), and its `for_rollout` gives each environment its
member's parameters, drawn once per generation on the actor device. A thread's
environments are its members' episodes, then its share of the evaluation
episodes of the mean parameters (`make_agent`'s `eval_envs`). The learner runs
the agent's `learn` (`podracer.sebulba.learner`): the returns, gathered into
the fitness vector, and the strategy's `tell`; then it publishes the new
strategy state as version g + 1, which the actors wait for (lock step).

What is ES's own here: the sizes (`make_es_layout`), when a run ends (the
members' agent steps reach `--total-steps`), its log row (`es_row`), what a
checkpoint keeps (the strategy state, ARS V2's observation statistics and
the counters `Progress`) and the summary's keys.
"""

from __future__ import annotations

import math
import queue
import sys
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from podracer.acting import es_policy
from podracer.envs.spec import check_masked_inputs
from podracer.errors import PodracerError
from podracer.es.agent import ESState, make_agent
from podracer.es.config import ESConfig
from podracer.es.metrics import ES_FIX, es_row
from podracer.networks import make_policy_network
from podracer.protocol import parallel
from podracer.sebulba.actor import Acting, Actor, ActorSettings, run_actor, thread_env_index
from podracer.sebulba.config import DeviceSplit, SebulbaConfig, share_per_thread, split_devices
from podracer.sebulba.control import Control
from podracer.sebulba.envs import EnvPoolEnvs, env_spec, episode_limit
from podracer.sebulba.learner import Learning, run_learner
from podracer.sebulba.params import ParamsStore
from podracer.sebulba.threads import actor_thread, run_threads
from podracer.sebulba.train import compile_agent, env_seed
from podracer.session.logger import RunLogger
from podracer.session.session import RunSession
from podracer.session.timing import Timings, as_metrics

if TYPE_CHECKING:  # the command line's run spec, built above this layer
    from podracer.orchestrate.spec import RunSpec

# The most observation bytes an actor thread may hold for one generation's trajectory.
TRAJECTORY_BYTES = 2**31


class ESLayout(NamedTuple):
    """Sizes derived from the configs and the device split, never written back."""

    num_actor_threads: int  # in this process
    members_per_thread: int
    member_envs: int  # per thread: members_per_thread * episodes_per_member
    eval_envs: int  # per thread: episodes of the mean parameters
    envs_per_thread: int
    env_batch: int  # environments per envpool recv: all of a thread's


def make_es_layout(config: ESConfig, sebulba: SebulbaConfig, split: DeviceSplit,
                   num_processes: int = 1) -> ESLayout:
    """Check the settings against the device split and derive every thread's environments.

    Every process has the same split (`split`, this process's) and threads; the
    population is divided over all of their threads. The evaluation episodes
    are spread over the threads, rounded up to a whole number per thread, and
    up again until a thread's environments split evenly over the learner
    devices (so a run may evaluate a few more than `--eval-episodes`).
    """
    members = share_per_thread(config.population, "--population", sebulba, split, num_processes,
                               multiple_of=2, why=" (the population is even)")
    local_threads = len(split.actor) * sebulba.actor_threads
    member_envs = members * config.episodes_per_member
    eval_envs = -(-config.eval_episodes // (local_threads * num_processes))
    eval_envs += -(member_envs + eval_envs) % len(split.learner)
    envs = member_envs + eval_envs
    return ESLayout(local_threads, members, member_envs, eval_envs, envs, envs)


def es_env_index(thread: int, layout: ESLayout, population_envs: int) -> np.ndarray:
    """Global indices of actor thread `thread`'s environments (numbered over every process): its members'
    episodes among the population's, then its evaluation episodes after all of those."""
    return np.concatenate([thread_env_index(thread, layout.member_envs),
                           population_envs + thread_env_index(thread, layout.eval_envs)])


class ESSetup(NamedTuple):
    """Everything built (and compiled) before a thread starts."""

    spec: Any
    split: DeviceSplit
    layout: ESLayout
    horizon: int  # a trajectory's rows: the environment's time limit
    mesh: Any  # the learner devices of every process
    agent: Any
    acting: Acting
    state: ESState  # replicated over the learner mesh
    step_fn: Any
    num_params: int
    compile_s: float


def build(configs: RunSpec, devices=None) -> ESSetup:
    """Check the configs against the devices, build the ES agent and compile it on its devices."""
    run, es_config, sebulba, net = configs.run, configs.agent, configs.sebulba, configs.network
    spec = env_spec(run.env)
    split = split_devices(sebulba, jax.local_devices() if devices is None else devices)
    layout = make_es_layout(es_config, sebulba, split, jax.process_count())
    horizon = episode_limit(run.env)
    check_trajectory_size(spec, horizon, layout.envs_per_thread)
    check_masked_inputs(spec, es_config.normalize_observations)
    policy = make_policy_network(spec.obs_shape, spec.action_dim, spec.discrete, net.hidden, net.activation,
                                 spec.action_mask)
    agent = make_agent(policy, None, es_config, spec, horizon, (parallel.DATA_AXIS,), eval_envs=layout.eval_envs)
    mesh = parallel.make_mesh(parallel.process_major(split.learner))
    # The seed's key itself, which `init` splits into the initial parameters' key and the generations'.
    state, acting, step_fn, compile_s = compile_agent(agent, jax.random.PRNGKey(run.seed), spec, split, mesh,
                                                      layout, horizon)
    return ESSetup(spec, split, layout, horizon, mesh, agent, acting, state, step_fn,
                   int(state.strategy.mean.shape[0]), compile_s)


def check_trajectory_size(spec: Any, horizon: int, num_envs: int) -> None:
    """Refuse, in one line, a generation whose recorded observations would not fit in memory.

    A generation's trajectory holds up to `horizon` observations of each
    environment, and as many final ones (Atari's 27,000-step time limit of
    84x84x4 frames: gigabytes per environment).
    """
    need = 2 * (horizon + 1) * num_envs * math.prod(spec.obs_shape) * np.dtype(spec.obs_dtype).itemsize
    if need > TRAJECTORY_BYTES:
        raise PodracerError(f"--algo=es on --arch=sebulba records each generation's episodes of up to {horizon:,} "
                            f"steps: {need / 2**30:,.1f} GiB of observations per actor thread; use --arch=anakin, "
                            f"or an environment with shorter episodes or smaller observations")


class Progress(NamedTuple):
    """Counters of a run so far: what a checkpoint keeps besides the state."""

    generations: int = 0
    env_steps: int = 0  # agent steps of the members' episodes
    eval_steps: int = 0  # of the mean parameters' evaluation episodes
    ignored_steps: int = 0  # of environments whose episode was over, waiting for the others


class GenerationLog:
    """Called after every generation; writes a metrics.jsonl row every `log_every` and after the last.

    Rows carry the keys of Anakin ES (`es_row`): `episode_return_mean` is the
    population's mean fitness over the interval's generations,
    `mean_params_return` the mean return of the last generation's evaluation
    episodes of the mean parameters that generation was sampled around. A
    resumed run counts on from `start`; its rates count only the work since.
    """

    def __init__(self, logger: RunLogger, timings: Timings, log_every: int, total_steps: int,
                 start: Progress = Progress()):
        self.logger, self.timings, self.log_every, self.total_steps = logger, timings, log_every, total_steps
        self.start = time.perf_counter()
        self.first = start
        self.generations, self.env_steps, self.eval_steps, self.ignored_steps = start
        self.mean_params_return: float | None = None
        self.last_row: dict = {}
        self._interval: list[dict] = []

    @property
    def progress(self) -> Progress:
        return Progress(self.generations, self.env_steps, self.eval_steps, self.ignored_steps)

    @property
    def finished(self) -> bool:
        return self.env_steps >= self.total_steps

    def __call__(self, generation: int, shipments: list, metrics: dict) -> None:
        with self.timings.measure("logging"):
            self._record(generation, shipments, dict(metrics))

    def _record(self, generation: int, shipments: list, metrics: dict) -> None:
        self.generations = generation + 1
        self.env_steps += int(metrics.pop("member_steps"))
        self.eval_steps += int(metrics.pop("eval_steps"))
        self.ignored_steps += sum(s.dropped_steps + s.reset_steps for s in shipments)
        self.mean_params_return = metrics.pop("mean_params_return")
        self._interval.append(metrics)
        if self.generations % self.log_every and not self.finished:
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


def train_es(configs: RunSpec, devices=None):
    """Train a policy with evolution strategies on Sebulba; returns (summary, (strategy state, obs_stats)).

    `configs` is the run's `RunSpec` (`podracer.orchestrate.cli.parse_configs`). The run
    ends after the generation in which the members' episodes reach `total_steps` agent
    steps (`env_steps`; the mean parameters' evaluation episodes and the ignored steps of
    environments waiting for the others are counted apart). SIGINT/SIGTERM make the
    learner save and stop every thread; a failure in any thread stops every thread and is
    re-raised. The learner saves every `--checkpoint-every` env steps, at the end and on
    a signal; a run directory with a checkpoint resumes from it.
    """
    session = RunSession(configs)
    run, es_config, sebulba = configs.run, configs.agent, configs.sebulba
    setup = build(configs, devices)
    layout, split, agent = setup.layout, setup.split, setup.agent
    restored, meta = session.open({"strategy": setup.state.strategy, "obs_stats": setup.state.obs_stats})
    state = setup.state._replace(**restored)
    start = Progress(*(int(meta[name]) for name in Progress._fields)) if meta else Progress()
    control, timings = Control(), session.timings
    store = ParamsStore(split.actor)
    # A strategy state's version is its generation: the number of updates applied to the mean.
    store.publish(agent.acting_state(state), start.generations)
    queues = [queue.Queue(maxsize=1) for _ in range(layout.num_actor_threads)]
    # Lock step: each generation is played with the mean its predecessor's update made.
    settings = ActorSettings(setup.horizon, synchronous=True, time_transfers=session.profiler is not None)
    population_envs = es_config.population * es_config.episodes_per_member
    actors = []
    for actor_id in range(layout.num_actor_threads):
        # Numbered over every process: which members and evaluation episodes, and the env seed.
        numbered = jax.process_index() * layout.num_actor_threads + actor_id
        # Made here rather than in the thread: a bad environment fails before anything starts.
        envs = EnvPoolEnvs(run.env, layout.envs_per_thread, layout.env_batch, sebulba.env_threads,
                           seed=env_seed(run.seed, numbered, start.generations))
        record = Actor(actor_id, envs, settings, split.actor[actor_id // sebulba.actor_threads], setup.acting,
                       store, queues[actor_id], setup.mesh, jax.random.PRNGKey(numbered), control, timings,
                       es_env_index(numbered, layout, population_envs))
        actors.append(actor_thread(control, run_actor, record, actor_id, "sebulba-es-actor"))

    logger = session.start(run.total_steps, setup.compile_s)
    log = GenerationLog(logger, timings, sebulba.log_every, run.total_steps, start)
    every = session.checkpoint.checkpoint_every
    saved_steps = [start.env_steps]

    def save(_generations: int, state: ESState) -> None:
        progress = log.progress
        session.save(progress.env_steps, {"strategy": state.strategy, "obs_stats": state.obs_stats},
                     progress._asdict())
        saved_steps[0] = progress.env_steps

    learning = Learning(
        setup.step_fn, queues, store, start.generations if log.finished else sys.maxsize,
        parallel.from_host(np.asarray(jax.random.PRNGKey(0)), parallel.replicated(setup.mesh)),  # ES draws none
        control, timings, log, acting_state=agent.acting_state, first_update=start.generations, save=save,
        interrupted=lambda: bool(session.stop),
        guard=lambda finite, generation: session.check_finite(finite, f"generation {generation}", log.env_steps,
                                                              ES_FIX),
        # After the generation that passes each multiple of `every` env steps.
        save_due=lambda _generations: bool(every) and log.env_steps // every > saved_steps[0] // every,
        finished=lambda: log.finished)
    log.start = time.perf_counter()
    final = run_threads(session, control, actors, lambda: run_learner(learning, state), "sebulba-es-learner")
    state = final or state
    processes = jax.process_count()
    summary = session.finish(
        env_steps=log.env_steps,
        new_steps=log.env_steps - start.env_steps,
        episode_return_mean=log.last_row.get("episode_return_mean"),
        fingerprint_of=state.strategy.mean,
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
        stopped=not log.finished,
        policy=lambda: es_policy(state.strategy.mean, state.obs_stats, es_config, configs.network, setup.spec),
        breakdown=True)
    return summary, (state.strategy, state.obs_stats)
