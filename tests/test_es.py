"""ES maths against hand-computed cases, and short optimisation runs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from podracer import es
from podracer.errors import PodracerError

KEY = jax.random.key(0)
TARGET = jnp.linspace(-3.0, 3.0, 10)  # a different optimum, and sign, per coordinate


def quadratic_fitness(params, key=None):
    """Maximised at TARGET: a wrong update sign walks away from it."""
    return -jnp.sum((params - TARGET) ** 2)


def run_generations(strategy, state, key, generations):
    """Reference loop: ask every member, evaluate, tell; one jitted scan."""
    members = jnp.arange(strategy.population_size)

    def generation(state, key):
        params = strategy.ask(state, key, members)
        fitness = jax.vmap(quadratic_fitness)(params)
        return strategy.tell(state, key, fitness)

    return jax.jit(lambda s, k: jax.lax.scan(generation, s, jax.random.split(k, generations)))(
        state, key
    )


# ---------------------------------------------------------------- fitness shaping


def test_centred_ranks_hand_computed():
    expected = [1 / 6, -1 / 2, -1 / 6, 1 / 2]
    fitness = jnp.array([3.0, 1.0, 2.0, 5.0])
    np.testing.assert_allclose(es.centred_ranks(fitness), expected, atol=1e-7)
    # Scale-free: any increasing transform of fitness gives the same weights.
    np.testing.assert_allclose(
        es.centred_ranks(jnp.array([30.0, -100.0, 2.5, 1e6])), expected, atol=1e-7
    )


def test_centred_ranks_ties_share_their_mean_rank():
    np.testing.assert_allclose(es.centred_ranks(jnp.array([2.0, 2.0, 1.0, 3.0])), [0, 0, -0.5, 0.5])
    np.testing.assert_allclose(es.centred_ranks(jnp.full((6,), 7.0)), np.zeros(6))


# ---------------------------------------------------------------- antithetic noise


def test_antithetic_pairs_and_regeneration_by_index():
    noise = es.population_noise(KEY, jnp.arange(6), 5)
    assert noise.shape == (6, 5) and noise.dtype == jnp.float32
    np.testing.assert_array_equal(noise[1::2], -noise[0::2])  # eps_{2k+1} = -eps_{2k}
    assert not np.allclose(noise[0], noise[2])  # pairs are independent directions
    member_noise = jax.jit(es.member_noise, static_argnums=2)
    for i in range(6):  # any device can regenerate any member from (key, index)
        np.testing.assert_array_equal(member_noise(KEY, i, 5), noise[i])
    np.testing.assert_array_equal(es.population_noise(KEY, jnp.array([3, 4]), 5), noise[3:5])
    # Contiguous blocks share pair draws; any other order takes the general path.
    for members in ([1, 2, 3], [2, 3, 4, 5], [0], [4, 1, 5], [2, 2]):
        np.testing.assert_array_equal(
            es.population_noise(KEY, jnp.array(members), 5), noise[np.array(members)]
        )
    assert not np.allclose(es.member_noise(jax.random.key(1), 0, 5), noise[0])


def test_ask_returns_mean_plus_sigma_times_member_noise():
    strategy = es.make_openai_es(4, sigma=0.5, optimizer=optax.sgd(1.0))
    state = strategy.init(jnp.arange(3.0))
    params = strategy.ask(state, KEY, jnp.array([2, 3]))
    expected = jnp.arange(3.0) + 0.5 * es.population_noise(KEY, jnp.array([2, 3]), 3)
    np.testing.assert_allclose(params, expected, rtol=1e-6)
    np.testing.assert_allclose(params[0] + params[1], 2 * jnp.arange(3.0), rtol=1e-6)


@pytest.mark.parametrize("make", [lambda: es.make_openai_es(8, sigma=0.3, optimizer=optax.sgd(1.0)),
                                  lambda: es.make_ars(4, 2, step_size=0.1, sigma=0.3)])
def test_perturb_factors_what_ask_returns(make):
    strategy = make()
    state = strategy.init(jnp.linspace(-1.0, 1.0, 5))
    perturbation = jax.jit(strategy.perturb, static_argnums=3)(state, KEY, 1, 3)  # pairs 1, 2, 3
    asked = strategy.ask(state, KEY, jnp.arange(2, 8))
    plus = perturbation.mean + perturbation.scale * perturbation.noise
    minus = perturbation.mean - perturbation.scale * perturbation.noise
    np.testing.assert_allclose(asked[0::2], plus, rtol=1e-6)
    np.testing.assert_allclose(asked[1::2], minus, rtol=1e-6)


# ---------------------------------------------------------------- low-rank noise

SHAPES = [(3,), (4, 3), (3, 2), (2,)]
NUM_DIMS = sum(int(np.prod(shape)) for shape in SHAPES)


def test_low_rank_noise_is_factored_matrices_regenerated_by_index():
    factors = es.low_rank_pair_factors(KEY, 5, SHAPES, 2)
    assert isinstance(factors[1], es.LowRank) and factors[1].a.shape == (4, 2) and factors[1].b.shape == (3, 2)
    assert factors[0].shape == (3,) and not isinstance(factors[3], es.LowRank)
    flat = es.low_rank_pair_noise(KEY, 5, SHAPES, 2)
    assert flat.shape == (NUM_DIMS,)
    matrix = np.asarray(flat[3:15]).reshape(4, 3)
    np.testing.assert_allclose(matrix, factors[1].a @ factors[1].b.T, rtol=1e-6)
    assert np.linalg.matrix_rank(matrix) == 2  # rank r, not full
    np.testing.assert_array_equal(jax.jit(es.low_rank_pair_noise, static_argnums=(2, 3))(KEY, 5, tuple(SHAPES), 2), flat)
    assert not np.allclose(es.low_rank_pair_noise(KEY, 4, SHAPES, 2), flat)
    # Unit variance per entry, like full-rank noise.
    big = es.low_rank_pair_noise(KEY, 0, [(300, 400)], 3)
    assert abs(float(jnp.var(big)) - 1.0) < 0.05 and abs(float(jnp.mean(big))) < 0.05


def test_low_rank_openai_es_asks_perturbs_and_tells_alike():
    strategy = es.make_openai_es(8, sigma=0.3, optimizer=optax.sgd(1.0), low_rank=2, param_shapes=SHAPES)
    state = strategy.init(jnp.linspace(-1.0, 1.0, NUM_DIMS))
    members = jnp.arange(8)
    asked = strategy.ask(state, KEY, members)
    # Member i is the mean plus sign(i) sigma eps_{i // 2}, any subset regenerated alike.
    noise = jnp.stack([es.low_rank_pair_noise(KEY, k, SHAPES, 2) for k in range(4)])
    np.testing.assert_allclose(asked[0::2], state.mean + 0.3 * noise, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(asked[1::2], state.mean - 0.3 * noise, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(strategy.ask(state, KEY, jnp.array([5, 2])), asked[jnp.array([5, 2])], rtol=1e-6)
    perturbation = strategy.perturb(state, KEY, 1, 3)
    np.testing.assert_allclose(jax.vmap(es.flatten_factors)(perturbation.noise), noise[1:], rtol=1e-5,
                               atol=1e-6)
    # tell: the search gradient of these very members, sgd(1) steps by it exactly.
    fitness = jnp.array([3.0, 1.0, 0.0, 2.0, 5.0, 4.0, 7.0, 6.0])
    shaped = es.centred_ranks(fitness)
    ascent = (shaped[0::2] - shaped[1::2]) @ noise / (8 * 0.3)
    new_state, _ = strategy.tell(state, KEY, fitness)
    np.testing.assert_allclose(new_state.mean - state.mean, ascent, rtol=1e-5, atol=1e-6)
    with pytest.raises(PodracerError, match="param_shapes"):
        es.make_openai_es(8, sigma=0.3, optimizer=optax.sgd(1.0), low_rank=2)


# ---------------------------------------------------------------- OpenAI-ES


def test_openai_es_tell_hand_computed_step_is_ascent():
    sigma, lr = 0.1, 0.5
    strategy = es.make_openai_es(4, sigma, optax.sgd(lr))
    mean = jnp.array([1.0, -2.0, 0.5])
    state, metrics = strategy.tell(strategy.init(mean), KEY, jnp.array([3.0, 1.0, 2.0, 5.0]))
    eps0, eps1 = es.pair_noise(KEY, 0, 3), es.pair_noise(KEY, 1, 3)
    # u = [1/6, -1/2, -1/6, 1/2];  g = sum_i u_i eps_i / (n sigma), eps_{2k+1} = -eps_{2k}
    gradient = ((1 / 6 + 1 / 2) * eps0 + (-1 / 6 - 1 / 2) * eps1) / (4 * sigma)
    np.testing.assert_allclose(state.mean, mean + lr * gradient, rtol=1e-5)
    assert int(state.generation) == 1
    np.testing.assert_allclose(metrics["fitness_mean"], 2.75)
    np.testing.assert_allclose(metrics["gradient_norm"], jnp.linalg.norm(gradient), rtol=1e-5)


def test_openai_es_weight_decay_is_l2_on_the_mean():
    lr, decay = 0.5, 0.1
    mean = jnp.array([1.0, -2.0, 0.5])
    fitness = jnp.array([3.0, 1.0, 2.0, 5.0])
    new_means = []
    for weight_decay in (0.0, decay):
        strategy = es.make_openai_es(4, 0.1, optax.sgd(lr), weight_decay=weight_decay)
        new_means.append(strategy.tell(strategy.init(mean), KEY, fitness)[0].mean)
    np.testing.assert_allclose(new_means[1] - new_means[0], -lr * decay * mean, rtol=1e-5)


def test_openai_es_equal_fitness_leaves_the_mean_alone():
    strategy = es.make_openai_es(8, 0.1, optax.sgd(1.0))
    state, _ = strategy.tell(strategy.init(jnp.ones(3)), KEY, jnp.zeros(8))
    np.testing.assert_array_equal(state.mean, jnp.ones(3))


def test_openai_es_maximises_a_quadratic():
    strategy = es.make_openai_es(32, sigma=0.1, optimizer=optax.adam(0.05))
    state, metrics = run_generations(strategy, strategy.init(jnp.zeros(10)), KEY, 300)
    # Starts 3 away in the outer coordinates; a wrong sign walks away, and pairs
    # that do not mirror each other leave noise of order sigma in the mean.
    assert float(jnp.max(jnp.abs(state.mean - TARGET))) < 0.02
    assert float(metrics["fitness_mean"][-1]) > -0.2 > float(metrics["fitness_mean"][0])


# ---------------------------------------------------------------- ARS


def test_ars_keeps_top_directions_and_scales_by_their_return_std():
    step_size = 0.2
    # r+ = [1, 5, 2], r- = [4, 0, 2]: max = [4, 5, 2], so the top 2 are directions 1 and 0.
    fitness = jnp.array([1.0, 4.0, 5.0, 0.0, 2.0, 2.0])
    step, returns_std = es.ars_step(KEY, fitness, 2, step_size, 4)
    kept = np.array([5.0, 0.0, 1.0, 4.0])
    np.testing.assert_allclose(returns_std, kept.std(), rtol=1e-6)  # sqrt(4.25)
    direction = (5 - 0) * es.pair_noise(KEY, 1, 4) + (1 - 4) * es.pair_noise(KEY, 0, 4)
    np.testing.assert_allclose(step, step_size / (2 * np.sqrt(4.25)) * direction, rtol=1e-5)

    strategy = es.make_ars(num_directions=3, top_directions=2, step_size=step_size, sigma=0.05)
    mean = jnp.arange(4.0)
    state, metrics = strategy.tell(strategy.init(mean), KEY, fitness)
    np.testing.assert_allclose(state.mean, mean + step, rtol=1e-6)
    np.testing.assert_allclose(metrics["returns_std"], np.sqrt(4.25), rtol=1e-6)


def test_ars_all_directions_is_v1():
    fitness = jnp.array([1.0, 4.0, 5.0, 0.0, 2.0, 2.0])
    step, _ = es.ars_step(KEY, fitness, 3, 1.0, 4)
    direction = sum(
        (fitness[2 * k] - fitness[2 * k + 1]) * es.pair_noise(KEY, k, 4) for k in range(3)
    )
    np.testing.assert_allclose(step, direction / (3 * np.std(np.asarray(fitness))), rtol=1e-5)


def test_ars_equal_returns_give_no_step():
    step, returns_std = es.ars_step(KEY, jnp.full((6,), 3.0), 2, 0.1, 4)
    assert float(returns_std) == 0.0
    np.testing.assert_array_equal(step, jnp.zeros(4))


def test_ars_maximises_a_quadratic():
    strategy = es.make_ars(num_directions=16, top_directions=8, step_size=0.02, sigma=0.02)
    state, metrics = run_generations(strategy, strategy.init(jnp.zeros(10)), KEY, 300)
    assert float(jnp.max(jnp.abs(state.mean - TARGET))) < 0.05
    assert float(metrics["fitness_mean"][-1]) > -0.2 > float(metrics["fitness_mean"][0])


# ---------------------------------------------------------------- observation normaliser


def test_observation_stats_merge_and_reduce_match_numpy():
    obs = jax.random.normal(KEY, (60, 3)) * jnp.array([1.0, 5.0, 0.1]) + jnp.array([2.0, -1.0, 0.0])
    whole = es.observation_stats(obs)
    np.testing.assert_allclose(whole.count, 60)
    np.testing.assert_allclose(whole.mean, np.mean(obs, 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(whole.sum_squared_deviations / 60, np.var(obs, 0), rtol=1e-4)

    merged = es.merge_stats(es.observation_stats(obs[:10]), es.observation_stats(obs[10:]))
    stacked = jax.vmap(es.observation_stats)(obs.reshape(6, 10, 3))
    from_nothing = es.merge_stats(es.init_running_stats(3), whole)
    for stats in (merged, es.reduce_stats(stacked), from_nothing):
        for actual, expected in zip(stats, whole):
            np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)


def test_observation_stats_mask_drops_rows():
    obs = jnp.array([[1.0], [3.0], [100.0]])
    stats = es.observation_stats(obs, mask=jnp.array([1.0, 1.0, 0.0]))
    np.testing.assert_allclose(
        [stats.count, stats.mean[0], stats.sum_squared_deviations[0]], [2.0, 2.0, 2.0]
    )


def test_normalize_whitens_and_zeroes_constant_coordinates():
    obs = jnp.stack([jnp.arange(10.0) * 3 + 1, jnp.full((10,), 4.0)], axis=1)
    # Before any observation is recorded, normalisation is the identity.
    np.testing.assert_array_equal(es.ars_normalize(es.init_running_stats(2), obs), obs)
    normalized = es.ars_normalize(es.observation_stats(obs), obs)
    np.testing.assert_allclose(normalized[:, 0].mean(), 0.0, atol=1e-5)
    np.testing.assert_allclose(normalized[:, 0].std(), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(normalized[:, 1], np.zeros(10))


# ---------------------------------------------------------------- user errors


@pytest.mark.parametrize(
    "make",
    [
        lambda: es.make_openai_es(7, 0.1, optax.sgd(0.1)),
        lambda: es.make_openai_es(8, 0.0, optax.sgd(0.1)),
        lambda: es.make_openai_es(8, 0.1, optax.sgd(0.1), weight_decay=-1.0),
        lambda: es.make_ars(4, 5, 0.1, 0.1),
        lambda: es.make_ars(4, 2, 0.1, -0.1),
    ],
)
def test_bad_settings_raise_one_line_errors(make):
    with pytest.raises(PodracerError) as error:
        make()
    assert "\n" not in str(error.value)
