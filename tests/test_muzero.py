"""MuZero's maths and search against hand values and mctx; its program on 1 and 4 devices."""

import jax
import jax.numpy as jnp
import mctx
import numpy as np
import optax
import pytest

from podracer import muzero
from podracer.envs.jax_envs import make_env
from podracer.anakin.loop import AnakinConfig, make_programs
from podracer.envs.spec import EnvSpec
from podracer.muzero.targets import support_limit, support_needed
from podracer.protocol import parallel


def test_the_value_transform_and_its_inverse_match_hand_values():
    x = jnp.array([0.0, 3.0, -8.0, 99.0])
    # h(x) = sign(x)(sqrt(|x| + 1) - 1) + 0.001 x
    expected = np.array([0.0, 2.0 - 1.0 + 0.003, -(3.0 - 1.0) - 0.008, 10.0 - 1.0 + 0.099])
    np.testing.assert_allclose(muzero.value_transform(x), expected, rtol=1e-6)
    np.testing.assert_allclose(muzero.inverse_value_transform(jnp.asarray(expected)), x, atol=1e-3)
    assert support_limit(2) == pytest.approx(float(muzero.inverse_value_transform(jnp.float32(2.0))), rel=1e-4)
    assert support_needed(99.0) == 10 and support_limit(10) >= 99.0 > support_limit(9)


def test_the_two_hot_projection_splits_a_value_between_its_two_nearest_atoms():
    # Atoms -2..2.
    np.testing.assert_allclose(muzero.two_hot(jnp.float32(1.25), 2), [0, 0, 0, 0.75, 0.25])
    np.testing.assert_allclose(muzero.two_hot(jnp.float32(-0.5), 2), [0, 0.5, 0.5, 0, 0])
    np.testing.assert_allclose(muzero.two_hot(jnp.float32(2.0), 2), [0, 0, 0, 0, 1])
    np.testing.assert_allclose(muzero.two_hot(jnp.float32(7.0), 2), [0, 0, 0, 0, 1])  # clipped
    np.testing.assert_allclose(muzero.two_hot(jnp.float32(-9.0), 2), [1, 0, 0, 0, 0])
    # A scalar goes through h first (h(3) = 1.003), and reads back through h^-1.
    np.testing.assert_allclose(muzero.scalar_to_support(jnp.float32(3.0), 2), [0, 0, 0, 0.997, 0.003],
                               atol=1e-6)
    values = jnp.array([3.0, -0.4, 12.0])
    logits = jnp.log(muzero.scalar_to_support(values, 4) + 1e-30)
    np.testing.assert_allclose(muzero.support_to_scalar(logits, 4), values, rtol=1e-4)


@pytest.mark.parametrize("terminated, truncated, expected", [
    # Termination at row 2: z0 = 1 + .5*2 + .25*v2; z1 = 2 + .5*3; z2 = 3.
    ([0, 0, 1, 0, 0], [0, 0, 0, 0, 0], [1 + 1 + 0.25 * 30, 2 + 1.5, 3]),
    # Truncation at row 1: bootstrap from the value of its final observation (200).
    ([0, 0, 0, 0, 0], [0, 1, 0, 0, 0], [1 + 1 + 0.25 * 200, 2 + 0.5 * 200, 3 + 2 + 0.25 * 50]),
])
def test_n_step_targets_match_hand_values(terminated, truncated, expected):
    reward = jnp.array([1.0, 2, 3, 4, 5])
    value, final_value = reward * 10, reward * 100
    z = muzero.n_step_targets(reward, jnp.array(terminated, bool), jnp.array(truncated, bool), value,
                              final_value, 0.5, 2, 3)
    np.testing.assert_allclose(z, expected, rtol=1e-6)


CONFIG = muzero.MuZeroConfig(num_simulations=4, gamma=0.9, support_size=5, unroll_steps=3, td_steps=2,
                             sequence_len=6, latent_size=8, batch_size=8, buffer_size=64, learning_starts=0)
NETWORK = muzero.MuZeroNetwork(action_dim=3, hidden=(16,))


def _perturbed_state(agent, seed=0):
    """An initial state with every parameter moved: priors, values and rewards far from uniform and 0."""
    state = agent.init(jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(state.params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    noisy = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return state._replace(params=jax.tree.unflatten(treedef, noisy))


_Spec = EnvSpec(obs_shape=(4,), obs_dtype=jnp.float32, action_dim=3, discrete=True, action_low=None,
                action_high=None)


def test_the_policy_target_is_mctx_gumbel_muzero_policy_of_each_observation():
    agent = muzero.make_agent(NETWORK, optax.adam(1e-3), CONFIG, _Spec, 4, num_envs=4)
    state = _perturbed_state(agent)
    obs = jax.random.normal(jax.random.key(2), (4, 4))
    keys = jax.random.split(jax.random.key(3), 4)
    act = jax.jit(agent.act)
    action, _, weights = act(state, obs, keys, ())
    # The search is its own named scope in the compiled program (and so in a profile's trace).
    assert "search" in act.lower(state, obs, keys, ()).compile().as_text()

    # mctx called directly on the same model, one search per observation with that observation's key.
    model = NETWORK.clone(latent_size=8, support_size=5)
    scalar = lambda logits: muzero.support_to_scalar(logits, 5)

    def recurrent_fn(params, key, a, s):
        s, reward, prior, value = model.apply(params, s, a, method="recurrent")
        return mctx.RecurrentFnOutput(reward=scalar(reward), discount=jnp.full(a.shape, 0.9),
                                      prior_logits=prior, value=scalar(value)), s

    for i in range(4):
        s, prior, value = model.apply(state.params, obs[i:i + 1], method="initial")
        root = mctx.RootFnOutput(prior_logits=prior, value=scalar(value), embedding=s)
        out = mctx.gumbel_muzero_policy(state.params, keys[i], root, recurrent_fn, num_simulations=4)
        np.testing.assert_allclose(weights[i], out.action_weights[0], rtol=1e-5, atol=1e-6)
        assert int(action[i]) == int(out.action[0])
        # The search improved the prior: the target is not the network's own policy.
        assert np.abs(np.asarray(weights[i]) - np.asarray(jax.nn.softmax(prior[0]))).max() > 1e-3


def _sequences(seed=0, terminated_at=1):
    n, length = 8, CONFIG.sequence_len
    keys = jax.random.split(jax.random.key(seed), 4)
    terminated = jnp.zeros((n, length), bool).at[:, terminated_at].set(True)
    return muzero.Sequences(
        obs=jax.random.normal(keys[0], (n, length, 4)), action=jax.random.randint(keys[1], (n, length), 0, 3),
        reward=jax.random.uniform(keys[2], (n, length)), terminated=terminated,
        truncated=jnp.zeros((n, length), bool), final_obs=jax.random.normal(keys[0], (n, length, 4)),
        policy=jax.nn.softmax(jax.random.normal(keys[3], (n, length, 3))))


def test_the_loss_ignores_every_row_after_the_episode_ends():
    agent = muzero.make_agent(NETWORK, optax.adam(1e-3), CONFIG, _Spec, 4, num_envs=4)
    state = _perturbed_state(agent)
    model = NETWORK.clone(latent_size=8, support_size=5)
    loss = jax.jit(lambda seq: muzero.muzero_loss(state.params, state.params, model, seq, CONFIG)[0])
    seq = _sequences(terminated_at=1)  # rows 0 and 1 are the episode's; row 1 ends it
    other = _sequences(seed=5)
    after = lambda a, b: jnp.concatenate([a[:, :2], b[:, 2:]], axis=1)
    mixed = jax.tree.map(after, seq, other)._replace(terminated=seq.terminated)
    np.testing.assert_allclose(loss(mixed), loss(seq), rtol=1e-6)
    # Row 1's reward is the episode's: it counts.
    assert abs(float(loss(seq._replace(reward=seq.reward.at[:, 1].add(3.0)))) - float(loss(seq))) > 1e-3


def _programs(num_devices):
    env = make_env("CartPole-v1")
    anakin = AnakinConfig(num_envs=8, rollout_len=4, updates_per_call=6)
    agent_for = lambda _h, axes: muzero.make_agent(
        muzero.MuZeroNetwork(env.spec.action_dim, (16,)), optax.adam(1e-2), CONFIG, env.spec, 4, axes,
        num_envs=8)
    return make_programs(env, agent_for, anakin, parallel.make_mesh(jax.devices()[:num_devices]))


def test_one_and_four_devices_train_the_same_agent():
    results = []
    for num_devices in (1, 4):
        programs = _programs(num_devices)
        runner, metrics = programs.train(programs.init(jax.random.key(0)))
        results.append((parallel.to_host(runner.train.params), parallel.to_host(metrics)))
    (one, m1), (four, m4) = results
    assert np.asarray(m1["learning"]).sum() >= 4  # the replay was ready for most of the updates
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5), one, four)
    np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-4)
    initial = parallel.to_host(_programs(1).init(jax.random.key(0)).train.params)
    moved = max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(initial)))
    assert moved > 1e-3  # the comparison is of trained parameters
