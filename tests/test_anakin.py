import json
import os
import subprocess

import jax
import numpy as np
import optax
import pytest

from conftest import LAUNCHER, PYTHON
from podracer.protocol import parallel
from podracer.envs.jax_envs import make_env
from podracer.agent import fixed_agent
from podracer.anakin.loop import AnakinConfig, _pack_rows, make_programs
from podracer.ppo import make_agent
from podracer.networks import make_network
from podracer.ppo import PPOConfig


def _run_anakin(devices, env_id="CartPole-v1", ppo_config=PPOConfig(normalize_observations=True),
                calls=2):
    env = make_env(env_id)
    network = make_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete)
    config = AnakinConfig(num_envs=8, rollout_len=16, updates_per_call=3)
    # Plain SGD: Adam divides by the gradient's scale, which turns summation-order
    # rounding in near-zero gradients into visible parameter differences.
    init, train, _, _ = make_programs(env, fixed_agent(make_agent, network, optax.sgd(1e-2), ppo_config, env.spec,
                                                      config.rollout_len), config, parallel.make_mesh(devices))
    runner = init(jax.random.PRNGKey(42))
    for _ in range(calls):
        runner, metrics = train(runner)
    return jax.device_get(runner), jax.device_get(metrics), train


# Navix: a suite, which Anakin runs without shard_map's replication check (suites.base.SuiteEnv).
@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1", "navix:Navix-Empty-5x5-v0"])
def test_one_device_matches_eight(env_id):
    if ":" in env_id:
        pytest.importorskip(env_id.split(":")[0])
    assert len(jax.devices()) == 8
    one, m1, _ = _run_anakin(jax.devices()[:1], env_id)
    eight, m8, _ = _run_anakin(jax.devices(), env_id)
    assert int(one.train.step) == int(eight.train.step) == 6
    for a, b in zip(jax.tree.leaves(one.train.params), jax.tree.leaves(eight.train.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # Environment dynamics (Pendulum) amplify float rounding a little more.
    np.testing.assert_allclose(one.obs, eight.obs, rtol=1e-3, atol=1e-4)
    np.testing.assert_array_equal(m1["episodes"], m8["episodes"])
    np.testing.assert_allclose(m1["loss"], m8["loss"], rtol=1e-3, atol=1e-5)


def _cartpole_returns(lr, calls=6):
    """Mean return of the episodes that ended in each `train` call, on two devices."""
    env = make_env("CartPole-v1")
    network = make_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete)
    config = AnakinConfig(num_envs=32, rollout_len=32, updates_per_call=8)
    optimizer = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(lr))
    init, train, _, _ = make_programs(env, fixed_agent(make_agent, network, optimizer, PPOConfig(), env.spec,
                                                      config.rollout_len), config, parallel.make_mesh(jax.devices()[:2]))
    runner = init(jax.random.PRNGKey(42))
    returns = []
    for _ in range(calls):
        runner, metrics = train(runner)
        metrics = jax.device_get(metrics)
        assert np.all(np.isfinite(metrics["loss"]))
        returns.append(float(metrics["episode_return_sum"].sum() / metrics["episodes"].sum()))
    return returns, train


def test_train_call_does_not_recompile_and_learns_where_a_zero_learning_rate_cannot():
    # 48 updates of 1,024 steps: a random CartPole policy averages about 22.
    returns, train = _cartpole_returns(1e-3)
    assert train._cache_size() == 1
    # Judged on the last call (about 260 here): a run that learned and then collapsed fails.
    assert returns[-1] >= 150, returns
    assert returns[0] < 50, returns  # it learned: the first call's episodes were near random
    # The same run (seed, rollouts, optimizer) with a learning rate of zero: an
    # update that changes nothing must not reach the threshold.
    control, _ = _cartpole_returns(0.0)
    assert max(control) < 50, control


def _launch(*args, timeout=120):
    return subprocess.run([PYTHON, LAUNCHER, *args], capture_output=True, text=True,
                          timeout=timeout)


def test_packed_rows_unpack_to_the_same_tree():
    """The rollout's carry packing: one array per dtype, every leaf back bit for bit."""
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    tree = {"obs": jax.random.normal(key, (3, 2, 4)), "time": jnp.arange(3, dtype=jnp.int32),
            "done": jnp.array([True, False, True]), "ret": jnp.array([1.5, -2.0, jnp.nan]),
            "len": jnp.array([7, 8, 9], jnp.int32)}
    packed, unpack = _pack_rows(tree)
    assert sorted((a.dtype.name, a.shape) for a in packed) == [
        ("bool", (3, 1)), ("float32", (3, 9)), ("int32", (3, 2))]
    back = jax.jit(unpack)(packed)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def test_default_run_solves_cartpole(tmp_path):
    # The README's main command, on its defaults (one CPU device).
    run_dir = tmp_path / "run"
    result = _launch("--arch=anakin", "--algo=ppo", f"--run-dir={run_dir}")
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["episode_return_mean"] >= 475
    assert summary["env_steps"] >= 500_000
    for key in ("env_steps", "sps", "episode_return_mean", "wall_s"):
        assert key in summary
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) > 5
    assert all({"env_steps", "sps", "episode_return_mean"} <= row.keys() for row in rows)
    steps = [row["env_steps"] for row in rows]
    assert steps == sorted(steps) and steps[-1] == summary["env_steps"]
    # Learning, not luck: the first interval is far below the last.
    assert rows[0]["episode_return_mean"] < 100


def test_broken_update_cannot_reach_the_threshold(tmp_path):
    # A learning rate of zero is an update that changes nothing: same command, no learning.
    run_dir = tmp_path / "run"
    result = _launch(f"--run-dir={run_dir}", "--lr=0", "--total-steps=100000")
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["episode_return_mean"] < 100


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1", "MountainCar-v0", "DeepSea-bsuite"])
def test_step_with_draws_ahead_matches_gymnax(env_id):
    """`step_with(draw(key), ...)` (what Anakin's rollout runs, randomness drawn ahead)
    must be gymnax's own auto-resetting `step(key, ...)`, bit for bit, resets included.
    DeepSea overrides gymnax's step and keeps its own."""
    env = make_env(env_id)
    inner_env, params = env.env, env.params
    key = jax.random.PRNGKey(0)
    state, timestep = env.reset(key)
    _, inner = inner_env.reset(key, params)

    def random_action(k):
        if env.spec.discrete:
            return jax.random.randint(k, (), 0, env.spec.action_dim)
        return jax.random.uniform(k, (env.spec.action_dim,), minval=-2.0, maxval=2.0)

    @jax.jit
    def both(state, inner, key):
        step_key, action_key = jax.random.split(key)
        action = random_action(action_key)
        state, ts = env.step_with(env.draw(step_key), state, action)
        obs, inner, reward, terminated, truncated, info = inner_env.step(
            step_key, inner, env._env_action(action), params)
        return state, inner, ts, (obs, reward, terminated, truncated, info["final_observation"])

    resets = 0
    for i in range(600):
        state, inner, ts, (obs, reward, terminated, truncated, final_obs) = both(state, inner, jax.random.fold_in(key, i))
        np.testing.assert_array_equal(ts.obs, np.asarray(obs, ts.obs.dtype))
        np.testing.assert_array_equal(ts.final_obs, np.asarray(final_obs, ts.obs.dtype))
        np.testing.assert_array_equal(ts.reward, reward)
        assert bool(ts.terminated) == bool(terminated)
        assert bool(ts.truncated) == bool(truncated and not terminated)
        # The whole environment state, not just what it shows: DeepSea's own step keeps
        # counters across resets that a re-implemented step would drop.
        for ours, theirs in zip(jax.tree.leaves(state.inner), jax.tree.leaves(inner)):
            np.testing.assert_array_equal(ours, theirs)
        resets += bool(terminated or truncated)
    assert resets > 0
