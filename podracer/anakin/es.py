"""Anakin ES: every device rolls out its slice of the population, in one jitted call.

A member's fitness is the mean return of `episodes_per_member` episodes of its
deterministic policy, each a `lax.scan` of `horizon` steps on a gymnax env. The
scan keeps stepping after an episode ends (the env restarts it from its first
state), but rewards stop counting at the first step that ends it (terminated or
truncated), so the return is that of exactly one complete, or horizon-cut,
episode. All of a device's members and episodes are vmapped. With low-rank
noise (`ESConfig.low_rank`) a policy made of `nn.Dense` layers (the default
`MLPPolicy`) is evaluated pair by pair, both members of an antithetic pair
acting together, every member sharing the mean's matrix products and each
layer's noise applied through its factors (`networks.apply_antithetic`). The ES
protocol (`podracer.es.make_sharded_step`) does ask -> evaluate -> all-gather
of the fitness scalars -> tell, `generations_per_call` times per host call. The
same call then evaluates the new mean parameters (`mean_params_return`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import flax.linen as nn
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, PartitionSpec as P

from podracer import es
from podracer.protocol import parallel
from podracer.envs.jax_envs import GymnaxEnv
from podracer.errors import PodracerError
from podracer.es.config import ESConfig, make_strategy
from podracer.networks import apply_antithetic
from podracer.normalize import RunningStats

ActFn = Callable[[Any, jax.Array], jax.Array]


class ESRunner(NamedTuple):
    """Everything an Anakin ES run carries between calls; replicated on every device."""

    strategy: Any  # the strategy's state (its `mean` is the flat policy parameters)
    obs_stats: RunningStats  # read and updated by ARS V2 only
    key: jax.Array


class AnakinESLayout(NamedTuple):
    """Sizes derived from the config, the environment and the mesh."""

    num_devices: int
    members_per_device: int
    horizon: int
    steps_per_generation: int  # global env steps simulated by the population


def episode_horizon(env: GymnaxEnv, config: ESConfig) -> int:
    """`config.horizon`, or the environment's own time limit when it is 0."""
    if config.horizon:
        return config.horizon
    limit = getattr(env, "horizon", None)  # gymnax's max_steps_in_episode, a suite's time limit
    if not limit:
        raise PodracerError(f"{env.env_id} has no episode time limit to default to; pass --horizon")
    return int(limit)


def members_per_device(config: ESConfig, num_devices: int) -> int:
    """The generation's members on each of `num_devices` devices; a split that cannot work is refused."""
    return parallel.split_evenly(config.population, num_devices, "population members", "--population")


def make_es_layout(config: ESConfig, env: GymnaxEnv, mesh: Mesh) -> AnakinESLayout:
    num_devices = mesh.devices.size
    members = members_per_device(config, num_devices)
    horizon = episode_horizon(env, config)
    steps = config.population * config.episodes_per_member * horizon
    return AnakinESLayout(num_devices, members, horizon, steps)


def make_episode_fn(env: GymnaxEnv, act_fn: ActFn, horizon: int, normalize: bool,
                    axis_names=()):
    """`episode(params, key, obs_stats) -> (return, seen)`: one episode of a policy.

    After the episode ends the environment starts it again from its first state
    (`GymnaxEnv.draw_restarting`): those steps only fill the fixed-length scan,
    and drawing a random reset at every step cost as much as the policy.

    Args:
      env: the Anakin environment (auto-resetting `step`).
      act_fn: `act_fn(params, obs) -> action`, deterministic, unbatched.
      horizon: scan length; an episode still running then is cut there.
      normalize: feed the policy `es.ars_normalize(obs_stats, obs)` and report `seen`,
        the `es.observation_stats` of the raw observations acted on before the
        episode ended (ARS V2). Otherwise `obs_stats` is ignored and `seen` is `()`.
      axis_names: the mesh axes the caller runs under, if any: the scan's initial
        carry is marked per-device so it types like the per-device values it
        becomes (`parallel.vary`).
    """

    def episode(params, key: jax.Array, obs_stats: RunningStats):
        reset_key, steps_key = jax.random.split(key)
        env_state, timestep = env.reset(reset_key)
        first_obs, first_state = timestep.obs, env_state

        def step(carry, step_key):
            env_state, obs, episode_return, alive = carry
            policy_obs = obs
            if normalize:
                policy_obs = es.ars_normalize(obs_stats, obs.reshape(-1)).reshape(obs.shape)
            draws = env.draw_restarting(step_key, first_obs, first_state)
            env_state, timestep = env.step_with(draws, env_state, act_fn(params, policy_obs))
            episode_return = episode_return + alive * timestep.reward
            ended = jnp.logical_or(timestep.terminated, timestep.truncated)
            next_alive = alive * (1.0 - ended.astype(jnp.float32))
            return (env_state, timestep.obs, episode_return, next_alive), (obs, alive)

        zero, one = jnp.zeros((), jnp.float32), jnp.ones((), jnp.float32)
        carry = parallel.vary((env_state, timestep.obs, zero, one), axis_names)
        (_, _, episode_return, _), (obs_t, alive_t) = jax.lax.scan(
            step, carry, jax.random.split(steps_key, horizon))
        seen = es.observation_stats(obs_t.reshape(horizon, -1), alive_t) if normalize else ()
        return episode_return, seen

    return episode


def make_pair_episode_fn(env: GymnaxEnv, pair_act_fn: Callable, horizon: int, normalize: bool,
                         axis_names=()):
    """`pair_episode(mean, scale, noise, key, obs_stats) -> (returns [2], seen)`.

    One episode of each member of an antithetic pair, the two acting together:
    `pair_act_fn(mean, noise, scale, obs [2, ...]) -> actions [2]` acts with
    `mean + scale * noise` on row 0 and `mean - scale * noise` on row 1 (e.g.
    `networks.apply_antithetic`). Both members' environments see the randomness
    `make_episode_fn`'s episode sees on `key`, which both members of a pair are
    given, so each row is that episode of its member. `seen` merges both
    members' observation statistics (`()` unless `normalize`).
    """

    def pair_episode(mean, scale, noise, key: jax.Array, obs_stats: RunningStats):
        reset_key, steps_key = jax.random.split(key)
        env_state, timestep = env.reset(reset_key)
        first_obs, first_state = timestep.obs, env_state
        both = lambda x: jnp.stack([x, x])

        def step(carry, step_key):
            env_state, obs, episode_return, alive = carry
            policy_obs = obs
            if normalize:
                policy_obs = es.ars_normalize(obs_stats, obs.reshape(2, -1)).reshape(obs.shape)
            action = pair_act_fn(mean, noise, scale, policy_obs)
            draws = env.draw_restarting(step_key, first_obs, first_state)
            env_state, timestep = jax.vmap(env.step_with, in_axes=(None, 0, 0))(draws, env_state, action)
            episode_return = episode_return + alive * timestep.reward
            ended = jnp.logical_or(timestep.terminated, timestep.truncated)
            next_alive = alive * (1.0 - ended.astype(jnp.float32))
            return (env_state, timestep.obs, episode_return, next_alive), (obs, alive)

        zero, one = jnp.zeros((2,), jnp.float32), jnp.ones((2,), jnp.float32)
        carry = parallel.vary((jax.tree.map(both, env_state), both(timestep.obs), zero, one), axis_names)
        (_, _, episode_return, _), (obs_t, alive_t) = jax.lax.scan(
            step, carry, jax.random.split(steps_key, horizon))
        seen = ()
        if normalize:
            per_member = jax.vmap(es.observation_stats, in_axes=(1, 1))(
                obs_t.reshape(horizon, 2, -1), alive_t)
            seen = es.reduce_stats(per_member)
        return episode_return, seen

    return pair_episode


def make_pair_fitness_fn(pair_episode, unravel: Callable, episodes_per_member: int, normalize: bool):
    """`pair_fitness(mean, scale, noise, key, obs_stats) -> (fitness [2], seen)`.

    What `make_fitness_fn`'s `fitness` gives each member of the antithetic pair
    `mean +- scale * noise` on `key`, from `pair_episode` (from
    `make_pair_episode_fn`): the same keys, so the same episodes. `mean` is
    flat; `noise` flat too, or leaf by leaf (`es.low_rank_pair_factors`).
    """

    def pair_fitness(mean, scale, noise, key, obs_stats):
        mean_tree = unravel(mean)
        if isinstance(noise, (list, tuple)):
            noise = jax.tree.unflatten(jax.tree.structure(mean_tree), list(noise))
        else:
            noise = unravel(noise)
        mean = mean_tree
        if episodes_per_member == 1:
            return pair_episode(mean, scale, noise, key, obs_stats)
        keys = jax.random.split(key, episodes_per_member)
        returns, seen = jax.vmap(pair_episode, in_axes=(None, None, None, 0, None))(
            mean, scale, noise, keys, obs_stats)
        return jnp.mean(returns, axis=0), (es.reduce_stats(seen) if normalize else ())

    return pair_fitness


def make_fitness_fn(episode, unravel: Callable, episodes_per_member: int, normalize: bool):
    """`fitness(flat_params, key, obs_stats) -> (fitness, seen)` of one member.

    Fitness is the mean return of `episodes_per_member` episodes of
    `episode` (from `make_episode_fn`) with the parameters `unravel(flat_params)`,
    on keys split from `key`; `seen` merges their observation statistics (`()`
    unless `normalize`). Parameters are unravelled once, outside the step loop.
    """

    def fitness(flat_params, key, obs_stats):
        if episodes_per_member == 1:  # no batch axis of size 1 through every step
            return episode(unravel(flat_params), key, obs_stats)
        keys = jax.random.split(key, episodes_per_member)
        returns, seen = jax.vmap(episode, in_axes=(None, 0, None))(
            unravel(flat_params), keys, obs_stats)
        return jnp.mean(returns), (es.reduce_stats(seen) if normalize else ())

    return fitness


class _ESParts(NamedTuple):
    layout: AnakinESLayout
    strategy: es.Strategy
    member_fitness: Callable  # (flat_params, key, obs_stats) -> (fitness, seen)
    pair_fitness: Callable | None  # (mean, scale, noise, key, obs_stats) -> (fitness [2], seen)
    evaluate_mean: Callable  # (mean, obs_stats, key) -> mean return, over the mesh
    init: Callable  # key -> ESRunner


def _make_parts(env: GymnaxEnv, policy: nn.Module, config: ESConfig, mesh: Mesh,
                strategy: es.Strategy | None) -> _ESParts:
    """What the fused step and the profile-mode phases share."""
    layout = make_es_layout(config, env, mesh)
    dummy_obs = jnp.zeros(env.spec.obs_shape, env.spec.obs_dtype)
    shapes = jax.eval_shape(policy.init, jax.random.key(0), dummy_obs)
    param_shapes = [leaf.shape for leaf in jax.tree.leaves(shapes)]
    strategy = make_strategy(config, param_shapes) if strategy is None else strategy
    if strategy.population_size != config.population:
        raise PodracerError(f"the strategy's population ({strategy.population_size}) differs "
                            f"from --population={config.population}")
    normalize = config.normalize_observations
    axes = (parallel.DATA_AXIS,)
    obs_dim = math.prod(env.spec.obs_shape)
    _, unravel = ravel_pytree(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
    episode = make_episode_fn(env, policy.apply, layout.horizon, normalize, axes)
    member_fitness = make_fitness_fn(episode, unravel, config.episodes_per_member, normalize)
    pair_fitness = None
    if config.low_rank and _all_dense(policy, shapes, dummy_obs):
        # A pair's members share the mean's matrix products (networks.apply_antithetic), and
        # each layer's rank-r noise is applied through its factors. (Full-rank pairs were
        # measured too: no faster here, the products with each pair's noise as costly as
        # each member's own kernel; members are evaluated one by one.)
        pair_act = lambda mean, noise, scale, obs: apply_antithetic(policy, mean, noise, scale, obs)
        pair_episode = make_pair_episode_fn(env, pair_act, layout.horizon, normalize, axes)
        pair_fitness = make_pair_fitness_fn(pair_episode, unravel, config.episodes_per_member,
                                            normalize)

    # Evaluation episodes are split over the devices by global index, so the
    # figure does not depend on the device count.
    eval_per_device = -(-config.eval_episodes // layout.num_devices)

    def evaluate_mean(mean, obs_stats, key):
        index = parallel.axis_offset(eval_per_device, axes) + jnp.arange(eval_per_device)
        keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, index)
        returns, _ = jax.vmap(episode, in_axes=(None, 0, None))(unravel(mean), keys, obs_stats)
        total = parallel.psum(jnp.sum(jnp.where(index < config.eval_episodes, returns, 0.0)), axes)
        return total / config.eval_episodes

    def init(key):
        param_key, run_key = jax.random.split(key)
        flat, _ = ravel_pytree(policy.init(param_key, dummy_obs))
        return ESRunner(strategy.init(flat), es.init_running_stats(obs_dim), run_key)

    evaluate_mean = jax.shard_map(evaluate_mean, mesh=mesh, in_specs=P(), out_specs=P(),
                                  check_vma=_check_vma(env))
    return _ESParts(layout, strategy, member_fitness, pair_fitness, evaluate_mean, init)


def _check_vma(env) -> bool:
    """Whether shard_map may check the replication of `env`'s step (not a suite's: see
    `podracer.envs.suites.base.SuiteEnv.check_vma`)."""
    return getattr(env, "check_vma", True)


def _all_dense(policy: nn.Module, shapes, dummy_obs) -> bool:
    """Whether `networks.apply_antithetic` can evaluate `policy` (its parameters all `nn.Dense`'s)."""
    variables = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    try:
        jax.eval_shape(lambda v, o: apply_antithetic(policy, v, v, 1.0, o), variables,
                       jnp.stack([dummy_obs, dummy_obs]))
    except Exception:  # noqa: BLE001  (other layers, or no batch of two: member by member)
        return False
    return True


def _split_keys(key: jax.Array, generations: int):
    """(next key, one key per generation of the call, key of the mean-parameters evaluation)."""
    key, generations_key, eval_key = jax.random.split(key, 3)
    return key, jax.random.split(generations_key, generations), eval_key


def make_anakin_es(env: GymnaxEnv, policy: nn.Module, config: ESConfig, mesh: Mesh,
                   strategy: es.Strategy | None = None):
    """Build the jitted `init(key) -> runner` and `step(runner) -> (runner, metrics)`.

    `step` runs `config.generations_per_call` generations over every device of
    `mesh` and donates its input. Its metrics are the strategy's, stacked over
    those generations (`fitness_mean`, `fitness_max`, ...), plus the scalar
    `mean_params_return`: the new mean parameters' mean return over
    `config.eval_episodes` episodes (split over the devices).

    `strategy` replaces the one `config` describes (`make_strategy(config)`), e.g.
    a custom `init / ask / tell` whose state has the flat policy parameters in
    `mean`; its population must be `config.population`.
    """
    parts, step = _make_step(env, policy, config, mesh, strategy)
    everywhere = parallel.replicated(mesh)
    return (jax.jit(parts.init, out_shardings=everywhere, compiler_options=parallel.run_once_options(mesh)),
            jax.jit(step, in_shardings=everywhere, out_shardings=everywhere, donate_argnums=0))


def _make_step(env: GymnaxEnv, policy: nn.Module, config: ESConfig, mesh: Mesh,
               strategy: es.Strategy | None = None):
    """`make_anakin_es`'s parts and its step, not jitted (a population vmaps it)."""
    parts = _make_parts(env, policy, config, mesh, strategy)
    member_fitness, pair_fitness = parts.member_fitness, parts.pair_fitness
    if config.normalize_observations:
        generations = es.make_sharded_step_normalized(
            parts.strategy, member_fitness, mesh, generations_per_call=config.generations_per_call,
            pair_fitness_fn=pair_fitness, check_vma=_check_vma(env))
    else:
        pair = None if pair_fitness is None else (
            lambda mean, scale, noise, key: pair_fitness(mean, scale, noise, key, None)[0])
        sharded = es.make_sharded_step(
            parts.strategy, lambda params, key: member_fitness(params, key, None)[0], mesh,
            generations_per_call=config.generations_per_call, pair_fitness_fn=pair, check_vma=_check_vma(env))

        def generations(state, obs_stats, key):
            state, metrics = sharded(state, key)
            return state, obs_stats, metrics

    def step(runner: ESRunner):
        key, generations_key, eval_key = jax.random.split(runner.key, 3)
        state, obs_stats, metrics = generations(runner.strategy, runner.obs_stats,
                                                generations_key)
        metrics = dict(metrics, mean_params_return=parts.evaluate_mean(state.mean, obs_stats, eval_key),
                       params_finite=jnp.all(jnp.isfinite(state.mean)))  # the NaN guard's
        return ESRunner(state, obs_stats, key), metrics

    return parts, step


class ESPhases(NamedTuple):
    """One `make_anakin_es` step as separate jitted programs (profile mode), all replicated."""

    split_keys: Callable  # runner key -> (next key, [generations_per_call] keys, evaluation key)
    evaluate: Callable  # (state, obs_stats, generation key) -> (ask_key, fitness, seen)
    tell: Callable  # (state, obs_stats, ask_key, fitness, seen) -> (state, obs_stats, metrics)
    evaluate_mean: Callable  # (mean, obs_stats, evaluation key) -> mean return


def make_anakin_es_phases(env: GymnaxEnv, policy: nn.Module, config: ESConfig, mesh: Mesh,
                          strategy: es.Strategy | None = None) -> ESPhases:
    """The phases of `make_anakin_es`'s step, to run and time one by one.

    Run in order (`podracer.anakin.profiled.make_profiled_es_step`) they
    compute the same generations with the same keys as the fused step.
    """
    parts = _make_parts(env, policy, config, mesh, strategy)
    normalize = config.normalize_observations
    fitness = parts.member_fitness if normalize else (
        lambda params, key, _: (parts.member_fitness(params, key, None)[0], ()))
    pair = parts.pair_fitness
    if pair is not None and not normalize:
        pair = lambda mean, scale, noise, key, _: (parts.pair_fitness(mean, scale, noise, key, None)[0], ())
    evaluate, tell = es.make_sharded_phases(parts.strategy, fitness, mesh, normalize=normalize,
                                            pair_fitness_fn=pair, check_vma=_check_vma(env))
    everywhere = parallel.replicated(mesh)
    jit = lambda fn: jax.jit(fn, in_shardings=everywhere, out_shardings=everywhere)

    def split_keys(key):
        key, generation_keys, eval_key = _split_keys(key, config.generations_per_call)
        return key, tuple(generation_keys), eval_key  # one array per generation: no indexing on the host

    return ESPhases(jit(split_keys), evaluate, tell, jit(parts.evaluate_mean))
