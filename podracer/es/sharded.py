"""Protocol for ES: the population split over a mesh, fitness scalars the only traffic.

Each device holds the replicated strategy state and evaluates members
`[d * n, (d + 1) * n)` of the generation, drawing their noise from the shared
generation key and the member index. The local fitness vectors are
all-gathered into the full `[population]` vector, and every device then runs
the same `tell`, regenerating all members' noise itself, so the new state is
identical everywhere without any parameter-sized collective. (ARS V2 adds one
observation-statistics reduction of `2 * obs_dim + 1` floats.)

One host call runs `generations_per_call` generations in a `lax.scan` inside a
single `jax.jit(jax.shard_map(...))`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import chex
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from podracer.es.strategy import Strategy
from podracer.errors import PodracerError
from podracer.normalize import RunningStats, merge_stats, psum_stats, reduce_stats
from podracer.protocol import parallel
from podracer.protocol.parallel import DATA_AXIS, axis_offset, replicated, split_evenly

FitnessFn = Callable[[chex.Array, chex.PRNGKey], chex.Array]
NormalizedFitnessFn = Callable[
    [chex.Array, chex.PRNGKey, RunningStats], tuple[chex.Array, RunningStats]
]


def _scalar_fitness(fitness: chex.Array) -> chex.Array:
    if jnp.shape(fitness) != ():
        raise PodracerError(
            f"fitness_fn must return one scalar per member, got shape {jnp.shape(fitness)}"
        )
    return jnp.asarray(fitness, jnp.float32)


def _pair_evaluate(pair_fitness_fn: Callable | None, normalize: bool) -> Callable | None:
    """`pair_fitness_fn` with its fitness checked ([2] float32) and `seen` dropped unless normalising."""
    if pair_fitness_fn is None:
        return None

    def evaluate(mean, scale, noise, key, obs_stats):
        fitness, seen = pair_fitness_fn(mean, scale, noise, key, obs_stats)
        if jnp.shape(fitness) != (2,):
            raise PodracerError(f"pair_fitness_fn must return the fitness of both members of a pair "
                                f"(shape (2,)), got shape {jnp.shape(fitness)}")
        return jnp.asarray(fitness, jnp.float32), (seen if normalize else ())

    return evaluate


def _jit_replicated(fn: Callable, mesh: Mesh):
    """`jax.jit` with every input and output replicated over `mesh`."""
    return jax.jit(fn, in_shardings=replicated(mesh), out_shardings=replicated(mesh))


def _make_phases(strategy: Strategy, evaluate_fn: Callable, mesh: Mesh, axis: str, normalize: bool,
                 pair_evaluate_fn: Callable | None = None):
    """Per-device `evaluate` and `tell` of one generation on this device's members.

    `evaluate(state, obs_stats, key) -> (ask_key, fitness, seen)`: ask, roll out
    this device's members, all-gather the `[population]` fitness (and, to
    normalise, sum the observation statistics seen). `tell(state, obs_stats,
    ask_key, fitness, seen) -> (state, obs_stats, metrics)`: the same update on
    every device.

    With `pair_evaluate_fn(mean, scale, noise, key, obs_stats) -> (fitness [2],
    seen)` and a strategy that has `perturb`, a device whose members are whole
    pairs evaluates them pair by pair from the factored perturbation (the same
    members, the same keys) instead of asking for each member's parameters.
    """
    if axis not in mesh.shape:
        raise PodracerError(f"mesh has no axis {axis!r} (axes: {tuple(mesh.shape)})")
    local_size = split_evenly(
        strategy.population_size, mesh.shape[axis], "population members", "population_size"
    )
    axis_names = (axis,)
    by_pairs = pair_evaluate_fn is not None and strategy.perturb is not None and local_size % 2 == 0

    def evaluate_members(state, obs_stats, ask_key, evaluate_key):
        members = axis_offset(local_size, axis_names) + jnp.arange(local_size)
        params = strategy.ask(state, ask_key, members)
        # Both halves of an antithetic pair see the same environment randomness.
        member_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(evaluate_key, members // 2)
        return jax.vmap(evaluate_fn, in_axes=(0, 0, None))(params, member_keys, obs_stats)

    def evaluate_pairs(state, obs_stats, ask_key, evaluate_key):
        num_pairs = local_size // 2
        pairs = axis_offset(num_pairs, axis_names) + jnp.arange(num_pairs)
        perturbation = strategy.perturb(state, ask_key, pairs[0], num_pairs)
        pair_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(evaluate_key, pairs)
        fitness, obs_stats_seen = jax.vmap(pair_evaluate_fn, in_axes=(None, None, 0, 0, None))(
            perturbation.mean, perturbation.scale, perturbation.noise, pair_keys, obs_stats)
        return fitness.reshape(local_size), obs_stats_seen

    def evaluate(state, obs_stats, key):
        ask_key, evaluate_key = jax.random.split(key)
        local_fitness, local_obs_stats = (evaluate_pairs if by_pairs else evaluate_members)(
            state, obs_stats, ask_key, evaluate_key)
        fitness = parallel.all_gather(local_fitness, axis_names)
        seen = psum_stats(reduce_stats(local_obs_stats), axis_names) if normalize else ()
        return ask_key, fitness, seen

    def tell(state, obs_stats, ask_key, fitness, seen):
        state, metrics = strategy.tell(state, ask_key, fitness)
        if normalize:
            obs_stats = merge_stats(obs_stats, seen)
        return state, obs_stats, metrics

    return evaluate, tell


def _make_generations(
    strategy: Strategy,
    evaluate_fn: Callable,
    mesh: Mesh,
    axis: str,
    generations: int,
    normalize: bool,
    pair_evaluate_fn: Callable | None = None,
):
    """`run(state, obs_stats, key)`: `generations` ES generations on this device's members."""
    if generations < 1:
        raise PodracerError(f"generations_per_call must be >= 1, got {generations}")
    evaluate, tell = _make_phases(strategy, evaluate_fn, mesh, axis, normalize, pair_evaluate_fn)

    def one_generation(carry, key):
        state, obs_stats = carry
        ask_key, fitness, seen = evaluate(state, obs_stats, key)
        state, obs_stats, metrics = tell(state, obs_stats, ask_key, fitness, seen)
        return (state, obs_stats), metrics

    def run(state, obs_stats, key):
        keys = jax.random.split(key, generations)
        (state, obs_stats), metrics = jax.lax.scan(one_generation, (state, obs_stats), keys)
        return state, obs_stats, metrics

    return run


def make_sharded_phases(
    strategy: Strategy,
    evaluate_fn: NormalizedFitnessFn,
    mesh: Mesh,
    *,
    normalize: bool,
    axis: str = DATA_AXIS,
    pair_fitness_fn: Callable | None = None,
    check_vma: bool = True,
):
    """One generation as two jitted calls, for a host that times them apart (profile mode).

    `evaluate(state, obs_stats, key) -> (ask_key, fitness, seen)` and
    `tell(state, obs_stats, ask_key, fitness, seen) -> (state, obs_stats, metrics)`,
    everything replicated. `evaluate_fn(params, key, obs_stats) -> (fitness,
    seen)` as for `make_sharded_step_normalized` (`seen` is ignored unless
    `normalize`). The generation keyed by `key` is the one `make_sharded_step`
    runs on that key. `pair_fitness_fn(mean, scale, noise, key, obs_stats) ->
    (fitness [2], seen)` as for `make_sharded_step_normalized`.
    """

    def scalar_evaluate(params, key, obs_stats):
        fitness, seen = evaluate_fn(params, key, obs_stats)
        return _scalar_fitness(fitness), (seen if normalize else ())

    evaluate, tell = _make_phases(strategy, scalar_evaluate, mesh, axis, normalize,
                                  _pair_evaluate(pair_fitness_fn, normalize))
    shard = lambda fn: _jit_replicated(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(),
                                                     check_vma=check_vma), mesh)
    return shard(evaluate), shard(tell)


def make_sharded_step(
    strategy: Strategy,
    fitness_fn: FitnessFn,
    mesh: Mesh,
    *,
    generations_per_call: int = 1,
    axis: str = DATA_AXIS,
    pair_fitness_fn: Callable | None = None,
    check_vma: bool = True,
):
    """One jitted call running `generations_per_call` generations over `mesh`.

    Per generation: `ask` this device's members -> `fitness_fn` on each ->
    `all_gather` of the `[population]` fitness -> `tell` on every device.
    Fitness is MAXIMISED.

    Args:
      strategy: e.g. `make_openai_es(...)` or `make_ars(...)`.
      fitness_fn: `fitness_fn(params_flat [num_dims], key) -> scalar`, pure and
        jittable. Members `2k` and `2k + 1` receive the same key.
      mesh: a mesh with axis `axis`; `population_size` must split evenly over it.
      generations_per_call: generations per host call (a `lax.scan`).
      axis: the mesh axis the population is split over.
      pair_fitness_fn: optional `pair_fitness_fn(mean, scale, noise_k, key) ->
        [2]`: the fitness of both members of antithetic pair `k` (`mean + scale
        * noise_k` and `mean - scale * noise_k`, both on `key`), what
        `fitness_fn` gives each. With a strategy that has `perturb` it is used
        instead of `fitness_fn` where a device holds whole pairs: an evaluator
        that knows its parameters' structure can share the work of a pair's
        members (e.g. `x @ mean` for every member, one `x @ noise_k` per pair).
      check_vma: `jax.shard_map`'s replication check; off for a fitness whose
        code cannot be checked (an environment library's `lax.cond` whose
        branches differ in varying-ness).

    Returns:
      `step(state, key) -> (state, metrics)`, jitted; `state` replicated in and
      out, each metric stacked over the `generations_per_call` generations.
      Place the initial state with `jax.device_put(state, replicated(mesh))`
      so the first call and later ones share one compilation.
    """
    pair_evaluate = None
    if pair_fitness_fn is not None:
        pair_evaluate = lambda mean, scale, noise, key, _: (pair_fitness_fn(mean, scale, noise, key), ())
    run = _make_generations(
        strategy,
        lambda params, key, _: (_scalar_fitness(fitness_fn(params, key)), ()),
        mesh,
        axis,
        generations_per_call,
        normalize=False,
        pair_evaluate_fn=_pair_evaluate(pair_evaluate, normalize=False),
    )

    def step(state: Any, key: chex.PRNGKey):
        state, _, metrics = run(state, (), key)
        return state, metrics

    return _jit_replicated(jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=check_vma),
                           mesh)


def make_sharded_step_normalized(
    strategy: Strategy,
    fitness_fn: NormalizedFitnessFn,
    mesh: Mesh,
    *,
    generations_per_call: int = 1,
    axis: str = DATA_AXIS,
    pair_fitness_fn: Callable | None = None,
    check_vma: bool = True,
):
    """`make_sharded_step` with online observation normalisation (ARS V2).

    Args:
      strategy: usually `make_ars(...)` (any strategy works).
      fitness_fn: `fitness_fn(params_flat, key, obs_stats) -> (fitness, seen)`:
        the member's return with its policy reading `ars_normalize(obs_stats, obs)`,
        and `observation_stats` of the raw observations it visited (mask the
        steps after an episode ends).
      mesh, generations_per_call, axis: as in `make_sharded_step`.
      pair_fitness_fn: optional `pair_fitness_fn(mean, scale, noise_k, key,
        obs_stats) -> (fitness [2], seen)`, both members of pair `k` (`seen`
        merged over them), as in `make_sharded_step`.

    Returns:
      `step(state, obs_stats, key) -> (state, obs_stats, metrics)`, jitted. The
      generation's observations update `obs_stats` after its rollouts. As for
      `make_sharded_step`, `jax.device_put` the initial arguments replicated.
    """

    def evaluate(params, key, obs_stats):
        fitness, seen = fitness_fn(params, key, obs_stats)
        return _scalar_fitness(fitness), seen

    run = _make_generations(strategy, evaluate, mesh, axis, generations_per_call, normalize=True,
                            pair_evaluate_fn=_pair_evaluate(pair_fitness_fn, normalize=True))
    return _jit_replicated(jax.shard_map(run, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=check_vma),
                           mesh)
