"""Evolution strategies as an agent on the contract (`podracer.agent`): a generation is one rollout.

Anakin's one program builder (`podracer.anakin.loop.make_programs`) runs ES as
it runs PPO. The environments are the generation's episodes: `population *
episodes_per_member` of them over every device, environment `i` an episode of
member `i // episodes_per_member`, so each device holds whole members (the
population split evenly over the devices). Every rollout is `horizon` steps of
new episodes (`Agent.fresh_episodes`), both members of an antithetic pair
living the same ones (common random numbers, as the strategies' noise pairs
them).

- `init`: the strategy's state around the policy's initial parameters (flat),
  ARS V2's observation statistics and the key of the generations.
- `for_rollout`: this device's members' perturbed parameters, drawn once per
  generation from the generation's key (`fold_in(key, generation)`, which
  `learn` uses again for `tell`): each member's own, or with low-rank noise a
  pair's mean and factors, both members of a pair acting together
  (`networks.apply_antithetic`).
- `act`: each environment acts with its member's deterministic policy (ARS V2:
  on normalised observations).
- `prepare`: each episode's return, rewards counted up to its first end
  (terminated or truncated), and ARS V2's statistics of the observations acted
  on until then.
- `learn`: all-gather the returns (a scalar per episode: the only traffic), a
  member's fitness the mean of its episodes', then the strategy's `tell`; ARS
  V2 merges the observations seen over every device.

With `eval_envs`, the last `eval_envs` environments of every batch evaluate
the mean parameters beside the members (Sebulba's actor threads, whose
environments live on the host): their global indices come after the
population's, and `learn` reports their mean return as `mean_params_return`
with the agent steps of both kinds of episode (`member_steps`, `eval_steps`).

Fitness is MAXIMISED.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from podracer.agent import Agent, Rollout, Trajectory, first_episode
from podracer.errors import PodracerError
from podracer.es.config import ESConfig, make_strategy
from podracer.es.strategy import Perturbation, Strategy
from podracer.networks import apply_antithetic
from podracer.normalize import (RunningStats, ars_normalize, init_running_stats, merge_stats, observation_stats,
                                psum_stats, reduce_stats)
from podracer.protocol import parallel


class ESState(NamedTuple):
    """An ES agent's state: replicated, a few arrays and the flat parameters' mean."""

    strategy: Any  # the strategy's state; its `mean` is the flat policy parameters, `generation` a counter
    obs_stats: RunningStats  # read and updated by ARS V2 only
    key: jax.Array  # generation g draws its members from `fold_in(key, g)`


class Members(NamedTuple):
    """What acting reads during one generation's rollout (`Agent.for_rollout`)."""

    # This device's members' parameter trees [M, ...], or a `Perturbation` of its pairs [P, ...]; with
    # `eval_envs`, one tree per environment [B, ...]: each member's for its episodes, then the mean's.
    params: Any
    obs_stats: RunningStats
    env_index: jax.Array  # [B] the environments' global indices: where each return goes in `learn`


def episode_horizon(env, config: ESConfig) -> int:
    """`config.horizon`, or the environment's own time limit when it is 0 (a generation's rollout length)."""
    if config.horizon:
        return config.horizon
    limit = getattr(env, "horizon", None)  # gymnax's max_steps_in_episode, a suite's time limit
    if not limit:
        raise PodracerError(f"{env.env_id} has no episode time limit to default to; pass --horizon")
    return int(limit)


def members_per_device(config: ESConfig, num_devices: int) -> int:
    """The generation's members on each of `num_devices` devices; a split that cannot work is refused."""
    return parallel.split_evenly(config.population, num_devices, "population members", "--population")


def generation_key(state: ESState) -> jax.Array:
    """The key of the generation `state` is at: the same for `ask` before the rollout and `tell` after it."""
    return jax.random.fold_in(state.key, state.strategy.generation)


def pair_episodes(episodes_per_member: int):
    """`Agent.fresh_episodes` of an ES population: both members of a pair get the pair's episodes."""
    return lambda env_index: (env_index // (2 * episodes_per_member)) * episodes_per_member + (
        env_index % episodes_per_member)


def _all_dense(policy: nn.Module, variables, dummy_obs) -> bool:
    """Whether `networks.apply_antithetic` can evaluate `policy` (its parameters all `nn.Dense`'s)."""
    try:
        jax.eval_shape(lambda v, o: apply_antithetic(policy, v, v, 1.0, o), variables,
                       jnp.stack([dummy_obs, dummy_obs]))
    except Exception:  # noqa: BLE001  (other layers: member by member)
        return False
    return True


def make_agent(policy: nn.Module, optimizer: Any, config: ESConfig, spec: Any, horizon: int,
               axis_names=(), *, num_envs: int | None = None, strategy: Strategy | None = None,
               eval_envs: int = 0) -> Agent:
    """ES on the policy `policy` (`networks.make_policy_network`) as an `Agent`.

    `horizon` is the rollout's length (a generation's episodes are cut there),
    `axis_names` the mesh axes the environments are split over. `optimizer` is
    not used: the strategy steps its own mean (`ESConfig.es_lr`). `strategy`
    replaces the one `config` describes (`make_strategy`): an `init / ask /
    tell` whose state has the flat parameters in `mean` and a `generation`
    counter, and whose population is `config.population`. `eval_envs`: environments
    at the end of every batch that evaluate the mean parameters (module docstring);
    their global indices are `population * episodes_per_member` and up.
    """
    del optimizer, num_envs
    episodes = config.episodes_per_member
    member_envs = config.population * episodes  # global indices from here on evaluate the mean
    dummy_obs = jnp.zeros(spec.obs_shape, spec.obs_dtype)
    shapes = jax.eval_shape(policy.init, jax.random.key(0), dummy_obs)
    variables = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    strategy = make_strategy(config, [s.shape for s in jax.tree.leaves(shapes)]) if strategy is None else strategy
    if strategy.population_size != config.population:
        raise PodracerError(f"the strategy's population ({strategy.population_size}) differs "
                            f"from --population={config.population}")
    _, unravel = ravel_pytree(variables)
    normalize = config.normalize_observations
    # A pair's members share the mean's matrix products, each layer's rank-r noise applied
    # through its factors. (Full-rank pairs were measured too: no faster, the products with
    # each pair's noise as costly as each member's own kernel; members are evaluated one by one.)
    by_pairs = bool(config.low_rank) and strategy.perturb is not None and _all_dense(policy, variables, dummy_obs)

    def init(key):
        param_key, run_key = jax.random.split(key)
        flat, _ = ravel_pytree(policy.init(param_key, dummy_obs))
        return ESState(strategy.init(flat), init_running_stats(math.prod(spec.obs_shape)), run_key)

    def for_rollout(state: ESState, env_index):
        batch = env_index.shape[0] - eval_envs  # the members' environments
        if batch % episodes:
            raise PodracerError(f"{batch} environments per device do not hold whole members of "
                                f"{episodes} episodes each; make --population a multiple of the device count")
        num_members = batch // episodes
        first_member = env_index[0] // episodes
        key = generation_key(state)
        if eval_envs:  # every environment its own row, acted on in one vmap
            flat = strategy.ask(state.strategy, key, first_member + jnp.arange(num_members))
            mean = state.strategy.mean
            rows = jnp.concatenate([jnp.repeat(flat, episodes, axis=0),
                                    jnp.broadcast_to(mean, (eval_envs, mean.shape[0]))])
            return Members(jax.vmap(unravel)(rows), state.obs_stats, env_index)
        if by_pairs and num_members % 2 == 0:
            pairs = strategy.perturb(state.strategy, key, first_member // 2, num_members // 2)
            noise = pairs.noise
            if isinstance(noise, (list, tuple)):  # leaf by leaf, a leading pair axis on each
                noise = jax.tree.unflatten(jax.tree.structure(variables), list(noise))
            else:
                noise = jax.vmap(unravel)(noise)
            return Members(Perturbation(unravel(pairs.mean), pairs.scale, noise), state.obs_stats, env_index)
        flat = strategy.ask(state.strategy, key, first_member + jnp.arange(num_members))
        return Members(jax.vmap(unravel)(flat), state.obs_stats, env_index)

    def act(members: Members, obs, randomness, carry):
        if normalize:
            obs = ars_normalize(members.obs_stats, obs.reshape(obs.shape[0], -1)).reshape(obs.shape)
        if eval_envs:
            return jax.vmap(policy.apply)(members.params, obs), carry, ()
        return act_members(members, obs), carry, ()

    def act_members(members: Members, obs):
        num_envs = obs.shape[0]
        each = lambda params, obs: jax.vmap(policy.apply, in_axes=(None, 0))(params, obs)
        if isinstance(members.params, Perturbation):
            mean, scale, noise = members.params
            pair = lambda noise, obs: jax.vmap(lambda o: apply_antithetic(policy, mean, noise, scale, o),
                                               in_axes=1, out_axes=1)(obs)
            action = jax.vmap(pair)(noise, obs.reshape(-1, 2, episodes, *obs.shape[1:]))  # [P, 2, E, ...]
            return action.reshape(num_envs, *action.shape[3:])
        if episodes == 1:  # no batch axis of size 1 through every step
            return jax.vmap(policy.apply)(members.params, obs)
        action = jax.vmap(each)(members.params, obs.reshape(-1, episodes, *obs.shape[1:]))  # [M, E, ...]
        return action.reshape(num_envs, *action.shape[2:])

    def prepare(members: Members, trajectory: Trajectory):
        alive = first_episode(trajectory).astype(jnp.float32)
        returns = jnp.sum(alive * trajectory.reward, axis=0)
        seen = ()
        if normalize:  # the members' observations only
            counted = alive * (members.env_index < member_envs)
            obs = trajectory.obs.reshape(*trajectory.obs.shape[:2], -1)
            seen = jax.vmap(observation_stats, in_axes=(1, 1))(obs, counted)  # one per environment [B]
        # [1, B] time-major rows, sharded as any rollout; with the environments' indices, as an
        # architecture may gather its columns in another order (Sebulba: by learner device).
        rows = (returns, members.env_index) + ((jnp.sum(alive, axis=0),) if eval_envs else ())
        return tuple(row[None] for row in rows), seen

    def learn(state: ESState, batch, seen, key, carry):
        del key, carry
        returns, env_index, *steps = (parallel.all_gather(row[0], axis_names) for row in batch)
        episode_returns = jnp.zeros(member_envs, returns.dtype).at[env_index].set(
            returns, mode="drop", unique_indices=True)
        fitness = jnp.mean(episode_returns.reshape(config.population, episodes), axis=1)
        strategy_state, metrics = strategy.tell(state.strategy, generation_key(state), fitness)
        obs_stats = state.obs_stats
        if normalize:
            obs_stats = merge_stats(obs_stats, psum_stats(reduce_stats(seen), axis_names))
        if eval_envs:  # the mean parameters' episodes, played beside the members'
            at_mean = env_index >= member_envs
            metrics = {**metrics,
                       "mean_params_return": jnp.sum(jnp.where(at_mean, returns, 0.0)) / jnp.sum(at_mean),
                       "member_steps": jnp.sum(jnp.where(at_mean, 0.0, steps[0])),
                       "eval_steps": jnp.sum(jnp.where(at_mean, steps[0], 0.0))}
        return ESState(strategy_state, obs_stats, state.key), metrics

    return Agent(init, act, prepare, learn, Rollout(horizon), draw=lambda key: key,
                 initial_carry=lambda num_envs: (), for_rollout=for_rollout,
                 fresh_episodes=pair_episodes(episodes), quick_cpu_compile=False)
