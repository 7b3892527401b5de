"""Anakin ES: gymnax rollouts of the whole population inside one jitted, sharded step."""

import json
import subprocess

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import LAUNCHER, PYTHON
from podracer import es
from podracer.protocol import parallel
from podracer.envs.jax_envs import make_env
from podracer.anakin.es import (_make_parts, make_anakin_es, make_episode_fn, make_fitness_fn,
                                 make_pair_episode_fn, make_pair_fitness_fn)
from podracer.errors import PodracerError
from podracer.networks import apply_antithetic, make_policy_network

SMALL = (16,)  # hidden widths: small policies compile and evaluate fast


def _anakin_es(env_id, config, devices, strategy=None):
    env = make_env(env_id)
    policy = make_policy_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete, SMALL)
    init, step = make_anakin_es(env, policy, config, parallel.make_mesh(devices), strategy)
    return init(jax.random.PRNGKey(3)), step


def _run(env_id, config, devices, calls, strategy=None):
    runner, step = _anakin_es(env_id, config, devices, strategy)
    history = []
    for _ in range(calls):
        runner, metrics = step(runner)
        history.append(jax.device_get(metrics))
    return jax.device_get(runner), history, step


# ---------------------------------------------------------------- episodes


def test_episode_return_stops_at_the_first_episode_end():
    # Always pushing right topples CartPole within a few dozen steps; the episode then
    # starts again and would keep paying +1 per step if the return were not masked.
    env = make_env("CartPole-v1")
    episode = make_episode_fn(env, lambda params, obs: jnp.int32(1), horizon=200, normalize=False)
    episode_return, seen = jax.jit(lambda key: episode(None, key, None))(jax.random.PRNGKey(0))
    assert seen == ()
    state, timestep = env.reset(jax.random.split(jax.random.PRNGKey(0))[0])
    step = jax.jit(lambda state: env.step(jax.random.PRNGKey(0), state, jnp.int32(1)))
    length = 0
    while not (timestep.terminated or timestep.truncated):
        state, timestep = step(state)
        length += 1
    assert 5 < length < 100
    assert float(episode_return) == length


def test_after_the_end_an_episode_starts_again_from_its_first_state():
    env = make_env("CartPole-v1")
    first_state, first = env.reset(jax.random.PRNGKey(1))
    key = jax.random.PRNGKey(2)
    # Before the end: exactly `step(key, ...)`.
    ours = env.step_with(env.draw_restarting(key, first.obs, first_state), first_state, jnp.int32(1))
    theirs = env.step(key, first_state, jnp.int32(1))
    jax.tree.map(np.testing.assert_array_equal, ours, theirs)
    # At the end: back to the first state, where `step` would draw a new one.
    state = first_state
    for _ in range(200):
        state, timestep = env.step_with(env.draw_restarting(key, first.obs, first_state), state,
                                        jnp.int32(1))
        if timestep.terminated:
            break
    assert bool(timestep.terminated)
    np.testing.assert_array_equal(timestep.obs, first.obs)
    jax.tree.map(np.testing.assert_array_equal, state.inner, first_state.inner)
    assert not np.array_equal(env.step(key, state, jnp.int32(1))[1].obs, first.obs)


@pytest.mark.parametrize("env_id, normalize, episodes", [("CartPole-v1", False, 1),
                                                         ("Pendulum-v1", True, 2)])
def test_a_pair_evaluates_as_its_two_members(env_id, normalize, episodes):
    """The pair path (both members acting together, sharing the mean's products)
    gives each member the fitness, and ARS V2 the statistics, of its own episodes."""
    env = make_env(env_id)
    policy = make_policy_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete, SMALL)
    flat, unravel = jax.flatten_util.ravel_pytree(policy.init(jax.random.PRNGKey(0), jnp.zeros(env.spec.obs_shape)))
    eps = jax.random.normal(jax.random.PRNGKey(3), flat.shape)
    stats = es.observation_stats(jax.random.normal(jax.random.PRNGKey(2), (50,) + env.spec.obs_shape))
    key, scale = jax.random.PRNGKey(3), 0.5
    fitness = make_fitness_fn(make_episode_fn(env, policy.apply, 80, normalize), unravel, episodes,
                              normalize)
    pair_act = lambda mean, noise, s, obs: apply_antithetic(policy, mean, noise, s, obs)
    pair_fitness = make_pair_fitness_fn(make_pair_episode_fn(env, pair_act, 80, normalize), unravel,
                                        episodes, normalize)
    pair, pair_seen = jax.jit(pair_fitness)(flat, scale, eps, key, stats)
    plus, plus_seen = jax.jit(fitness)(flat + scale * eps, key, stats)
    minus, minus_seen = jax.jit(fitness)(flat - scale * eps, key, stats)
    assert float(plus) != float(minus)  # two different members
    np.testing.assert_allclose(pair, [plus, minus], rtol=1e-4)
    if normalize:
        both = es.reduce_stats(jax.tree.map(lambda a, b: jnp.stack([a, b]), plus_seen, minus_seen))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4), pair_seen, both)
    else:
        assert pair_seen == ()
    # make_anakin_es takes this path for its MLP policy with low-rank noise.
    mesh = parallel.make_mesh(jax.devices()[:1])
    assert _make_parts(env, policy, es.ESConfig(population=4, low_rank=1), mesh, None).pair_fitness
    assert _make_parts(env, policy, es.ESConfig(population=4), mesh, None).pair_fitness is None


def test_normalized_episode_reports_only_the_observations_before_the_end():
    env = make_env("CartPole-v1")
    episode = make_episode_fn(env, lambda params, obs: jnp.int32(0), horizon=200, normalize=True)
    stats = es.init_running_stats(4)
    episode_return, seen = jax.jit(lambda key: episode(None, key, stats))(jax.random.PRNGKey(1))
    assert float(seen.count) == float(episode_return) > 0  # one observation per rewarded step


# ---------------------------------------------------------------- learning


def test_learns_cartpole_where_a_flipped_update_cannot():
    config = es.ESConfig(population=32, generations_per_call=4, eval_episodes=8)
    devices = jax.devices()[:1]
    runner, history, step = _run("CartPole-v1", config, devices, calls=8)
    returns = [float(m["mean_params_return"]) for m in history]
    assert returns[-1] >= 475, returns
    assert returns[0] < 475, returns  # it learned: the first mean did not already solve it
    assert float(history[-1]["fitness_mean"][-1]) > 300
    assert int(runner.strategy.generation) == 8 * 4
    assert step._cache_size() == 1  # later calls reuse the first compilation

    # The same loop with the update's sign flipped (minimising the return).
    honest = es.make_strategy(config)
    flipped = honest._replace(tell=lambda state, key, fitness: honest.tell(state, key, -fitness))
    _, broken, _ = _run("CartPole-v1", config, devices, calls=8, strategy=flipped)
    assert max(float(m["mean_params_return"]) for m in broken) < 100


def test_config_rejects_settings_that_cannot_work():
    with pytest.raises(ValueError, match="--sigma must be > 0"):
        es.ESConfig(sigma=0.0)
    with pytest.raises(ValueError, match="even"):
        es.ESConfig(population=7)
    with pytest.raises(ValueError, match="--variant must be one of"):
        es.ESConfig(variant="cma")
    with pytest.raises(ValueError, match="ARS variants only"):
        es.ESConfig(top_directions=4)
    with pytest.raises(ValueError, match="--low-rank applies to --variant=openai only"):
        es.ESConfig(variant="ars_v1", low_rank=1)
    with pytest.raises(PodracerError, match="population=12"):
        _anakin_es("CartPole-v1", es.ESConfig(population=12), jax.devices())


# ---------------------------------------------------------------- devices


@pytest.mark.parametrize("env_id, variant", [("Pendulum-v1", "openai"), ("CartPole-v1", "ars_v2")])
def test_same_step_on_1_and_8_devices(env_id, variant):
    assert len(jax.devices()) == 8
    config = es.ESConfig(variant=variant, population=16, horizon=100, episodes_per_member=2,
                         generations_per_call=3, eval_episodes=12, sigma=0.1, es_lr=0.05)
    one, m1, _ = _run(env_id, config, jax.devices()[:1], calls=2)
    eight, m8, _ = _run(env_id, config, jax.devices(), calls=2)
    assert int(one.strategy.generation) == int(eight.strategy.generation) == 6
    initial, _ = _anakin_es(env_id, config, jax.devices()[:1])
    assert not np.allclose(one.strategy.mean, initial.strategy.mean)  # not vacuous
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                 one.strategy, eight.strategy)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4),
                 one.obs_stats, eight.obs_stats)
    if variant == "ars_v2":
        assert float(eight.obs_stats.count) > 0
    for a, b in zip(m1, m8):
        np.testing.assert_allclose(a["fitness_mean"], b["fitness_mean"], rtol=1e-4)
        np.testing.assert_allclose(a["mean_params_return"], b["mean_params_return"], rtol=1e-4)


def test_low_rank_es_matches_on_1_and_8_devices_and_learns():
    config = es.ESConfig(population=16, horizon=200, generations_per_call=4, eval_episodes=8,
                         low_rank=1)
    one, m1, _ = _run("CartPole-v1", config, jax.devices()[:1], calls=2)
    eight, m8, _ = _run("CartPole-v1", config, jax.devices(), calls=2)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                 one.strategy, eight.strategy)
    for a, b in zip(m1, m8):
        np.testing.assert_allclose(a["fitness_mean"], b["fitness_mean"], rtol=1e-4)
    _, history, _ = _run("CartPole-v1", config, jax.devices()[:1], calls=6)
    assert history[0]["mean_params_return"] < 100 and history[-1]["mean_params_return"] >= 150


# ---------------------------------------------------------------- command line


def _launch(*args, timeout=120):
    return subprocess.run([PYTHON, LAUNCHER, *args], capture_output=True, text=True,
                          timeout=timeout)


def test_cli_run_writes_metrics_and_summary(tmp_path):
    run_dir = tmp_path / "run"
    result = _launch("--arch=anakin", "--algo=es", "--population=16", "--hidden", "16",
                     "--generations-per-call=2", "--total-steps=48000", f"--run-dir={run_dir}")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3  # 16 members x 500 steps x 2 generations = 16,000 steps per call
    for row in rows:
        assert {"env_steps", "sps", "episode_return_mean", "mean_params_return", "wall_s",
                "generations"} <= row.keys()
    assert [row["generations"] for row in rows] == [2, 4, 6]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["algo"] == "es" and summary["generations"] == 6
    assert summary["env_steps"] == rows[-1]["env_steps"] == 48_000
    for key in ("sps", "episode_return_mean", "mean_params_return", "wall_s"):
        assert summary[key] is not None

    # The same command with a larger budget resumes from the last checkpoint.
    result = _launch("--arch=anakin", "--algo=es", "--population=16", "--hidden", "16",
                     "--generations-per-call=2", "--total-steps=64000", f"--run-dir={run_dir}")
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_env_steps"] == 48_000 and summary["generations"] == 8
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["generations"] for row in rows] == [2, 4, 6, 8]


def test_cli_reports_a_bad_es_flag_in_one_line():
    result = _launch("--arch=anakin", "--algo=es", "--population=7")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--population must be even" in result.stderr
