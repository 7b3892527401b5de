import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from podracer import ppo
from podracer.distributions import Categorical, DiagGaussian
from podracer.networks import make_network


def table_apply(params, obs):
    """A 'network' whose outputs are its parameters: one row per sample."""
    return Categorical(params["logits"]), params["value"]


def test_loss_hand_computed():
    logits = np.log(np.array([[0.5, 0.5], [0.2, 0.8]], np.float32))
    params = {"logits": jnp.asarray(logits), "value": jnp.array([1.0, 0.0])}
    samples = ppo.Samples(
        obs=jnp.zeros((2, 1)), action=jnp.array([0, 1]),
        log_prob=jnp.log(jnp.array([0.25, 0.8])),  # behaviour probs: ratios 2.0 and 1.0
        value=jnp.array([0.5, 0.1]), advantage=jnp.array([1.0, -1.0]), target=jnp.array([2.0, 0.3]))
    config = ppo.PPOConfig(clip_eps=0.2, vf_coef=0.5, ent_coef=0.01, normalize_advantages=False)
    loss, m = ppo.ppo_loss(params, table_apply, samples, config)
    # Policy: sample 0 ratio 2 clipped to 1.2 (A>0): 1.2; sample 1 ratio 1: -1 -> mean .1, negated.
    assert float(m["policy_loss"]) == pytest.approx(-0.1, abs=1e-6)
    # Value, clipped: sample 0 v=1 vs vold=.5 -> clipped .7; max((1-2)^2, (.7-2)^2)=1.69;
    # sample 1 v=0 vs vold=.1 within eps -> (0-.3)^2=.09. 0.5*mean = 0.445.
    assert float(m["value_loss"]) == pytest.approx(0.445, abs=1e-6)
    entropy = -(2 * 0.5 * np.log(0.5) + 0.2 * np.log(0.2) + 0.8 * np.log(0.8)) / 2
    assert float(m["entropy"]) == pytest.approx(entropy, abs=1e-6)
    assert float(loss) == pytest.approx(-0.1 + 0.5 * 0.445 - 0.01 * entropy, abs=1e-6)
    assert float(m["clip_fraction"]) == pytest.approx(0.5)

    unclipped = ppo.PPOConfig(clip_value=False, normalize_advantages=False)
    _, m = ppo.ppo_loss(params, table_apply, samples, unclipped)
    assert float(m["value_loss"]) == pytest.approx(0.5 * (1.0 + 0.09) / 2, abs=1e-6)


def test_advantage_normalisation_in_loss():
    params = {"logits": jnp.zeros((4, 2)), "value": jnp.zeros(4)}
    samples = ppo.Samples(jnp.zeros((4, 1)), jnp.zeros(4, jnp.int32), jnp.log(jnp.full(4, 0.5)),
                          jnp.zeros(4), jnp.array([1.0, 2.0, 3.0, 4.0]), jnp.zeros(4))
    _, m = ppo.ppo_loss(params, table_apply, samples, ppo.PPOConfig(normalize_advantages=True))
    # Ratios are all 1, so the policy loss is minus the mean normalised advantage: 0.
    assert float(m["policy_loss"]) == pytest.approx(0.0, abs=1e-6)


def _one_sample_policy_loss(pi, mu, advantage, clip_eps=0.2):
    """The policy loss of one sample whose action has probability `pi` now and `mu` when taken."""
    params = {"logits": jnp.log(jnp.array([[pi, 1.0 - pi]])), "value": jnp.zeros(1)}
    samples = ppo.Samples(jnp.zeros((1, 1)), jnp.array([0]), jnp.log(jnp.array([mu])), jnp.zeros(1),
                          jnp.array([advantage]), jnp.zeros(1))
    config = ppo.PPOConfig(clip_eps=clip_eps, normalize_advantages=False)
    loss, metrics = ppo.ppo_loss(params, table_apply, samples, config)
    grad = jax.grad(lambda p: ppo.ppo_loss(p, table_apply, samples, config)[1]["policy_loss"])(params)
    return float(metrics["policy_loss"]), float(jnp.abs(grad["logits"]).max())


@pytest.mark.parametrize("pi,mu,advantage,expected,clipped", [
    # ratio 1.5, A > 0: min(1.5, 1.2) = 1.2, the upper bound holds it (no gradient).
    (0.6, 0.4, 1.0, -1.2, True),
    # ratio 0.5, A > 0: min(0.5, 0.8) = 0.5, below the lower bound the unclipped term wins.
    (0.3, 0.6, 1.0, -0.5, False),
    # ratio 0.5, A < 0: min(-0.5, -0.8) = -0.8, the lower bound holds it (no gradient).
    (0.3, 0.6, -1.0, 0.8, True),
    # ratio 1.5, A < 0: min(-1.5, -1.2) = -1.5, above the upper bound the unclipped term wins.
    (0.6, 0.4, -1.0, 1.5, False),
    # ratio 1.1, inside [0.8, 1.2]: the ratio itself, either sign.
    (0.55, 0.5, 2.0, -2.2, False),
    (0.55, 0.5, -2.0, 2.2, False),
])
def test_policy_clip_each_side_and_sign(pi, mu, advantage, expected, clipped):
    loss, grad = _one_sample_policy_loss(pi, mu, advantage)
    assert loss == pytest.approx(expected, abs=1e-5)
    assert (grad == 0.0) == clipped, grad


@pytest.mark.parametrize("value,old,target,expected", [
    # The clipped value (old + 0.2) is further from the target: its error counts.
    (1.0, 0.5, 2.0, (0.7 - 2.0) ** 2),
    # The clipped value is nearer the target: the unclipped error counts.
    (1.0, 0.5, 0.0, 1.0),
    # Moved down past the bound (old - 0.2 = 0.3): the same two cases.
    (0.0, 0.5, -1.0, (0.3 + 1.0) ** 2),
    (0.0, 0.5, 2.0, 4.0),
    # Within the bound: no clipping.
    (0.6, 0.5, 2.0, (0.6 - 2.0) ** 2),
])
def test_value_clip_each_side(value, old, target, expected):
    params = {"logits": jnp.zeros((1, 2)), "value": jnp.array([value])}
    samples = ppo.Samples(jnp.zeros((1, 1)), jnp.array([0]), jnp.log(jnp.array([0.5])), jnp.array([old]),
                          jnp.zeros(1), jnp.array([target]))
    _, m = ppo.ppo_loss(params, table_apply, samples, ppo.PPOConfig(clip_eps=0.2, normalize_advantages=False))
    assert float(m["value_loss"]) == pytest.approx(0.5 * expected, abs=1e-5)
    _, m = ppo.ppo_loss(params, table_apply, samples, ppo.PPOConfig(clip_value=False, normalize_advantages=False))
    assert float(m["value_loss"]) == pytest.approx(0.5 * (value - target) ** 2, abs=1e-5)


def test_advantage_normalisation_divides_by_the_std():
    advantage = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    # mean 2.5, std sqrt(1.25) = 1.118 (the variance, 1.25, would give other values).
    expected = (advantage - 2.5) / np.sqrt(1.25)
    np.testing.assert_allclose(ppo.normalize_advantages(jnp.asarray(advantage)), expected, rtol=1e-5)
    # And inside the loss: ratio 1.1 on the last sample only (inside the clip), so the
    # policy loss is -mean(ratio * normalised advantage) = -0.1 * expected[3] / 4.
    logits = np.log(np.array([[0.5, 0.5]] * 3 + [[0.55, 0.45]], np.float32))
    params = {"logits": jnp.asarray(logits), "value": jnp.zeros(4)}
    samples = ppo.Samples(jnp.zeros((4, 1)), jnp.zeros(4, jnp.int32), jnp.log(jnp.full(4, 0.5)),
                          jnp.zeros(4), jnp.asarray(advantage), jnp.zeros(4))
    _, m = ppo.ppo_loss(params, table_apply, samples, ppo.PPOConfig(normalize_advantages=True))
    assert float(m["policy_loss"]) == pytest.approx(-0.1 * expected[3] / 4, abs=1e-6)


def test_gaussian_log_prob_and_entropy():
    dist = DiagGaussian(jnp.array([[0.0, 1.0]]), jnp.log(jnp.array([[1.0, 2.0]])))
    action = jnp.array([[1.0, 1.0]])
    expected = (-0.5 * 1 - 0.5 * np.log(2 * np.pi)) + (-np.log(2.0) - 0.5 * np.log(2 * np.pi))
    assert float(dist.log_prob(action)[0]) == pytest.approx(expected, abs=1e-5)
    assert float(dist.entropy()[0]) == pytest.approx(
        0.5 * np.log(2 * np.pi * np.e) * 2 + np.log(2.0), abs=1e-5)


def _fixture(discrete=True, T=16, B=4, obs_dim=3, config=ppo.PPOConfig()):
    network = make_network((obs_dim,), 2, discrete)
    optimizer = optax.adam(3e-4)
    params = network.init(jax.random.PRNGKey(0), jnp.zeros((1, obs_dim)))
    state = ppo.init_train_state(params, optimizer, (obs_dim,))
    k = jax.random.split(jax.random.PRNGKey(1), 4)
    action = (jax.random.randint(k[1], (T, B), 0, 2) if discrete
              else jax.random.normal(k[1], (T, B, 2)))
    batch = ppo.Transition(
        obs=jax.random.normal(k[0], (T, B, obs_dim)), action=action,
        reward=jax.random.normal(k[2], (T, B)), terminated=jax.random.bernoulli(k[3], 0.1, (T, B)),
        truncated=jnp.zeros((T, B), bool), value=jnp.zeros((T, B)),
        log_prob=jnp.full((T, B), -0.7), final_value=jnp.zeros((T, B)))
    update = ppo.make_update(network.apply, optimizer, config)
    return update, state, batch, jnp.zeros(B)


@pytest.mark.parametrize("discrete", [True, False])
def test_update_is_pure_and_deterministic(discrete):
    update, state, batch, bootstrap = _fixture(discrete)
    update = jax.jit(update)
    before = jax.tree.map(np.array, state)
    key = jax.random.PRNGKey(7)
    s1, m1 = update(state, batch, bootstrap, key)
    s2, m2 = update(state, batch, bootstrap, key)
    # Inputs untouched, outputs identical bit for bit, and parameters actually moved.
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.array, state))
    jax.tree.map(np.testing.assert_array_equal, s1, s2)
    assert int(s1.step) == 1
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), s1.params, state.params)
    assert max(jax.tree.leaves(moved)) > 0
    # Another key shuffles differently, so it lands elsewhere.
    s3, _ = update(state, batch, bootstrap, jax.random.PRNGKey(8))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(s1.params),
                                                       jax.tree.leaves(s3.params)))


def test_update_does_not_recompile():
    update, state, batch, bootstrap = _fixture(config=ppo.PPOConfig(normalize_observations=True))
    update = jax.jit(update)
    state, _ = update(state, batch, bootstrap, jax.random.PRNGKey(0))
    assert update._cache_size() == 1
    state, _ = update(state, batch, bootstrap, jax.random.PRNGKey(1))
    assert update._cache_size() == 1


def test_observation_statistics_follow_the_batch():
    update, state, batch, bootstrap = _fixture(config=ppo.PPOConfig(normalize_observations=True))
    batch = batch._replace(obs=batch.obs * 3.0 + 5.0)
    state, _ = jax.jit(update)(state, batch, bootstrap, jax.random.PRNGKey(0))
    flat = np.asarray(batch.obs).reshape(-1, 3)
    np.testing.assert_allclose(state.obs_stats.mean, flat.mean(0), rtol=1e-5)
    np.testing.assert_allclose(state.obs_stats.sum_squared_deviations / state.obs_stats.count,
                               flat.var(0), rtol=1e-4)


@pytest.mark.parametrize("discrete", [True, False])
def test_noise_drawn_ahead_samples_what_the_key_samples(discrete):
    """Anakin draws a rollout's sampling noise before its loop: the actions must be
    exactly those the per-step keys would have drawn (and jax's own categorical)."""
    from podracer.distributions import sampling_noise

    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    shape = (16, 3)
    dist = (Categorical(jax.random.normal(k1, shape)) if discrete else
            DiagGaussian(jax.random.normal(k1, shape), jnp.full(shape, -0.5)))
    keys = jax.random.split(k2, shape[0])
    by_key = jax.vmap(lambda d, k: d.sample(k))(dist, keys)
    noise = jax.vmap(lambda k: sampling_noise(k, discrete, shape[1]))(keys)
    np.testing.assert_array_equal(dist.sample_from_noise(noise), by_key)
    if discrete:
        np.testing.assert_array_equal(by_key, jax.vmap(jax.random.categorical)(keys, dist.logits))
        assert len(np.unique(by_key)) > 1

    network = make_network((4,), shape[1], discrete)
    params = network.init(k1, jnp.zeros((1, 4)))
    obs = jax.random.normal(k2, (shape[0], 4))
    stats = ppo.init_train_state(params, optax.adam(1e-3), (4,)).obs_stats
    with_keys = ppo.make_act(network.apply, ppo.PPOConfig())(params, stats, obs, keys)
    with_noise = ppo.make_act(network.apply, ppo.PPOConfig(), presampled=True)(params, stats, obs, noise)
    for a, b in zip(with_keys, with_noise):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("n", [1, 2, 7, 128, 1000, 70_000])
def test_random_permutation_is_a_permutation(n):
    perm = np.asarray(ppo.random_permutation(jax.random.PRNGKey(n), n))
    np.testing.assert_array_equal(np.sort(perm), np.arange(n))
    if n >= 7:
        assert (perm != np.arange(n)).mean() > 0.5  # actually shuffled


def test_random_permutation_is_uniform():
    """Every ordering of 4 items about equally often over 24,000 keys (chi-square,
    23 degrees of freedom: 49.7 is the 0.1% tail); a sort that kept the index order
    on ties, or drew too few random bits, would be far off."""
    perms = jax.vmap(lambda k: ppo.random_permutation(k, 4))(jax.random.split(jax.random.PRNGKey(0), 24_000))
    codes = np.asarray(perms) @ np.array([64, 16, 4, 1])
    _, counts = np.unique(codes, return_counts=True)
    assert len(counts) == 24
    chi2 = ((counts - 1000) ** 2 / 1000).sum()
    assert chi2 < 49.7, chi2
    # Where item 0 lands among 128, over 2,000 permutations: uniform has mean 63.5, std 37.
    perms = jax.vmap(lambda k: ppo.random_permutation(k, 128))(jax.random.split(jax.random.PRNGKey(1), 2_000))
    first = np.argmax(np.asarray(perms) == 0, axis=1)
    assert abs(first.mean() - 63.5) < 3.0 and first.std() > 30
