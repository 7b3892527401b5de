"""PQN's maths against hand values, its epsilon schedule, and its program on any device count."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from podracer import pqn
from podracer.envs.jax_envs import make_env
from podracer.anakin.loop import AnakinConfig, make_programs
from podracer.config import NetworkConfig
from podracer.orchestrate.parse import parse_configs
from podracer.protocol import parallel

from conftest import REPO_ROOT

# One rollout of one environment: row 1 terminates, row 3 is truncated (a time limit), row 4 is the last.
R = [1.0, 2.0, 3.0, 4.0, 5.0]
Q_MAX = [10.0, 20.0, 30.0, 40.0, 45.0]  # max-Q of each row's observation
FINAL_Q_MAX = [100.0, 200.0, 300.0, 400.0, 500.0]  # of each row's final observation (read where truncated)
BOOTSTRAP = 50.0  # of the observation after the rollout
TERMINATED = [False, True, False, False, False]
TRUNCATED = [False, False, False, True, False]


def _targets(lam, gamma=0.9):
    column = lambda xs, dtype=jnp.float32: jnp.asarray(xs, dtype)[:, None]
    batch = pqn.QTransition(None, None, column(R), column(TERMINATED, bool), column(TRUNCATED, bool),
                            column(Q_MAX), column(FINAL_Q_MAX))
    q_next = pqn.next_q_max(batch, jnp.asarray([BOOTSTRAP]))
    np.testing.assert_array_equal(q_next[:, 0], [20.0, 30.0, 40.0, 400.0, 50.0])
    return np.asarray(pqn.q_lambda_targets(batch.reward, q_next, batch.terminated, batch.truncated, gamma, lam))[:, 0]


def test_q_lambda_targets_match_hand_values_across_a_termination_and_a_truncation():
    # Backwards: G4 = 5 + .9 * 50; G3 = 4 + .9 * 400 (truncated: its final observation);
    # G2 = 3 + .9 * (.5 * 40 + .5 * G3); G1 = 2 (terminated); G0 = 1 + .9 * (.5 * 20 + .5 * G1).
    np.testing.assert_allclose(_targets(0.5), [10.9, 2.0, 184.8, 364.0, 50.0], rtol=1e-6)


def test_q_lambda_zero_is_one_step_q_learning_and_one_the_bootstrapped_return():
    np.testing.assert_allclose(_targets(0.0), [1 + .9 * 20, 2.0, 3 + .9 * 40, 4 + .9 * 400, 5 + .9 * 50],
                               rtol=1e-6)
    np.testing.assert_allclose(_targets(1.0), [1 + .9 * 2, 2.0, 3 + .9 * 364, 364.0, 50.0], rtol=1e-6)


def test_epsilon_falls_linearly_over_its_fraction_of_the_run_then_stays():
    config = pqn.PQNConfig(epsilon_start=1.0, epsilon_end=0.1, epsilon_decay_fraction=0.5, schedule_updates=40)
    epsilon = [float(pqn.epsilon_of(config, jnp.asarray(step))) for step in (0, 10, 20, 21, 39)]
    np.testing.assert_allclose(epsilon, [1.0, 0.55, 0.1, 0.1, 0.1], rtol=1e-6)
    with pytest.raises(ValueError, match="schedule_updates"):
        pqn.epsilon_of(pqn.PQNConfig(), jnp.asarray(0))


def test_the_schedule_spans_the_updates_the_run_trains_unless_given():
    run = ["--algo=pqn", "--num-envs=32", "--rollout-len=64", "--updates-per-call=8", "--total-steps=100000"]
    # 16,384 steps a call: 7 whole calls, 56 updates (as Anakin's driver counts them).
    assert parse_configs(run).agent.schedule_updates == 56
    assert parse_configs([*run, "--schedule-updates=10"]).agent.schedule_updates == 10


def test_epsilon_greedy_acts_and_scores_its_choices():
    q = jnp.asarray([[1.0, 3.0, 2.0], [5.0, 0.0, 0.0]])
    action = pqn.epsilon_greedy(q, 0.2, jnp.asarray([0.5, 0.1]), jnp.asarray([2, 2]))
    np.testing.assert_array_equal(action, [1, 2])  # greedy above epsilon, the random action below
    np.testing.assert_allclose(np.exp(pqn.epsilon_greedy_log_prob(q, action, jnp.asarray(0.2))),
                               [0.8 + 0.2 / 3, 0.2 / 3], rtol=1e-6)


@pytest.mark.parametrize("twice", [False, True])
def test_the_truncation_bootstrap_evaluates_the_truncated_rows_final_observations(twice):
    from podracer.agent import Trajectory
    from podracer.pqn.agent import truncated_q_max

    # 6 steps of 3 environments: env 0 truncated at row 2, env 1 never, env 2 at row 5 (and at row 1 too, `twice`).
    truncated = np.zeros((6, 3), bool)
    truncated[2, 0] = truncated[5, 2] = True
    truncated[1, 2] = twice
    final_obs = jax.random.normal(jax.random.PRNGKey(0), (6, 3, 4))
    q_max = lambda params, obs: jnp.sum(obs * params, axis=-1)  # any function of each observation alone
    params = jnp.asarray([1.0, -2.0, 3.0, 0.5])
    rollout = Trajectory(None, None, None, None, jnp.asarray(truncated), final_obs, None, None, None, None)
    got = truncated_q_max(q_max, params, rollout)
    expected = q_max(params, final_obs)
    np.testing.assert_allclose(np.asarray(got)[truncated], np.asarray(expected)[truncated], rtol=1e-6)


ENV = make_env("CartPole-v1")
NETWORK = pqn.make_q_network(ENV.spec, NetworkConfig(hidden=(16, 16), activation="relu"))
CONFIG = AnakinConfig(num_envs=8, rollout_len=16, updates_per_call=3)
PQN = pqn.PQNConfig(minibatches=4, epochs=2, schedule_updates=6, epsilon_decay_fraction=0.5)


def _train(devices, config=PQN, calls=2):
    # Plain SGD: Adam divides by the gradient's scale, turning summation-order rounding into visible changes.
    agent_for = lambda hparams, axes: pqn.make_agent(NETWORK, optax.sgd(1e-2), config, ENV.spec,
                                                     CONFIG.rollout_len, axes)
    programs = make_programs(ENV, agent_for, CONFIG, parallel.make_mesh(devices))
    runner = programs.init(jax.random.PRNGKey(3))
    start = jax.device_get(runner.train.params)
    for _ in range(calls):
        runner, metrics = programs.train(runner)
    return start, jax.device_get(runner), jax.device_get(metrics)


def test_one_device_matches_eight():
    assert len(jax.devices()) == 8
    start, one, m1 = _train(jax.devices()[:1])
    _, eight, m8 = _train(jax.devices())
    assert int(one.train.step) == int(eight.train.step) == 6
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(one.train.params)))
    for a, b in zip(jax.tree.leaves(one.train.params), jax.tree.leaves(eight.train.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(m1["episodes"], m8["episodes"])
    np.testing.assert_allclose(m1["td_loss"], m8["td_loss"], rtol=1e-3, atol=1e-6)
    # Epsilon decays over the first half of the 6 updates: the second call's three act with 0.05.
    np.testing.assert_allclose(m1["epsilon"], [0.05, 0.05, 0.05], rtol=1e-6)


def test_a_populations_agent_acts_on_its_own_traced_schedule_as_a_run_of_its_own():
    from podracer.population import with_values

    mesh = parallel.make_mesh(jax.devices()[:1])
    agent_for = lambda hparams, axes: pqn.make_agent(NETWORK, optax.sgd(1e-2), with_values(PQN, hparams), ENV.spec,
                                                     CONFIG.rollout_len, axes)
    alone = make_programs(ENV, lambda h, axes: agent_for({"epsilon_start": 0.5}, axes), CONFIG, mesh)
    expected, alone_metrics = alone.train(alone.init(jax.random.PRNGKey(1)))
    programs = make_programs(ENV, agent_for, CONFIG, mesh, population=True)
    keys = jnp.stack([jax.random.PRNGKey(0), jax.random.PRNGKey(1)])
    runner, metrics = programs.train(programs.init(keys, {"epsilon_start": jnp.asarray([1.0, 0.5])}))
    # Each agent's epsilon falls from its own start to 0.05 over the first 3 of the 6 updates.
    np.testing.assert_allclose(metrics["epsilon"][:, 0], [1.0, 1 - 0.95 / 3, 1 - 2 * 0.95 / 3], rtol=1e-6)
    np.testing.assert_allclose(metrics["epsilon"][:, 1], [0.5, 0.5 - 0.45 / 3, 0.5 - 2 * 0.45 / 3], rtol=1e-6)
    np.testing.assert_allclose(metrics["epsilon"][:, 1], alone_metrics["epsilon"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(expected.train), jax.tree.leaves(jax.tree.map(lambda x: x[1], runner.train))):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


def test_the_manuals_own_loop_snippet_runs_an_update():
    text = open(f"{REPO_ROOT}/docs/pqn.md").read()
    source = re.search(r"<!-- snippet: pqn-update -->\s*```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(source, "docs/pqn.md", "exec"), namespace)
    state, metrics = namespace["state"], namespace["metrics"]
    assert int(state.step) == 1 and np.isfinite(float(metrics["td_loss"]))
    moved = [np.abs(np.asarray(a) - np.asarray(b)).max()
             for a, b in zip(jax.tree.leaves(namespace["params"]), jax.tree.leaves(state.params))]
    assert max(moved) > 1e-5  # 4 epochs x 4 minibatches of Adam steps applied
