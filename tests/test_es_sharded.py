"""ES protocol: the population split over devices, fitness scalars the only traffic."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from podracer import es
from podracer.errors import PodracerError
from podracer.protocol.parallel import DATA_AXIS, make_mesh, replicated

KEY = jax.random.key(42)
POPULATION = 16
GENERATIONS = 3
OBS_DIM = 3


@pytest.fixture(scope="module")
def mesh8():
    assert len(jax.devices()) == 8, "tests/conftest.py must force 8 CPU devices"
    return make_mesh()


@pytest.fixture(scope="module")
def mesh1():
    return make_mesh(jax.devices()[:1])


def noisy_quadratic(params, key):
    """Depends on the member's key, so the key each member receives is checked too."""
    target = jnp.linspace(-1.0, 1.0, params.shape[0])
    return -jnp.sum((params - target) ** 2) + 0.1 * jax.random.normal(key)


def observed_quadratic(params, key, obs_stats):
    """ARS V2-style member: reads normalised observations, reports the raw ones it saw."""
    obs = jax.random.normal(key, (5, OBS_DIM)) * jnp.array([1.0, 4.0, 0.5]) + 2.0
    mask = jnp.array([1.0, 1.0, 1.0, 1.0, 0.0])  # the last step is after the episode ended
    features = jnp.mean(es.ars_normalize(obs_stats, obs) * mask[:, None], axis=0)
    fitness = noisy_quadratic(params, key) + jnp.dot(features, params[:OBS_DIM])
    return fitness, es.observation_stats(obs, mask)


def strategies():
    return {
        "openai_es": es.make_openai_es(POPULATION, 0.1, optax.adam(0.05), weight_decay=0.01),
        "ars": es.make_ars(POPULATION // 2, 3, 0.05, 0.05),
    }


@functools.partial(jax.jit, static_argnums=0)
def reference_generations(strategy, state, key, obs_stats=None):
    """The step's semantics on one device, written out: ask all, evaluate, tell.

    Returns the final state and observation statistics, and every observation
    batch the members reported (stacked over generations and members).
    """
    members = jnp.arange(strategy.population_size)

    def generation(carry, generation_key):
        state, obs_stats = carry
        ask_key, evaluate_key = jax.random.split(generation_key)
        params = strategy.ask(state, ask_key, members)
        member_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(evaluate_key, members // 2)
        if obs_stats is None:
            fitness, seen = jax.vmap(noisy_quadratic)(params, member_keys), None
        else:
            evaluate = jax.vmap(observed_quadratic, in_axes=(0, 0, None))
            fitness, seen = evaluate(params, member_keys, obs_stats)
            obs_stats = es.merge_stats(obs_stats, es.reduce_stats(seen))
        state, _ = strategy.tell(state, ask_key, fitness)
        return (state, obs_stats), seen

    keys = jax.random.split(key, GENERATIONS)
    (state, obs_stats), seen = jax.lax.scan(generation, (state, obs_stats), keys)
    return state, obs_stats, seen


def assert_trees_close(actual, expected, **tolerance):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **tolerance), actual, expected)


# ---------------------------------------------------------------- same update everywhere


@pytest.mark.parametrize("name", ["openai_es", "ars"])
def test_same_update_on_1_and_8_devices(name, mesh1, mesh8):
    strategy = strategies()[name]
    initial = strategy.init(jnp.linspace(0.5, -0.5, 6))
    expected, _, _ = reference_generations(strategy, initial, KEY)
    for mesh in (mesh1, mesh8):
        step = es.make_sharded_step(
            strategy, noisy_quadratic, mesh, generations_per_call=GENERATIONS
        )
        state, metrics = step(initial, KEY)
        assert metrics["fitness_mean"].shape == (GENERATIONS,)
        assert int(state.generation) == GENERATIONS
        assert_trees_close(state, expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(state.mean, initial.mean)  # the comparison is not vacuous


def pair_quadratic(mean, scale, noise, key):
    """`noisy_quadratic` of both members of a pair, from the factored perturbation."""
    return jnp.stack([noisy_quadratic(mean + scale * noise, key), noisy_quadratic(mean - scale * noise, key)])


@pytest.mark.parametrize("name", ["openai_es", "ars"])
def test_pair_path_is_the_member_path(name, mesh1, mesh8):
    """A pair fitness sees each pair's factored perturbation and key: the same update."""
    strategy = strategies()[name]
    initial = strategy.init(jnp.linspace(0.5, -0.5, 6))
    expected, _, _ = reference_generations(strategy, initial, KEY)
    calls = []

    def counted(mean, scale, noise, key):
        calls.append(noise.shape)
        return pair_quadratic(mean, scale, noise, key)

    for mesh in (mesh1, mesh8):
        step = es.make_sharded_step(strategy, noisy_quadratic, mesh, generations_per_call=GENERATIONS,
                                    pair_fitness_fn=counted)
        state, _ = step(initial, KEY)
        assert_trees_close(state, expected, rtol=1e-5, atol=1e-6)
    assert calls and all(shape == (6,) for shape in calls)  # traced, one pair at a time
    # A pair fitness of the wrong shape is refused in one line.
    with pytest.raises(PodracerError, match="shape \\(2,\\)"):
        es.make_sharded_step(strategy, noisy_quadratic, mesh1,
                             pair_fitness_fn=lambda *args: pair_quadratic(*args)[0])(initial, KEY)


def test_normalized_step_matches_on_1_and_8_devices(mesh1, mesh8):
    strategy = strategies()["ars"]
    initial = strategy.init(jnp.zeros(6))
    expected, expected_stats, seen = reference_generations(
        strategy, initial, KEY, obs_stats=es.init_running_stats(OBS_DIM)
    )
    # Statistics cover exactly the unmasked observations of every member and generation.
    assert float(expected_stats.count) == GENERATIONS * POPULATION * 4
    every_member = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), seen)
    assert_trees_close(expected_stats, es.reduce_stats(every_member), rtol=1e-4)
    for mesh in (mesh1, mesh8):
        step = es.make_sharded_step_normalized(
            strategy, observed_quadratic, mesh, generations_per_call=GENERATIONS
        )
        state, obs_stats, _ = step(initial, es.init_running_stats(OBS_DIM), KEY)
        assert_trees_close(state, expected, rtol=1e-5, atol=1e-6)
        assert_trees_close(obs_stats, expected_stats, rtol=1e-4, atol=1e-5)


def test_psum_stats_across_devices_equals_stats_of_everything(mesh8):
    obs = jax.random.normal(KEY, (8 * 10, OBS_DIM)) * 3.0 + 1.0

    def per_device(local_obs):
        return es.psum_stats(es.observation_stats(local_obs), (DATA_AXIS,))

    reduce = jax.shard_map(per_device, mesh=mesh8, in_specs=P(DATA_AXIS), out_specs=P())
    combined = jax.jit(reduce)(obs)
    assert_trees_close(combined, es.observation_stats(obs), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- communication


COLLECTIVE = re.compile(
    r"=\s*(?P<type>.*?)\s+(?P<op>all-gather|all-reduce|collective-permute|all-to-all"
    r"|ragged-all-to-all|reduce-scatter|collective-broadcast)(?:-start)?\("
)
ARRAY_TYPE = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")


def collective_sizes(hlo_text):
    """(op, elements of its largest array) for every cross-device op in compiled HLO."""
    found = []
    for line in hlo_text.splitlines():
        match = COLLECTIVE.search(line)
        if match:
            dims = ARRAY_TYPE.findall(match["type"])
            sizes = [math.prod(int(d) for d in shape.split(",") if d) for shape in dims]
            found.append((match["op"], max(sizes)))
    return found


def test_collective_parser_sees_a_parameter_sized_psum(mesh8):
    """The parser is not vacuous: the design we avoid (psum of a gradient) is caught."""

    def psum_gradient(x):
        return jax.lax.psum(x * jax.lax.axis_index(DATA_AXIS), DATA_AXIS)

    hlo = jax.jit(jax.shard_map(psum_gradient, mesh=mesh8, in_specs=P(), out_specs=P()))
    sizes = collective_sizes(hlo.lower(jnp.ones(1000)).compile().as_text())
    assert ("all-reduce", 1000) in sizes


@pytest.mark.parametrize("name", ["openai_es", "ars", "ars_v2"])
def test_only_fitness_scalars_cross_devices(name, mesh8):
    num_dims = 4096  # parameter-sized traffic would show up as >= 4096 elements
    if name == "ars_v2":
        strategy = strategies()["ars"]
        step = es.make_sharded_step_normalized(
            strategy, observed_quadratic, mesh8, generations_per_call=2
        )
        args = (strategy.init(jnp.zeros(num_dims)), es.init_running_stats(OBS_DIM), KEY)
    else:
        strategy = strategies()[name]
        step = es.make_sharded_step(strategy, noisy_quadratic, mesh8, generations_per_call=2)
        args = (strategy.init(jnp.zeros(num_dims)), KEY)
    sizes = collective_sizes(step.lower(*args).compile().as_text())
    assert ("all-gather", POPULATION) in sizes  # the fitness vector, [population] floats
    # Everything else is at most that big: no perturbation or gradient ever moves.
    # (ARS V2 adds its observation statistics: obs_dim + 1 floats.)
    assert all(size <= POPULATION for _, size in sizes), sizes


# ---------------------------------------------------------------- host calls


def test_second_call_reuses_the_compiled_step(mesh8):
    strategy = strategies()["openai_es"]
    step = es.make_sharded_step(strategy, noisy_quadratic, mesh8, generations_per_call=2)
    state = jax.device_put(strategy.init(jnp.zeros(6)), replicated(mesh8))
    for key in jax.random.split(KEY, 2):
        state, _ = step(state, key)
    assert step._cache_size() == 1
    assert state.mean.sharding.is_fully_replicated


def test_population_must_split_over_devices(mesh8):
    with pytest.raises(PodracerError, match="population_size=12"):
        es.make_sharded_step(es.make_openai_es(12, 0.1, optax.sgd(0.1)), noisy_quadratic, mesh8)


def test_fitness_fn_must_return_a_scalar(mesh1):
    strategy = strategies()["openai_es"]
    step = es.make_sharded_step(strategy, lambda params, key: params, mesh1)
    with pytest.raises(PodracerError, match="one scalar per member"):
        step(strategy.init(jnp.zeros(3)), KEY)
