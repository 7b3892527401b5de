"""Population-based training (Jaderberg et al. 2017) on a population's agent axis: exploit, then explore.

Pure functions of a population's states and settings, every leaf [A, ...],
traced inside Anakin's population program (`podracer.anakin.loop`) at the end
of each call in which an interval of `--pbt-interval` updates ends:

- rank: each agent's recent return is its mean episode return since the last
  ranking (the one before, if no episode of it ended since);
- exploit (`donors`, `exploit`): each of the worst `fraction` copies the whole
  agent state (parameters, optimizer state, observation statistics) and the
  settings of an agent drawn uniformly from the best `fraction`;
- explore (`explore`): each copied setting is multiplied by `perturb` or its
  inverse at even odds or, with probability `resample`, drawn anew from its
  `--sweep` space, then clipped to the setting's legal range.

Every draw comes from the population's PBT key, carried in the runner, and every
decision is made from the whole population's returns, so a population split
over devices decides exactly as one on one device and a resumed run as the
uninterrupted one. An agent keeps its own environments and random key.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from podracer import population
from podracer.bounds import bound_of
from podracer.protocol import parallel
from podracer.sampling import Space

if TYPE_CHECKING:  # the command line's run spec, built above this layer
    from podracer.orchestrate.spec import RunSpec


NO_DONOR = -1


class Setting(NamedTuple):
    """One swept setting as PBT moves it: its `--sweep` space and its legal range."""

    space: Space
    low: float  # -inf: unbounded
    high: float  # inf: unbounded


class PBTConfig(NamedTuple):
    """What the population section asks of PBT, with each swept setting's `Setting` by name."""

    interval: int  # updates
    fraction: float  # in (0, 0.5]
    perturb: float  # > 1
    resample: float  # in [0, 1]
    settings: dict[str, Setting]


class PBTState(NamedTuple):
    """PBT's part of a population's runner, a leading agent axis [A] on every leaf like the rest
    (so that it splits over devices with the agents); `key` and `updates` are the same in every row."""

    key: jax.Array  # [A, 2]: the population's PBT key
    updates: jax.Array  # [A] int32: updates trained so far
    return_sum: jax.Array  # [A] float32: returns of the episodes ended since the last ranking
    episodes: jax.Array  # [A] int32: how many
    recent_return: jax.Array  # [A] float32: the return the last ranking used (-inf before any)


def init_state(key: jax.Array, num_agents: int) -> PBTState:
    """The state before any update, from the run's key (`--seed`): folded apart from agent 0's own
    key, which the same seed makes."""
    key = jax.random.fold_in(key, 0x9B7)
    return PBTState(jnp.broadcast_to(key, (num_agents, *key.shape)), jnp.zeros(num_agents, jnp.int32),
                    jnp.zeros(num_agents, jnp.float32), jnp.zeros(num_agents, jnp.int32),
                    jnp.full(num_agents, -jnp.inf, jnp.float32))


def num_replaced(num_agents: int, fraction: float) -> int:
    """Agents replaced (and agents copied from) at each ranking: at least one."""
    return max(1, int(math.floor(fraction * num_agents)))


def donors(key: jax.Array, recent_return: jax.Array, fraction: float) -> jax.Array:
    """[A] int32: the agent each agent copies, `NO_DONOR` for those that keep their own.

    The worst `num_replaced` agents by `recent_return` (ties: the higher index
    is worse) each copy one of the best `num_replaced`, drawn uniformly.
    """
    num_agents = recent_return.shape[0]
    n = num_replaced(num_agents, fraction)
    order = jnp.argsort(-recent_return, stable=True)  # best first
    picks = order[:n][jax.random.randint(key, (n,), 0, n)]
    return jnp.full(num_agents, NO_DONOR, jnp.int32).at[order[num_agents - n:]].set(picks.astype(jnp.int32))


def exploit(donor: jax.Array, tree: Any) -> Any:
    """`tree` [A, ...] with each agent's row replaced by its donor's (exactly), where it has one."""
    take = jnp.where(donor == NO_DONOR, jnp.arange(donor.shape[0]), donor)
    return jax.tree.map(lambda x: x[take], tree)


def _draw(key: jax.Array, space: Space, shape: tuple[int, ...]) -> jax.Array:
    if space.kind in ("list", "choice"):
        return jnp.asarray(space.values, jnp.float32)[jax.random.randint(key, shape, 0, len(space.values))]
    low, high = space.values
    if space.kind == "uniform":
        return jax.random.uniform(key, shape, jnp.float32, low, high)
    return jnp.exp(jax.random.uniform(key, shape, jnp.float32, math.log(low), math.log(high)))


def explore(key: jax.Array, donor: jax.Array, hparams: dict[str, jax.Array], config: PBTConfig) -> dict:
    """Each agent with a donor perturbs or resamples each of its (copied) settings [A]; the others keep theirs."""
    out = {}
    for i, name in enumerate(sorted(hparams)):
        setting = config.settings[name]
        value = hparams[name]
        up_key, resample_key, draw_key = jax.random.split(jax.random.fold_in(key, i), 3)
        factor = jnp.where(jax.random.bernoulli(up_key, 0.5, value.shape), config.perturb, 1 / config.perturb)
        moved = jnp.where(jax.random.bernoulli(resample_key, config.resample, value.shape),
                          _draw(draw_key, setting.space, value.shape), value * factor)
        moved = jnp.clip(moved, setting.low, setting.high).astype(value.dtype)
        out[name] = jnp.where(donor == NO_DONOR, value, moved)
    return out


def rank_and_replace(state: PBTState, train: Any, hparams: dict, config: PBTConfig):
    """One ranking of the whole population [A]: (train, hparams, donor [A], the PBT state after).

    `state` has its episodes since the last ranking counted in; the accumulators
    start again from zero for every agent.
    """
    key, event_key = jax.random.split(state.key[0])
    exploit_key, explore_key = jax.random.split(event_key)
    have = state.episodes > 0
    recent = jnp.where(have, state.return_sum / jnp.maximum(state.episodes, 1), state.recent_return)
    donor = donors(exploit_key, recent, config.fraction)
    train, hparams = exploit(donor, (train, hparams))
    hparams = explore(explore_key, donor, hparams, config)
    after = PBTState(jnp.broadcast_to(key, state.key.shape), state.updates, jnp.zeros_like(state.return_sum),
                     jnp.zeros_like(state.episodes), exploit(donor, recent))
    return train, hparams, donor, after


def after_call(config: PBTConfig, state: PBTState, train: Any, hparams: dict, episodes: jax.Array,
               return_sum: jax.Array, axes: tuple[str, ...] = ()):
    """A population's PBT step after one call of U updates: (state, train, hparams, donor [a]).

    Every argument holds this device's `a` agents ([a, ...]; `episodes` and
    `return_sum` are the call's per-update counts [U, a]); with `axes`, the
    agents are split over those mesh axes and the ranking gathers the whole
    population first. Ranks (`rank_and_replace`) when an interval ends in the
    call; otherwise only counts the call's episodes in (donor: `NO_DONOR`).
    """
    num_updates, local = episodes.shape
    state = state._replace(updates=state.updates + num_updates,
                           return_sum=state.return_sum + return_sum.sum(0).astype(jnp.float32),
                           episodes=state.episodes + episodes.sum(0).astype(jnp.int32))
    due = state.updates[0] // config.interval > (state.updates[0] - num_updates) // config.interval

    def rank(operands):
        whole = jax.tree.map(lambda x: parallel.all_gather(x, axes), operands)
        train, hparams, donor, after = rank_and_replace(*whole, config)
        offset = parallel.axis_offset(local, axes)
        mine = lambda x: jax.lax.dynamic_slice_in_dim(x, offset, local)
        return jax.tree.map(mine, (after, train, hparams, donor))

    def keep(operands):
        return (*operands, jnp.full(local, NO_DONOR, jnp.int32))

    return jax.lax.cond(due, rank, keep, (state, train, hparams))


def config_of(configs: RunSpec) -> PBTConfig | None:
    """The run's `PBTConfig` (None without `--pbt`): each swept setting's space and legal range."""
    section = configs.population
    if not section.pbt:
        return None
    settings = {}
    for name, space in population.parse_sweeps(section.sweep, configs).items():
        config_section, attr = population.SWEEPABLE[configs.run.algo][name]
        field = next(f for f in dataclasses.fields(configs.section(config_section)) if f.name == attr)
        settings[name] = Setting(space, *legal_range(bound_of(field)))
    return PBTConfig(section.pbt_interval, section.pbt_fraction, section.pbt_perturb, section.pbt_resample,
                     settings)


def legal_range(bound) -> tuple[float, float]:
    """(low, high) to clip a setting with `podracer.bounds.Bound` `bound` into, float32-exact."""
    if bound is None:
        return -math.inf, math.inf
    low = -math.inf if bound.low is None else float(bound.low)
    if bound.low is not None and bound.low_open:
        low = float(np.nextafter(np.float32(low), np.float32(np.inf)))
    return low, math.inf if bound.high is None else float(bound.high)
