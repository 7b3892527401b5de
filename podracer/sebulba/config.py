"""Sebulba's settings, and the device split and sizes derived from them.

Sizes are global, as in Anakin: `num_envs` environments over every actor thread
and `num_envs * rollout_len` transitions per update, whatever the device split.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Sequence

import jax

from podracer.bounds import NON_NEGATIVE, POSITIVE, bounded, check_bounds
from podracer.errors import PodracerError


@dataclasses.dataclass(frozen=True)
class SebulbaConfig:
    """How Sebulba produces experience: actor threads on host environments, separate learners."""

    num_envs: int = bounded(24, POSITIVE)
    """Environments over all actor threads, split evenly between them."""
    rollout_len: int = bounded(128, POSITIVE)
    """Transitions per environment in each trajectory an actor ships to the learner."""
    actor_devices: tuple[int, ...] = ()
    """Indices into jax.local_devices() that run the actors' policy (default: the first quarter, at least device 0)."""
    learner_devices: tuple[int, ...] = ()
    """Indices into jax.local_devices() that run the update (default: the devices that do not act)."""
    actor_threads: int = bounded(1, POSITIVE)
    """Actor threads per actor device; each owns an envpool batch and a queue of one trajectory."""
    env_threads: int = bounded(1, NON_NEGATIVE)
    """envpool worker threads per actor thread (0: envpool's own default)."""
    async_envs: bool = False
    """Step half of a thread's environments while the policy acts on the other half."""
    synchronous: bool = False
    """Actors wait for every update before acting again: policy lag 0, deterministic for a seed."""
    log_every: int = bounded(1, POSITIVE)
    """Updates between two rows of metrics.jsonl."""

    def __post_init__(self):
        check_bounds(self)


class DeviceSplit(NamedTuple):
    actor: tuple[jax.Device, ...]
    learner: tuple[jax.Device, ...]  # the same single device as `actor` when there is only one


def _check_indices(indices: Sequence[int], flag: str, num_devices: int) -> None:
    bad = [i for i in indices if not 0 <= i < num_devices]
    if bad:
        raise PodracerError(f"{flag}={','.join(map(str, indices))}: index {bad[0]} is out of range; "
                            f"this host has {num_devices} devices (0..{num_devices - 1})")
    if len(set(indices)) != len(indices):
        raise PodracerError(f"{flag}={','.join(map(str, indices))} lists a device twice; list each once")


def split_devices(config: SebulbaConfig, devices: Sequence[jax.Device]) -> DeviceSplit:
    """Actor and learner devices from `config`'s indices into `devices`.

    Defaults: the first quarter of the devices act (at least one) and the
    others learn: 1 and 3 of a 4-chip TPU host (v4, v5p, v5e and v6e hosts of
    several), 2 and 6 of an 8-chip one (v5litepod-8, v6e-8), 1 and 1 of two
    devices. One actor to three learners is Cleanba's split on a 4-device TPU
    VM; it keeps the learner counts at 1, 2, 3 or 6 (never 7), which the
    presets' environment counts split over. With a single device, actors and
    learner share it, the one case where they overlap: lists given explicitly
    must not overlap. Giving only one list makes the other default to the
    remaining devices (to the same device when none remain).
    """
    devices = list(devices)
    n = len(devices)
    actor, learner = list(config.actor_devices), list(config.learner_devices)
    _check_indices(actor, "--actor-devices", n)
    _check_indices(learner, "--learner-devices", n)
    if actor and learner:
        overlap = sorted(set(actor) & set(learner))
        if overlap:
            raise PodracerError(f"device {overlap[0]} is in both --actor-devices and --learner-devices; "
                                f"give each device one role")
    if not actor:
        rest = [i for i in range(n) if i not in learner]
        actor = rest[:max(1, n // 4) if not learner else 1] or learner[:1]
    if not learner:
        learner = [i for i in range(n) if i not in actor] or list(actor)
    return DeviceSplit(tuple(devices[i] for i in actor), tuple(devices[i] for i in learner))


def share_per_thread(total: int, flag: str, config: SebulbaConfig, split: DeviceSplit,
                     num_processes: int, multiple_of: int = 1, why: str = "") -> int:
    """`total` (a global count) per actor thread, over the threads of every process.

    A refusal is one line naming the flag.
    """
    threads = len(split.actor) * config.actor_threads * num_processes
    if total % threads:
        processes = f" x {num_processes} processes" if num_processes > 1 else ""
        raise PodracerError(
            f"{flag}={total} does not split over {threads} actor threads "
            f"({len(split.actor)} actor devices x --actor-threads={config.actor_threads}{processes}); "
            f"use a multiple of {math.lcm(threads, multiple_of)}{why}")
    return total // threads


class SebulbaLayout(NamedTuple):
    """Sizes derived from the config and the device split, never written back."""

    num_actor_threads: int  # on this process
    envs_per_thread: int
    env_batch: int  # environments per envpool recv (half of them with async_envs)
    steps_per_update: int  # transitions per update, over every actor thread


def make_layout(config: SebulbaConfig, algo_config: Any, split: DeviceSplit,
                num_processes: int = 1, recurrent: bool = False) -> SebulbaLayout:
    """Sizes for `split` on each of `num_processes` processes (the same split on every one).

    `num_envs` is global: the actor threads of every process share it evenly.
    `algo_config` is the agent's section (its `batch_problem`, and a recurrent
    agent's `sequence_problem`), as for Anakin's `make_layout`.
    """
    per_thread = share_per_thread(config.num_envs, "--num-envs", config, split, num_processes)
    threads = len(split.actor) * config.actor_threads
    everywhere = threads * num_processes
    learners = len(split.learner)
    if per_thread % learners:
        raise PodracerError(
            f"each actor thread's {per_thread} environments do not split over {learners} learner "
            f"devices; make --num-envs a multiple of {everywhere * learners}")
    if config.async_envs and per_thread % 2:
        raise PodracerError(f"--async-envs steps half of each thread's {per_thread} environments "
                            f"at a time; use an even number per thread")
    # Each learner device joins its share of every actor thread's trajectory.
    per_learner = threads * per_thread // learners
    problem = (algo_config.sequence_problem(per_learner, "make --num-envs a multiple of "
                                            f"{everywhere * learners * algo_config.minibatches} or lower --minibatches")
               if recurrent else algo_config.batch_problem(config.rollout_len, per_learner))
    if problem:
        raise PodracerError(problem)
    env_batch = per_thread // 2 if config.async_envs else per_thread
    return SebulbaLayout(threads, per_thread, env_batch, config.num_envs * config.rollout_len)
