"""ES actor threads: play one generation on every slot of an envpool batch, ship the fitness.

Counting a slot's return over exactly one complete episode must survive
envpool's auto-reset: a slot whose episode ended keeps being stepped (envpool
steps the whole batch) and starts another episode, played by the same
parameters. Its results are ignored (`EpisodeTally`), and when every slot has
finished, the next generation resets all of them, cutting those leftovers.
"""

from __future__ import annotations

import queue
from typing import Callable, NamedTuple

import jax
import numpy as np

from podracer import es
from podracer.sebulba.actor import put_until_stopped
from podracer.sebulba.control import Control
from podracer.sebulba.envs import EnvPoolEnvs, EnvStep
from podracer.sebulba.es import SebulbaESLayout, generation_key, member_fitness, thread_members
from podracer.sebulba.params import ParamsStore
from podracer.session.timing import Timings


class SearchPolicy(NamedTuple):
    """What the learner publishes to the actors (`ParamsStore` copies it whole)."""

    params: object  # the strategy state: its `mean` and what `ask` needs
    obs_stats: es.RunningStats  # ARS V2's statistics from before the generation


class Evaluation(NamedTuple):
    """One actor thread's results for one generation."""

    generation: int
    actor_id: int
    fitness: np.ndarray  # [members_per_thread] float32, in member order
    mean_returns: np.ndarray  # [eval_slots] returns of the mean parameters
    seen: es.RunningStats  # numpy statistics of the members' observations (ARS V2; else empty)
    member_steps: int  # agent steps of the members' episodes
    eval_steps: int  # agent steps of the mean parameters' episodes
    ignored_steps: int  # steps of slots whose episode was over, waiting for the others


class EpisodeTally:
    """The return and length of each slot's first complete episode since `EnvPoolEnvs.start`.

    Uses `EnvStep.episode_done`/`episode_return`, the true episodic return
    (on Atari, the game score of a whole game, not of one life).
    """

    def __init__(self, num_slots: int):
        self.returns = np.zeros(num_slots, np.float32)
        self.lengths = np.zeros(num_slots, np.int64)
        self.finished = np.zeros(num_slots, bool)
        self.ignored_steps = 0

    @property
    def done(self) -> bool:
        return bool(self.finished.all())

    def record(self, step: EnvStep) -> np.ndarray:
        """Take one `recv`'s results; returns, per result, whether acting on `step.obs` counts.

        An action counts while its slot's episode goes on and `obs` is not an
        episode's final observation (whose action envpool ignores).
        """
        ids = step.env_ids
        was_finished = self.finished[ids]
        ends = step.episode_done & ~was_finished
        self.returns[ids[ends]] = step.episode_return[ends]
        self.lengths[ids[ends]] = step.episode_length[ends]
        self.ignored_steps += int(np.count_nonzero(was_finished))
        self.finished[ids] = was_finished | step.episode_done
        return ~self.finished[ids] & ~(step.terminated | step.truncated)


def in_slot_order(step: EnvStep) -> EnvStep:
    """`step` with its rows sorted by environment id (envpool returns a full batch in order already)."""
    if np.array_equal(step.env_ids, np.arange(step.env_ids.shape[0])):
        return step
    order = np.argsort(step.env_ids)
    return EnvStep(*(field[order] for field in step))


def play_generation(envs: EnvPoolEnvs, act: Callable, params, obs_stats, seen, member_slot: np.ndarray,
                    control: Control, timings: Timings):
    """Reset every slot and step them all until each has finished one episode.

    Returns `(tally, seen)`, with `seen` the statistics of the counted member
    observations merged into the given `seen`; None if `control` stops first.
    """
    tally = EpisodeTally(envs.num_envs)
    slots = np.arange(envs.num_envs, dtype=np.int32)
    with timings.measure("env_step"):
        envs.start()
    while True:
        with timings.measure("env_step"):
            step = in_slot_order(envs.recv())
        counted = tally.record(step) & member_slot
        if tally.done:
            return tally, seen
        if control.stop.is_set():
            return None
        with timings.measure("inference"):
            action, seen = act(params, obs_stats, step.obs, counted, seen)
            action = np.asarray(action)
        with timings.measure("env_step"):
            envs.send(action, slots)


class ESActor(NamedTuple):
    """One ES actor thread's world: one record rather than a dozen arguments."""

    actor_id: int  # numbered over every process: it says which members the thread plays
    envs: EnvPoolEnvs  # one slot per member episode and evaluation episode; closed at the end
    layout: SebulbaESLayout
    episodes_per_member: int
    device: jax.Device
    slot_params: Callable  # `make_slot_params`
    act: Callable  # `make_slot_act`
    store: ParamsStore
    out: queue.Queue  # holds one `Evaluation`
    key: jax.Array  # the ES key: generation g uses generation_key(key, g)
    control: Control
    timings: Timings


def run_es_actor(actor: ESActor) -> None:
    """The body of one ES actor thread: evaluates generations (and closes its envs) until stopped.

    Generation `g` waits for the learner's policy version `g` (the mean after
    `g` updates), builds its slots' parameters on its device from
    `generation_key(key, g)`, plays it and queues an `Evaluation`.
    """
    (actor_id, envs, layout, episodes_per_member, device, slot_params, act, store, out, key, control,
     timings) = actor
    try:
        members = jax.device_put(thread_members(actor_id, layout), device)
        member_slot = np.arange(layout.slots_per_thread) < layout.member_slots
        no_observations = jax.device_put(es.init_running_stats(int(np.prod(envs.spec.obs_shape))), device)
        generation = 0
        while not control.stop.is_set():
            with timings.measure("actor_params_wait"):
                policy = store.wait_for(generation, device, control.stop)
            if policy is None:
                break
            generation = policy.version
            with timings.measure("member_params"):
                params = slot_params(policy.state.params, generation_key(key, generation), members)
            played = play_generation(envs, act, params, policy.state.obs_stats, no_observations, member_slot,
                                     control, timings)
            if played is None:
                break
            tally, seen = played
            evaluation = Evaluation(
                generation, actor_id,
                member_fitness(tally.returns, layout, episodes_per_member),
                tally.returns[layout.member_slots:],
                jax.tree.map(np.asarray, seen),
                int(tally.lengths[: layout.member_slots].sum()),
                int(tally.lengths[layout.member_slots:].sum()),
                tally.ignored_steps)
            with timings.measure("actor_queue_wait"):
                if not put_until_stopped(out, evaluation, control.stop):
                    break
            generation += 1
    finally:
        envs.close()
