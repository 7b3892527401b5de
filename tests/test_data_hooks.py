"""The dataset hooks of every (architecture, algorithm) pair: `record_policy` writes whole,
physically continuous episodes of the policy it is given (gymnax for Anakin, envpool for
Sebulba), and `warm_start_state` clones a dataset into a PPO train state on any sharding."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from podracer import data, es, ppo
from podracer.envs.jax_envs import make_env
from podracer.bc import BCConfig
from podracer.config import NetworkConfig
from podracer.data.train_hooks import (behaviour_clone, load_demonstrations, record_policy,
                                       warm_start_state)
from podracer.errors import PodracerError
from podracer.es.config import ESConfig
from podracer.networks import init_params, make_network, make_policy_network
from podracer.normalize import RunningStats
from podracer.orchestrate.cli import parse_configs
from podracer.protocol import parallel
from podracer.sebulba.envs import env_spec
from podracer.session.session import RunSession

NET = NetworkConfig(hidden=(8,))
# CartPole (gym's, which gymnax and envpool both port): termination bounds and dynamics.
X_LIMIT, THETA_LIMIT = 2.4, 12 * 2 * np.pi / 360
TIME_LIMIT = 500


def cartpole_next(obs: np.ndarray, action: np.ndarray) -> np.ndarray:
    """One Euler step of CartPole from observations [N, 4] (float64): gym's equations."""
    x, x_dot, theta, theta_dot = obs.astype(np.float64).T
    force = np.where(action == 1, 10.0, -10.0)
    cos, sin = np.cos(theta), np.sin(theta)
    temp = (force + 0.05 * theta_dot**2 * sin) / 1.1
    theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos**2 / 1.1))
    x_acc = temp - 0.05 * theta_acc * cos / 1.1
    return np.stack([x + 0.02 * x_dot, x_dot + 0.02 * x_acc, theta + 0.02 * theta_dot,
                     theta_dot + 0.02 * theta_acc], axis=1)


def check_cartpole_dataset(data_dir: str, episodes: int) -> data.EpisodeBatch:
    """Assert that `data_dir` holds `episodes` whole CartPole episodes in the RLDS layout.

    Each starts at a reset observation, every step follows from the one before it
    by CartPole's dynamics and the recorded action (so no reset step, no missing
    or shifted observation inside an episode, and the last step is the final
    observation), and each ends where CartPole ends it: out of bounds (terminal)
    or at the time limit (truncated).
    """
    batch = data.load_episodes(data_dir)
    steps, mask = batch.steps, batch.mask
    assert len(mask) == episodes
    lengths = mask.sum(axis=1) - 1  # transitions
    np.testing.assert_array_equal(batch.metadata["episode_length"], lengths)
    np.testing.assert_array_equal(batch.metadata["episode_id"], np.arange(episodes))
    np.testing.assert_allclose(batch.metadata["episode_return"], (steps["reward"] * mask).sum(axis=1))
    np.testing.assert_array_equal(steps["is_first"], mask & (np.arange(mask.shape[1]) == 0))
    is_last = mask & (np.arange(mask.shape[1]) == lengths[:, None])
    np.testing.assert_array_equal(steps["is_last"], is_last)
    assert steps["observation"].dtype == np.float32
    for n, length in enumerate(lengths):
        obs, action = steps["observation"][n, : length + 1], steps["action"][n, :length]
        assert np.abs(obs[0]).max() <= 0.05, obs[0]  # a reset observation
        acting = obs[:length]
        assert (np.abs(acting[:, 0]) <= X_LIMIT).all() and (np.abs(acting[:, 2]) <= THETA_LIMIT).all()
        np.testing.assert_allclose(cartpole_next(acting, action), obs[1:], rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(steps["reward"][n, :length], 1.0)
        final = obs[length]
        out = abs(final[0]) > X_LIMIT or abs(final[2]) > THETA_LIMIT
        terminal = steps["is_terminal"][n, : length + 1]
        assert terminal.sum() == out and terminal[length] == out, (n, length, final)
        assert out or length == TIME_LIMIT, (n, length, final)
        ends_terminal = (np.arange(length) == length - 1) & out
        np.testing.assert_array_equal(steps["discount"][n, :length], 1.0 - ends_terminal)
    return batch


def acting(batch: data.EpisodeBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Observations, actions and log-probabilities of every step whose action was taken."""
    where = batch.mask & ~batch.steps["is_last"]
    return tuple(batch.steps[field][where] for field in ("observation", "action", "policy_log_prob"))


def es_mean_and_stats(spec):
    """A search mean whose policy leans like `_controller` on what it sees, and ARS V2
    statistics that change what it sees."""
    policy = make_policy_network(spec.obs_shape, spec.action_dim, spec.discrete, NET.hidden,
                                 NET.activation)
    params = policy.init(jax.random.PRNGKey(0), jnp.zeros(spec.obs_shape))
    hidden, head = params["params"]["MLP_0"]["Dense_0"], params["params"]["Dense_0"]
    hidden["kernel"] = hidden["kernel"].at[:, 0].set(jnp.array([0.1, 0.1, 1.0, 1.0]))
    head["kernel"] = head["kernel"].at[0].set(jnp.array([-3.0, 3.0]))
    mean, unravel = ravel_pytree(params)
    stats = es.RunningStats(jnp.float32(100.0), jnp.array([0.0, 0.2, 0.07, -0.3]),
                            100.0 * jnp.array([0.3, 0.5, 0.01, 0.4]))
    return policy, unravel, mean, stats


def check_es_recording(tmp_path, arch: str, spec):
    """The mean of an ARS V2 search distribution, recorded on `arch`'s CartPole."""
    policy, unravel, mean, stats = es_mean_and_stats(spec)
    config = data.DataConfig(record_dataset=str(tmp_path / arch), record_episodes=6)
    recorded = record_policy(config, arch, "CartPole-v1",
                             data.es_policy(mean, stats, ESConfig(variant="ars_v2"), NET, spec), seed=1)
    batch = check_cartpole_dataset(str(tmp_path / arch), 6)
    terminal = batch.steps["is_terminal"].any(axis=1)
    assert terminal.any() and not terminal.all()  # dropped poles and time limits both
    assert recorded == {"dataset_dir": str(tmp_path / arch), "dataset_episodes": 6,
                        "dataset_return_mean": float(batch.metadata["episode_return"].mean())}
    meta = data.dataset_metadata(str(tmp_path / arch))
    assert (meta["env"], meta["policy"], meta["deterministic"]) == ("CartPole-v1", "es", True)
    obs, action, log_prob = acting(batch)
    # Deterministic: exactly the mean's action on the normalised observation; log-probability 0.
    params = unravel(mean)
    expected = jax.vmap(lambda o: policy.apply(params, o))(es.ars_normalize(stats, obs))
    np.testing.assert_array_equal(action, expected)
    np.testing.assert_array_equal(log_prob, 0.0)
    assert len(np.unique(action)) == 2
    raw = jax.vmap(lambda o: policy.apply(params, o))(obs)
    assert (raw != action).any()  # the statistics matter, so the test sees if they are dropped


def test_anakin_es_records_the_mean_deterministically(tmp_path):
    check_es_recording(tmp_path, "anakin", make_env("CartPole-v1").spec)


def test_sebulba_es_records_envpool_episodes_of_the_mean(tmp_path):
    check_es_recording(tmp_path, "sebulba", env_spec("CartPole-v1"))


def _ppo_state(spec, key: int, sharding=None):
    network = make_network(spec.obs_shape, spec.action_dim, spec.discrete, NET.hidden, NET.activation)
    params = init_params(network, spec.obs_shape, spec.obs_dtype, jax.random.PRNGKey(key))
    state = ppo.init_train_state(params, optax.adam(1e-3), spec.obs_shape)
    return network, jax.device_put(state, sharding) if sharding is not None else state


def test_sebulba_ppo_records_envpool_episodes(tmp_path):
    spec = env_spec("CartPole-v1")
    network, state = _ppo_state(spec, 2)
    # Sharper logits and statistics that matter: actions depend on the observation.
    state = state._replace(
        params=jax.tree.map(lambda p: 4.0 * p, state.params),
        obs_stats=RunningStats(jnp.float32(100.0), jnp.array([0.0, 0.1, 0.01, -0.1]),
                               100.0 * jnp.array([0.2, 0.5, 0.01, 0.3])))  # variances 0.2 .. 0.3
    config = ppo.PPOConfig(normalize_observations=True)
    for deterministic in (True, False):
        name = f"ppo-{deterministic}"
        # 20 episodes: two rounds of envpool environments (at most 16 at once).
        dc = data.DataConfig(record_dataset=str(tmp_path / name), record_episodes=20)
        policy = data.ppo_policy(state, network.apply, config, deterministic)
        recorded = record_policy(dc, "sebulba", "CartPole-v1", policy, seed=5)
        assert recorded["dataset_episodes"] == 20
        batch = check_cartpole_dataset(str(tmp_path / name), 20)
        assert data.dataset_metadata(str(tmp_path / name))["deterministic"] == deterministic
        obs, action, log_prob = acting(batch)
        dist, _ = network.apply(state.params, ppo.policy_inputs(obs, state.obs_stats, config))
        np.testing.assert_allclose(dist.log_prob(action), log_prob, rtol=1e-5, atol=1e-5)
        mode = np.asarray(dist.mode())
        if deterministic:
            np.testing.assert_array_equal(action, mode)
            assert len(np.unique(action)) == 2
        else:
            assert 0 < (action != mode).mean() < 0.5  # sampled


def _controller(params, obs, keys):
    """Push the cart towards where the pole is falling: ~460 on CartPole."""
    del params, keys
    return (obs[:, 2] + obs[:, 3] > 0).astype(jnp.int32), jnp.zeros(obs.shape[0])


def _greedy_agreement(network, state, config, obs, action) -> float:
    act = jax.jit(ppo.make_act(network.apply, config, deterministic=True))
    greedy = act(state.params, state.obs_stats, obs, jnp.zeros((len(obs), 2), jnp.uint32))[0]
    return float((np.asarray(greedy) == action).mean())


def test_sebulba_ppo_warm_start_clones_an_expert(tmp_path):
    spec = env_spec("CartPole-v1")
    expert = data.Policy(_controller, None, "controller", True)
    dc = data.DataConfig(record_dataset=str(tmp_path / "expert"), record_episodes=20,
                         init_from_dataset=str(tmp_path / "expert"), bc_steps=800, bc_lr=1e-2)
    recorded = record_policy(dc, "sebulba", "CartPole-v1", expert, seed=0)
    assert recorded["dataset_return_mean"] >= 400
    batch = check_cartpole_dataset(str(tmp_path / "expert"), 20)
    obs, action, _ = acting(batch)

    # The learner's state: replicated over a learner mesh of two devices.
    sharding = parallel.replicated(parallel.make_mesh(jax.devices()[2:4]))
    config = ppo.PPOConfig(normalize_observations=True)
    network, state = _ppo_state(spec, 0, sharding)
    cloned, summary = warm_start_state(state, dc, spec, "CartPole-v1", network, config, seed=0)
    assert summary["bc_demonstrations"] == len(action) and summary["bc_steps"] == 800
    for new, old in zip(jax.tree.leaves(cloned), jax.tree.leaves(state)):
        assert new.sharding == old.sharding and new.shape == old.shape
    np.testing.assert_allclose(cloned.obs_stats.mean, obs.mean(axis=0), rtol=1e-4, atol=1e-5)
    before = _greedy_agreement(network, state, config, obs, action)
    after = _greedy_agreement(network, cloned, config, obs, action)
    assert before < 0.8 and after > 0.9, (before, after)
    # Nothing to clone: the state is returned as it was.
    same, nothing = warm_start_state(state, data.DataConfig(), spec, "CartPole-v1", network, config, 0)
    assert same is state and nothing == {}


def test_anakin_ppo_hooks_are_the_old_code_paths(tmp_path):
    """Recording and warm start on Anakin give what the Anakin PPO driver's calls gave."""
    env = make_env("CartPole-v1")
    sharding = parallel.replicated(parallel.make_mesh(jax.devices()[:2]))
    network, state = _ppo_state(env.spec, 3, sharding)
    config = ppo.PPOConfig(normalize_observations=True)
    dc = data.DataConfig(record_dataset=str(tmp_path / "new"), record_episodes=5,
                         init_from_dataset=str(tmp_path / "new"), bc_steps=30, bc_batch_size=32)
    record_policy(dc, "anakin", "CartPole-v1", data.ppo_policy(state, network.apply, config), seed=7)
    # The old recording: one jitted chunk of `make_recorder` on the documented key.
    record = jax.jit(data.make_recorder(env, data.policy_act_fn(network.apply, config), 5))
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(7), 0xDA7A), 0)
    old = jax.device_get(record(parallel.to_host(state), key))
    width = int(old.mask.sum(axis=1).max())
    got = data.load_episodes(str(tmp_path / "new"))
    np.testing.assert_array_equal(got.mask, old.mask[:, :width])
    for field, value in got.steps.items():
        np.testing.assert_array_equal(value, np.asarray(old.steps[field])[:, :width], err_msg=field)

    # The old warm start: behaviour cloning from the initial params on the documented key.
    cloned, summary = warm_start_state(state, dc, env.spec, "CartPole-v1", network, config, seed=7)
    demos = load_demonstrations(str(tmp_path / "new"), env.spec, "CartPole-v1", config.gamma)
    old_state, metrics = behaviour_clone(
        network.apply, jax.device_get(state.params), demos,
        BCConfig(batch_size=32, value_coef=dc.bc_value_coef, normalize_observations=True), dc.bc_lr,
        30, jax.random.fold_in(jax.random.PRNGKey(7), 0xBC))
    expected = jax.tree.leaves((old_state.params, old_state.obs_stats))
    assert cloned.opt_state is state.opt_state and cloned.step is state.step
    for new, old in zip(jax.tree.leaves((cloned.params, cloned.obs_stats)), expected, strict=True):
        np.testing.assert_array_equal(new, old)
    assert summary["bc_log_likelihood"] == metrics["log_likelihood"]


def test_a_run_not_handed_the_dataset_hooks_refuses_a_dataset_flag(tmp_path):
    """The session imports nothing of `podracer.data`: without the hooks the command line hands
    it, a dataset flag is one line, before anything is written."""

    for flag in ("--record-dataset", "--init-from-dataset"):
        configs = parse_configs([f"--run-dir={tmp_path / 'run'}", f"{flag}={tmp_path / 'dataset'}"])
        with pytest.raises(PodracerError, match=flag):
            RunSession(configs)
    assert list(tmp_path.iterdir()) == []
