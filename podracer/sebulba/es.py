"""Sebulba ES, the pure pieces: which slots play which member, their parameters, acting, the update.

An actor thread owns one envpool batch whose environments are *slots*: for
each of its `m` population members, `episodes_per_member` slots (slot
`j * episodes_per_member + c` plays copy `c` of the thread's member `j`), then
its share of the evaluation episodes of the mean parameters (a member with
zero noise). Every slot plays exactly one episode per generation, all of them
side by side, so a generation lasts as long as its longest episode.

Members are numbered globally, over the actor threads of every process
(process `p`'s thread `i` is thread `p * threads_per_process + i`): thread
`t` holds members `[t * m, (t + 1) * m)`, and draws their noise itself from the generation key and the member index
(`podracer.es.noise`); the learner regenerates the same noise in `tell`. Only
the strategy state goes to the actors and only fitness scalars (and, for ARS
V2, observation statistics) come back.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from podracer import es
from podracer.protocol import parallel
from podracer.errors import PodracerError
from podracer.es.config import ESConfig
from podracer.sebulba.config import DeviceSplit, SebulbaConfig, share_per_thread


class SebulbaESLayout(NamedTuple):
    """Sizes derived from the configs and the device split, never written back."""

    num_actor_threads: int  # in this process
    num_processes: int
    members_per_thread: int
    member_slots: int  # members_per_thread * episodes_per_member
    eval_slots: int  # per thread: episodes of the mean parameters
    slots_per_thread: int  # envpool environments per actor thread


def make_es_layout(config: ESConfig, sebulba: SebulbaConfig, split: DeviceSplit,
                   num_processes: int = 1) -> SebulbaESLayout:
    """Check the settings against the device split and derive every thread's slots.

    Every process has the same split (`split`, this process's) and threads; the
    population is divided over all of their threads.

    The evaluation episodes are spread over the threads, rounded up to a whole
    number per thread (so a run may evaluate a few more than `--eval-episodes`).
    """
    if config.horizon:
        raise PodracerError("--horizon applies to --arch=anakin; envpool environments end their "
                            "episodes at their own time limit, so drop --horizon")
    members = share_per_thread(config.population, "--population", sebulba, split, num_processes,
                               multiple_of=2, why=" (the population is even)")
    local_threads = len(split.actor) * sebulba.actor_threads
    threads = local_threads * num_processes
    member_slots = members * config.episodes_per_member
    eval_slots = -(-config.eval_episodes // threads)
    return SebulbaESLayout(local_threads, num_processes, members, member_slots, eval_slots,
                    member_slots + eval_slots)


def generation_key(key: jax.Array, generation: int) -> jax.Array:
    """The key of generation `generation`: actors `ask` with it and the learner `tell`s with it."""
    return jax.random.fold_in(key, generation)


def global_thread(actor_id: int, layout: SebulbaESLayout, process_index: int) -> int:
    """The number, over every process, of this process's actor thread `actor_id`."""
    return process_index * layout.num_actor_threads + actor_id


def thread_members(actor_id: int, layout: SebulbaESLayout) -> np.ndarray:
    """Global indices of the members that actor thread `actor_id` (numbered over every process) evaluates."""
    return actor_id * layout.members_per_thread + np.arange(layout.members_per_thread, dtype=np.int32)


def make_slot_params(strategy: es.Strategy, unravel: Callable, layout: SebulbaESLayout,
                     episodes_per_member: int) -> Callable:
    """Jitted `slot_params(state, key, members) -> params` with a leading `[slots]` axis.

    Row `j * episodes_per_member + c` holds member `members[j]`'s parameters
    (`strategy.ask`), the last `eval_slots` rows the mean parameters
    (`state.mean`, as in Anakin ES). Built once per generation on the actor
    device, so acting indexes nothing per step.
    """

    def slot_params(state: Any, key: jax.Array, members: jax.Array):
        population = strategy.ask(state, key, members)
        mean = jnp.broadcast_to(state.mean, (layout.eval_slots, state.mean.shape[0]))
        flat = jnp.concatenate([jnp.repeat(population, episodes_per_member, axis=0), mean])
        return jax.vmap(unravel)(flat)

    return jax.jit(slot_params)


def make_slot_act(apply_fn: Callable, normalize: bool) -> Callable:
    """Jitted `act(params, obs_stats, obs, counted, seen) -> (actions, seen)`: one call per env step.

    Slot `i` acts with its own parameters `params[i]` on `obs[i]` (`jax.vmap`
    over the slots; `apply_fn(params, obs)` is the unbatched deterministic
    policy). With `normalize` (ARS V2) the policy reads `es.ars_normalize(obs_stats,
    obs)` and the raw observations where `counted` are merged into `seen`, the
    generation's statistics; otherwise `obs_stats`, `counted` and `seen` pass
    through unused.
    """

    def act(params, obs_stats: es.RunningStats, obs: jax.Array, counted: jax.Array,
            seen: es.RunningStats):
        if normalize:
            flat = obs.reshape(obs.shape[0], -1)
            seen = es.merge_stats(seen, es.observation_stats(flat, counted))
            obs = es.ars_normalize(obs_stats, flat).reshape(obs.shape)
        return jax.vmap(apply_fn)(params, obs), seen

    return jax.jit(act)


def member_fitness(slot_returns: np.ndarray, layout: SebulbaESLayout, episodes_per_member: int) -> np.ndarray:
    """`[members_per_thread]` fitness: the mean return of each member's episodes, in member order."""
    member_returns = slot_returns[: layout.member_slots]
    return member_returns.reshape(layout.members_per_thread, episodes_per_member).mean(axis=1)


def make_es_learner_step(strategy: es.Strategy, mesh: Mesh, normalize: bool) -> Callable:
    """Jitted `step(state, obs_stats, key, fitness, seen) -> (state, obs_stats, metrics)`.

    The generation's update from its whole `[population]` fitness vector
    (member order; maximised), exactly `strategy.tell(state, key, fitness)`:
    every learner device runs the same `tell`, as every Anakin device does
    after its all-gather, so the state stays replicated over `mesh` without a
    parameter-sized collective. With `normalize`, `seen` (per-thread
    statistics stacked along a leading axis) is merged into `obs_stats` after
    the generation that observed it, as in `es.make_sharded_step_normalized`.
    """

    def step(state, obs_stats: es.RunningStats, key: jax.Array, fitness: jax.Array,
             seen: es.RunningStats):
        state, metrics = strategy.tell(state, key, fitness)
        if normalize:
            obs_stats = es.merge_stats(obs_stats, es.reduce_stats(seen))
        # For the NaN guard: a non-finite mean is never published or saved.
        return state, obs_stats, {**metrics, "params_finite": jnp.all(jnp.isfinite(state.mean))}

    everywhere = parallel.replicated(mesh)
    return jax.jit(step, in_shardings=everywhere, out_shardings=everywhere)
