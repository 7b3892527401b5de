"""Anakin ES: the ES agent's generations on Anakin's one program, the mean parameters' evaluation, the command line."""

import json
import subprocess

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import LAUNCHER, PYTHON
from podracer import es
from podracer.agent import fixed_agent
from podracer.anakin.loop import AnakinConfig, make_programs
from podracer.anakin.train_es import make_mean_evaluation
from podracer.envs.jax_envs import make_env
from podracer.errors import PodracerError
from podracer.es.agent import make_agent, members_per_device
from podracer.es.strategy import Perturbation
from podracer.networks import make_policy_network
from podracer.protocol import parallel

SMALL = (16,)  # hidden widths: small policies compile and evaluate fast


def _policy(env):
    return make_policy_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete, SMALL)


def _programs(env, config, devices, strategy=None):
    horizon = config.horizon or env.horizon
    sizes = AnakinConfig(num_envs=config.population * config.episodes_per_member, rollout_len=horizon,
                         updates_per_call=config.generations_per_call)
    agent_for = fixed_agent(make_agent, _policy(env), None, config, env.spec, horizon, strategy=strategy)
    return make_programs(env, agent_for, sizes, parallel.make_mesh(devices))


class AlwaysRight(nn.Module):
    """A policy that pushes CartPole right whatever it sees (one unused parameter to evolve)."""

    @nn.compact
    def __call__(self, obs):
        unused = self.param("unused", nn.initializers.zeros, ())
        return jnp.int32(1) + jnp.int32(0 * unused)


# ---------------------------------------------------------------- episodes


def test_the_mean_is_evaluated_on_one_episode_up_to_its_first_end():
    # Always pushing right topples CartPole within a few dozen steps; the evaluation's episode then
    # starts again and would keep paying +1 a step if the return were not cut at the end.
    env = make_env("CartPole-v1")
    config = es.ESConfig(population=2, eval_episodes=1)
    state = make_agent(AlwaysRight(), None, config, env.spec, 200).init(jax.random.PRNGKey(0))
    evaluate = make_mean_evaluation(env, AlwaysRight(), config, 200, parallel.make_mesh(jax.devices()[:1]))
    # The episode's key, as the evaluation derives it (the state's key, its generation, episode 0).
    key = jax.random.fold_in(jax.random.fold_in(jax.random.split(state.key)[1], state.strategy.generation), 0)
    env_state, timestep = env.reset(jax.random.split(key)[0])
    step = jax.jit(lambda state: env.step(jax.random.PRNGKey(0), state, jnp.int32(1)))
    length = 0
    while not (timestep.terminated or timestep.truncated):
        env_state, timestep = step(env_state)
        length += 1
    assert 5 < length < 100
    assert float(evaluate(state)) == length


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


@pytest.mark.parametrize("env_id, variant, episodes", [("CartPole-v1", "openai", 1), ("Pendulum-v1", "openai", 2)])
def test_a_pair_evaluates_as_its_two_members(env_id, variant, episodes):
    """With low-rank noise a pair's members act together, sharing the mean's matrix products: each
    member's return is the one it gets acting alone on the same episodes."""
    env = make_env(env_id)
    config = es.ESConfig(variant=variant, population=8, horizon=80, episodes_per_member=episodes, low_rank=1,
                         sigma=0.5)
    honest = es.make_strategy(config, [leaf.shape for leaf in jax.tree.leaves(
        _policy(env).init(jax.random.PRNGKey(0), jnp.zeros(env.spec.obs_shape)))])
    agent = make_agent(_policy(env), None, config, env.spec, 80)
    state = agent.init(jax.random.PRNGKey(3))
    assert isinstance(agent.for_rollout(state, jnp.arange(8 * episodes)).params, Perturbation)  # by pairs
    returns = []
    for strategy in (honest, honest._replace(perturb=None)):  # by pairs, then member by member
        programs = _programs(env, config, jax.devices()[:1], strategy)
        _, experience = programs.act(programs.init(jax.random.PRNGKey(3)))
        returns.append(np.asarray(experience.batch[0]))
    assert len(np.unique(returns[1])) > 2  # different members
    np.testing.assert_allclose(returns[0], returns[1], rtol=1e-4, atol=1e-4)


def test_ars_v2_counts_only_the_observations_before_the_end():
    env = make_env("CartPole-v1")
    config = es.ESConfig(variant="ars_v2", population=4, horizon=200, top_directions=2)
    programs = _programs(env, config, jax.devices()[:1])
    _, experience = programs.act(programs.init(jax.random.PRNGKey(1)))
    returns, seen = np.asarray(experience.batch[0])[0], experience.bootstrap_value  # each environment's
    # One observation per rewarded step (CartPole pays 1 a step), none after an episode's end.
    np.testing.assert_array_equal(np.asarray(seen.count), returns)
    assert np.all(returns < 200)


# ---------------------------------------------------------------- devices


@pytest.mark.parametrize("variant", ["openai", "ars_v2"])
def test_the_mean_evaluation_is_the_same_on_1_and_8_devices(variant):
    assert len(jax.devices()) == 8
    env = make_env("CartPole-v1")
    config = es.ESConfig(variant=variant, population=8, eval_episodes=12)
    state = make_agent(_policy(env), None, config, env.spec, 200).init(jax.random.PRNGKey(2))
    if variant == "ars_v2":  # statistics that change what the policy sees
        state = state._replace(obs_stats=es.observation_stats(jax.random.normal(jax.random.PRNGKey(4), (50, 4))))
    one, eight = (float(make_mean_evaluation(env, _policy(env), config, 200, parallel.make_mesh(devices))(state))
                  for devices in (jax.devices()[:1], jax.devices()))
    assert 0 < one < 200
    np.testing.assert_allclose(one, eight, rtol=1e-5)


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
        members_per_device(es.ESConfig(population=12), len(jax.devices()))


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
