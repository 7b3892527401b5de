"""An agent written outside the package runs on Anakin through the contract, population and profile phases included."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from podracer.agent import Agent, Rollout
from podracer.envs.jax_envs import make_env
from podracer.anakin.loop import AnakinConfig, make_programs
from podracer.networks import init_params, make_network
from podracer.protocol import parallel


class PGState(NamedTuple):
    params: Any
    opt_state: Any


def make_pg_agent(network, optimizer, gamma, spec, rollout_len, axis_names=()) -> Agent:
    """Vanilla policy gradient: the docs' example agent (discounted returns within the rollout)."""

    def init(key):
        params = init_params(network, spec.obs_shape, spec.obs_dtype, key)
        return PGState(params, optimizer.init(params))

    def act(state, obs, key, carry):
        dist, _ = network.apply(state.params, obs)
        action = jax.vmap(lambda d, k: d.sample(k))(dist, key)
        return action, carry, ()

    def prepare(state, rollout):
        done = jnp.logical_or(rollout.terminated, rollout.truncated)

        def discount(future, row):
            reward, done = row
            future = reward + gamma * future * (1.0 - done)
            return future, future

        _, returns = jax.lax.scan(discount, jnp.zeros_like(rollout.reward[0]), (rollout.reward, done),
                                  reverse=True)
        return (rollout.obs, rollout.action, returns), ()

    def learn(state, batch, bootstrap, key, carry):
        obs, action, returns = batch

        def loss(params):
            dist, _ = network.apply(params, obs)
            return -jnp.mean(dist.log_prob(action) * returns)

        loss_value, grads = jax.value_and_grad(loss)(parallel.vary(state.params, axis_names))
        grads = parallel.pmean(grads, axis_names)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        metrics = {"loss": parallel.pmean(loss_value, axis_names)}
        return PGState(optax.apply_updates(state.params, updates), opt_state), metrics

    return Agent(init, act, prepare, learn, Rollout(rollout_len), draw=lambda key: key,
                 initial_carry=lambda num_envs: ())


ENV = make_env("CartPole-v1")
NETWORK = make_network(ENV.spec.obs_shape, ENV.spec.action_dim, ENV.spec.discrete, (16,))
CONFIG = AnakinConfig(num_envs=8, rollout_len=16, updates_per_call=2)


def agent_for(hparams, axis_names):
    return make_pg_agent(NETWORK, optax.sgd(0.1), hparams.get("gamma", 0.5), ENV.spec, CONFIG.rollout_len,
                         axis_names)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_a_new_agent_trains_on_any_device_count_and_its_phases_compute_the_fused_update():
    one = make_programs(ENV, lambda h, axes: agent_for({"gamma": 0.9}, axes), CONFIG,
                        parallel.make_mesh(jax.devices()[:1]))
    two = make_programs(ENV, lambda h, axes: agent_for({"gamma": 0.9}, axes), CONFIG,
                        parallel.make_mesh(jax.devices()[:2]))
    start = jax.device_get(one.init(jax.random.PRNGKey(1)).train.params)
    fused, metrics = one.train(one.init(jax.random.PRNGKey(1)))
    assert metrics["loss"].shape == (2,) and bool(np.all(metrics["params_finite"]))
    assert int(np.sum(metrics["episodes"])) > 0
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(start), _leaves(fused.train.params)))

    # Two devices (environments split, gradients averaged) give one device's result.
    split, _ = two.train(two.init(jax.random.PRNGKey(1)))
    for a, b in zip(_leaves(fused.train), _leaves(split.train)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)

    # Profile mode's phases, run in turn, are the fused program.
    runner = one.init(jax.random.PRNGKey(1))
    for _ in range(CONFIG.updates_per_call):
        runner, experience = one.act(runner)
        runner = runner._replace(train=one.learn(runner.train, experience)[0])
    for a, b in zip(_leaves(fused.train), _leaves(runner.train)):
        np.testing.assert_array_equal(a, b)


def test_a_population_of_the_new_agent_is_its_program_vmapped_with_each_agents_settings():
    mesh = parallel.make_mesh(jax.devices()[:2])
    alone = make_programs(ENV, lambda h, axes: agent_for({"gamma": 0.9}, axes), CONFIG, mesh)
    expected, _ = alone.train(alone.init(jax.random.PRNGKey(1)))
    for sharded in (False, True):  # agents on every device, or split over them
        programs = make_programs(ENV, agent_for, CONFIG, mesh, population=True, sharded=sharded)
        keys = jnp.stack([jax.random.PRNGKey(0), jax.random.PRNGKey(1)])
        runner, metrics = programs.train(programs.init(keys, {"gamma": jnp.asarray([0.99, 0.9])}))
        assert metrics["loss"].shape == (2, 2)  # [updates, agents]
        agent1 = jax.tree.map(lambda x: x[1], runner.train)
        for a, b in zip(_leaves(expected.train), _leaves(agent1)):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


def _with_memory(agent: Agent) -> Agent:
    """`agent` whose state also keeps a NaN-filled array that learning never writes (as a replay buffer of
    what the environments answered), left out of its `learned_state`."""
    return agent._replace(
        init=lambda key: (agent.init(key), jnp.full(3, jnp.nan)),
        act=lambda state, *args: agent.act(state[0], *args),
        prepare=lambda state, rollout: agent.prepare(state[0], rollout),
        learn=lambda state, *args: (lambda out: ((out[0], state[1]), out[1]))(agent.learn(state[0], *args)),
        learned_state=lambda state: state[0])


def test_the_nan_guard_reads_the_learned_state_and_catches_diverged_parameters():
    mesh = parallel.make_mesh(jax.devices()[:1])
    for lr, finite in ((0.1, True), (float("nan"), False)):
        programs = make_programs(ENV, lambda h, axes: _with_memory(make_pg_agent(
            NETWORK, optax.sgd(lr), 0.9, ENV.spec, CONFIG.rollout_len, axes)), CONFIG, mesh)
        _, metrics = programs.train(programs.init(jax.random.PRNGKey(1)))
        assert np.asarray(metrics["params_finite"]).tolist() == [finite] * CONFIG.updates_per_call
