"""ES as an agent on the contract: a generation is one rollout of Anakin's one program (`loop.make_programs`)."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from podracer import es
from podracer.agent import fixed_agent
from podracer.anakin.loop import AnakinConfig, make_programs
from podracer.anakin.profiled import compile_agent_phases, make_profiled_train
from podracer.envs.jax_envs import make_env
from podracer.es.agent import make_agent
from podracer.networks import make_policy_network
from podracer.population import with_values
from podracer.protocol import parallel

SMALL = (16,)  # hidden widths: small policies compile and evaluate fast


def _programs(env_id, config, devices, strategy=None):
    env = make_env(env_id)
    policy = make_policy_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete, SMALL)
    horizon = config.horizon or env.horizon
    anakin = AnakinConfig(num_envs=config.population * config.episodes_per_member, rollout_len=horizon,
                          updates_per_call=config.generations_per_call)
    agent_for = fixed_agent(make_agent, policy, None, config, env.spec, horizon, strategy=strategy)
    return make_programs(env, agent_for, anakin, parallel.make_mesh(devices))


def _run(env_id, config, devices, calls, strategy=None):
    programs = _programs(env_id, config, devices, strategy)
    runner, history = programs.init(jax.random.PRNGKey(3)), []
    for _ in range(calls):
        runner, metrics = programs.train(runner)
        history.append(jax.device_get(metrics))
    return jax.device_get(runner), history


def test_learns_cartpole_where_a_flipped_update_cannot():
    config = es.ESConfig(population=32, generations_per_call=4)
    runner, history = _run("CartPole-v1", config, jax.devices()[:1], calls=8)
    fitness = [float(np.mean(m["fitness_mean"])) for m in history]
    assert fitness[0] < 100 and fitness[-1] > 300, fitness
    assert int(runner.train.strategy.generation) == 8 * 4

    honest = es.make_strategy(config)
    flipped = honest._replace(tell=lambda state, key, fitness: honest.tell(state, key, -fitness))
    _, broken = _run("CartPole-v1", config, jax.devices()[:1], calls=8, strategy=flipped)
    assert max(float(np.max(m["fitness_mean"])) for m in broken) < 100


@pytest.mark.parametrize("env_id, variant, low_rank", [("Pendulum-v1", "openai", 0), ("CartPole-v1", "ars_v2", 0),
                                                       ("CartPole-v1", "openai", 1)])
def test_same_generations_on_1_and_8_devices(env_id, variant, low_rank):
    assert len(jax.devices()) == 8
    config = es.ESConfig(variant=variant, population=16, horizon=100, episodes_per_member=1 if low_rank else 2,
                         generations_per_call=3, sigma=0.1, es_lr=0.05, low_rank=low_rank)
    one, m1 = _run(env_id, config, jax.devices()[:1], calls=2)
    eight, m8 = _run(env_id, config, jax.devices(), calls=2)
    assert int(one.train.strategy.generation) == int(eight.train.strategy.generation) == 6
    initial = jax.device_get(_programs(env_id, config, jax.devices()[:1]).init(jax.random.PRNGKey(3)))
    assert not np.allclose(one.train.strategy.mean, initial.train.strategy.mean)  # not vacuous
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                 one.train.strategy, eight.train.strategy)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4),
                 one.train.obs_stats, eight.train.obs_stats)
    assert (float(eight.train.obs_stats.count) > 0) == (variant == "ars_v2")
    for a, b in zip(m1, m8):
        np.testing.assert_allclose(a["fitness_mean"], b["fitness_mean"], rtol=1e-4)


def test_pair_members_live_the_same_episodes_and_rewards_stop_at_the_first_end():
    """With every member at the mean, each pair's two members see the same episodes: equal returns
    within a pair, different ones across pairs (CartPole's resets are random); the returns are
    those of one episode, cut at its end (a fresh episode every generation)."""
    config = es.ESConfig(population=8, episodes_per_member=2, horizon=300, generations_per_call=1)
    honest = es.make_strategy(config)
    at_mean = honest._replace(ask=lambda state, key, members: jnp.broadcast_to(
        state.mean, (members.shape[0], state.mean.shape[0])), perturb=None)
    programs = _programs("CartPole-v1", config, jax.devices()[:4], at_mean)
    runner = programs.init(jax.random.PRNGKey(0))
    for _ in range(2):  # a second generation starts fresh episodes again
        runner, experience = programs.act(runner)
        returns = np.asarray(experience.batch[0]).reshape(4, 2, 2)  # [pair, member, episode]
        np.testing.assert_array_equal(returns[:, 0], returns[:, 1])
        assert len(np.unique(returns[:, 0])) > 1
        assert np.all(returns > 0) and np.all(returns < 300)  # unmasked, every one would be 300
        # The episodes the log counts are the same ones: each environment's, up to its first end.
        assert int(experience.episodes["episodes"]) == 16
        assert float(experience.episodes["episode_return_sum"]) == returns.sum()
        assert int(experience.episodes["episode_length_sum"]) == returns.sum()  # CartPole pays 1 a step


@pytest.mark.parametrize("devices, sharded", [(1, False), (2, True)])
def test_population_agent_equals_a_run_of_one(devices, sharded):
    """A population of ES agents (sigma and es_lr swept, traced) is the one-agent program vmapped:
    each agent's generations are those of a run of one with its settings and seed."""
    env = make_env("CartPole-v1")
    policy = make_policy_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete, SMALL)
    config = es.ESConfig(population=16, horizon=100, generations_per_call=3)
    anakin = AnakinConfig(num_envs=16, rollout_len=100, updates_per_call=3)
    mesh = parallel.make_mesh(jax.devices()[:devices])
    agent_for = lambda hparams, axes: make_agent(policy, None, with_values(config, hparams), env.spec, 100, axes)
    keys = jnp.stack([jax.random.PRNGKey(1), jax.random.PRNGKey(2)])
    hparams = {"sigma": jnp.asarray([0.05, 0.2], jnp.float32), "es_lr": jnp.asarray([0.03, 0.1], jnp.float32)}
    programs = make_programs(env, agent_for, anakin, mesh, population=True, sharded=sharded)
    runner = programs.init(keys, hparams)
    for _ in range(2):
        runner, metrics = programs.train(runner)
    means = np.asarray(runner.train.strategy.mean)
    assert not np.allclose(means[0], means[1])
    for i in range(2):
        settings = {name: float(values[i]) for name, values in hparams.items()}
        one, history = _run_with(env, policy, dataclasses.replace(config, **settings), keys[i], calls=2)
        np.testing.assert_allclose(means[i], one.train.strategy.mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(metrics["fitness_mean"])[:, i], history[-1]["fitness_mean"],
                                   rtol=1e-5)


def _run_with(env, policy, config, key, calls):
    anakin = AnakinConfig(num_envs=config.population, rollout_len=config.horizon,
                          updates_per_call=config.generations_per_call)
    programs = make_programs(env, fixed_agent(make_agent, policy, None, config, env.spec, config.horizon), anakin,
                             parallel.make_mesh(jax.devices()[:1]))
    runner, history = programs.init(key), []
    for _ in range(calls):
        runner, metrics = programs.train(runner)
        history.append(jax.device_get(metrics))
    return jax.device_get(runner), history


def test_profile_phases_compute_the_fused_generations():
    """--profile's acting and learning, compiled apart, are the fused program's generations."""
    config = es.ESConfig(variant="ars_v2", population=16, horizon=100, generations_per_call=3)
    programs = _programs("CartPole-v1", config, jax.devices()[:2])
    fused, metrics = programs.train(programs.init(jax.random.PRNGKey(3)))
    runner = programs.init(jax.random.PRNGKey(3))
    train = make_profiled_train(*compile_agent_phases(programs.act, programs.learn, runner), 3,
                                lambda name: contextlib.nullcontext())
    profiled, profiled_metrics = train(runner)
    assert not np.allclose(profiled.train.strategy.mean, runner.train.strategy.mean)  # not vacuous
    np.testing.assert_array_equal(profiled.train.strategy.mean, fused.train.strategy.mean)
    np.testing.assert_array_equal(profiled.train.obs_stats.mean, fused.train.obs_stats.mean)
    np.testing.assert_array_equal(profiled_metrics["fitness_mean"], metrics["fitness_mean"])
