"""One update, two architectures: the Sebulba learner path gives Anakin's result on the same batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from podracer.envs.jax_envs import make_env
from podracer.agent import fixed_agent
from podracer.anakin.loop import AnakinConfig, Experience, make_programs
from podracer.protocol import parallel
from podracer.networks import init_params, make_network
from podracer.ppo import PPOConfig, Transition, init_train_state, make_agent, make_update
from podracer.sebulba.learner import make_learner_step


def _batch(num_steps=16, num_envs=24, seed=0):
    rng = np.random.default_rng(seed)
    shape = (num_steps, num_envs)
    done = rng.random(shape) < 0.1
    truncated = done & (rng.random(shape) < 0.5)
    batch = Transition(
        obs=rng.normal(size=(*shape, 4)).astype(np.float32),
        action=rng.integers(0, 2, shape).astype(np.int32),
        reward=rng.normal(size=shape).astype(np.float32),
        terminated=done & ~truncated,
        truncated=truncated,
        value=rng.normal(size=shape).astype(np.float32),
        log_prob=np.full(shape, np.log(0.5), np.float32) + 0.1 * rng.normal(size=shape).astype(np.float32),
        final_value=rng.normal(size=shape).astype(np.float32))
    return batch, rng.normal(size=num_envs).astype(np.float32)


NETWORK = make_network((4,), 2, True)
OPTIMIZER = optax.sgd(1e-2)  # Adam would magnify summation-order rounding in tiny gradients
CONFIG = PPOConfig(normalize_observations=True)


@pytest.fixture(scope="module")
def learner():
    """The Sebulba learner on devices 1..3 (device 0 would be the actor's), compiled once per shape."""
    mesh = parallel.make_mesh(jax.devices()[1:4])
    return mesh, make_learner_step(NETWORK.apply, OPTIMIZER, CONFIG, mesh)


def _state():
    return init_train_state(init_params(NETWORK, (4,), jnp.float32, jax.random.PRNGKey(1)), OPTIMIZER, (4,))


def test_sebulba_learner_matches_anakin_and_single_device_updates(learner):
    assert len(jax.devices()) == 8
    network, optimizer, config, state = NETWORK, OPTIMIZER, CONFIG, _state()
    batch, bootstrap = _batch()
    key = jax.random.PRNGKey(7)

    # Anakin's own learning program over every device: the update step of `make_programs`'
    # fused program, compiled on its own as profile mode runs it (test_profile shows the
    # two give the same run).
    num_steps, num_envs = batch.reward.shape
    env = make_env("CartPole-v1")
    anakin_learn = make_programs(env, fixed_agent(make_agent, network, optimizer, config, env.spec, num_steps),
                                 AnakinConfig(num_envs=num_envs, rollout_len=num_steps), parallel.make_mesh()).learn
    episodes = {"episodes": np.int32(5), "episode_return_sum": np.float32(60.0),
                "episode_length_sum": np.int32(60)}
    anakin_state, anakin_metrics = anakin_learn(state, Experience(batch, bootstrap, key, episodes))
    assert {d.id for d in jax.tree.leaves(anakin_state.params)[0].devices()} == set(range(8))
    assert bool(anakin_metrics["params_finite"]) and int(anakin_metrics["episodes"]) == 5

    # Sebulba's: an actor on device 0 ships the batch to learners 1..3.
    mesh, learner = learner
    shipped = jax.device_put(batch, parallel.time_major_sharded(mesh))
    shipped_bootstrap = jax.device_put(bootstrap, parallel.sharded(mesh))
    assert shipped.obs.addressable_shards[0].data.shape == (16, 8, 4)
    sebulba_state, sebulba_metrics = learner(jax.device_put(state, parallel.replicated(mesh)),
                                             (shipped,), (shipped_bootstrap,), key)
    assert {d.id for d in jax.tree.leaves(sebulba_state.params)[0].devices()} == {1, 2, 3}

    # A user's own loop on one device.
    single_state, single_metrics = jax.jit(make_update(network.apply, optimizer, config))(
        state, batch, bootstrap, key)

    moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), single_state.params,
                         state.params)
    assert max(jax.tree.leaves(moved)) > 1e-4  # the update did something
    for other in (anakin_state, sebulba_state):
        for a, b in zip(jax.tree.leaves(jax.device_get(other)), jax.tree.leaves(jax.device_get(single_state))):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    for name in single_metrics:
        np.testing.assert_allclose(anakin_metrics[name], single_metrics[name], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(sebulba_metrics[name], single_metrics[name], rtol=1e-4, atol=1e-6)


def test_learner_joins_trajectories_of_several_actor_threads(learner):
    mesh, learner = learner
    state = _state()
    parts = [_batch(num_envs=12, seed=s) for s in (1, 2)]
    shipped = [jax.device_put(b, parallel.time_major_sharded(mesh)) for b, _ in parts]
    bootstraps = [jax.device_put(v, parallel.sharded(mesh)) for _, v in parts]
    joined_state, _ = learner(jax.device_put(state, parallel.replicated(mesh)), tuple(shipped),
                              tuple(bootstraps), jax.random.PRNGKey(3))
    # Each learner device holds 4 environments of each thread; a single device
    # sees the same 24 columns in the order device 1 (4 + 4), device 2, device 3.
    order = np.concatenate([np.r_[np.arange(d * 4, d * 4 + 4), 12 + np.arange(d * 4, d * 4 + 4)]
                            for d in range(3)])
    both = jax.tree.map(lambda a, b: np.concatenate([a, b], axis=1), parts[0][0], parts[1][0])
    reordered = jax.tree.map(lambda x: x[:, order], both)
    bootstrap = np.concatenate([parts[0][1], parts[1][1]])[order]
    reference, _ = learner(jax.device_put(state, parallel.replicated(mesh)),
                           (jax.device_put(reordered, parallel.time_major_sharded(mesh)),),
                           (jax.device_put(bootstrap, parallel.sharded(mesh)),), jax.random.PRNGKey(3))
    for a, b in zip(jax.tree.leaves(jax.device_get(joined_state)), jax.tree.leaves(jax.device_get(reference))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
