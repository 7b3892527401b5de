"""DQN's maths against hand-computed values: n-step transitions, double-Q targets, the target network."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from podracer import dqn

GAMMA = 0.5


def _rollout(terminated, truncated):
    """One environment, T=5 rows: observation t is [10 t], the final observation of row t [100 + t]."""
    num_steps = len(terminated)
    obs = jnp.arange(num_steps, dtype=jnp.float32)[:, None, None] * 10  # [T, B=1, 1]
    final_obs = obs + 100 + jnp.arange(num_steps, dtype=jnp.float32)[:, None, None] / 10 - obs
    reward = jnp.asarray([1.0, 2.0, 4.0, 8.0, 16.0])[:num_steps, None]
    action = jnp.zeros((num_steps, 1), jnp.int32)
    next_obs = jnp.asarray([[50.0]])
    as_rows = lambda flags: jnp.asarray(flags, bool)[:, None]
    return dqn.nstep_transitions(obs, action, reward, as_rows(terminated), as_rows(truncated), final_obs,
                                 next_obs, GAMMA, 3)


def test_nstep_transitions_stop_at_a_termination_and_at_the_rollouts_end():
    # Row 1 terminates: rows 0 and 1 stop there and bootstrap nothing.
    out = _rollout([0, 1, 0, 0, 0], [0, 0, 0, 0, 0])
    np.testing.assert_allclose(out.reward[:, 0], [1 + 0.5 * 2, 2, 4 + 0.5 * 8 + 0.25 * 16, 8 + 0.5 * 16, 16])
    np.testing.assert_allclose(out.discount[:, 0], [0, 0, 0.125, 0.25, 0.5])
    # Row 2 bootstraps from obs 5 (after the rollout's last row), as do 3 and 4: cut short there.
    np.testing.assert_allclose(out.next_obs[2:, 0, 0], [50, 50, 50])
    np.testing.assert_allclose(out.obs[:, 0, 0], [0, 10, 20, 30, 40])


def test_nstep_transitions_bootstrap_a_truncation_from_its_final_observation():
    # Row 2 is truncated: rows 0..2 bootstrap from its final observation (100.2), discounted.
    out = _rollout([0, 0, 0, 0, 0], [0, 0, 1, 0, 0])
    np.testing.assert_allclose(out.reward[:, 0], [1 + 0.5 * 2 + 0.25 * 4, 2 + 0.5 * 4, 4, 8 + 0.5 * 16, 16])
    np.testing.assert_allclose(out.discount[:, 0], [0.125, 0.25, 0.5, 0.25, 0.5])
    np.testing.assert_allclose(out.next_obs[:, 0, 0], [100.2, 100.2, 100.2, 50, 50], rtol=1e-6)


def test_one_step_transitions_are_the_rows_themselves():
    obs = jnp.arange(4.0)[:, None]
    out = dqn.nstep_transitions(obs, jnp.zeros((4, 1), jnp.int32), jnp.ones((4, 1)), jnp.zeros((4, 1), bool),
                                jnp.zeros((4, 1), bool), obs + 100, jnp.asarray([9.0]), 0.9, 1)
    np.testing.assert_allclose(out.reward[:, 0], 1.0)
    np.testing.assert_allclose(out.discount[:, 0], 0.9)
    np.testing.assert_allclose(out.next_obs[:, 0], [1, 2, 3, 9])


def test_double_q_targets_value_the_online_choice_with_the_target_network():
    reward, discount = jnp.asarray([1.0, 2.0]), jnp.asarray([0.5, 0.0])
    q_target = jnp.asarray([[10.0, 20.0, 30.0], [7.0, 8.0, 9.0]])
    q_online = jnp.asarray([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    # Double: the online network picks action 1 (then 0), the target network values it: 20.
    np.testing.assert_allclose(dqn.double_q_targets(reward, discount, q_target, q_online), [1 + 0.5 * 20, 2])
    # DQN's own: the target network's max, 30.
    np.testing.assert_allclose(dqn.double_q_targets(reward, discount, q_target), [1 + 0.5 * 30, 2])


def test_the_loss_bootstraps_from_the_online_networks_choice_valued_by_the_target_network():
    # A Q-table read by state index: obs [N, 1] holds the state.
    q_fn = lambda table, obs: table[obs[:, 0].astype(jnp.int32)]
    online = jnp.asarray([[1.0, 3.0], [0.0, 9.0], [8.0, 0.0]])  # picks action 0 in state 2
    target = jnp.asarray([[0.0, 0.0], [0.0, 0.0], [2.0, 8.0]])  # picks action 1 in state 2
    batch = dqn.NStep(obs=jnp.asarray([[0.0], [1.0]]), action=jnp.asarray([1, 0]), reward=jnp.asarray([1.0, 0.0]),
                      discount=jnp.asarray([0.5, 0.0]), next_obs=jnp.asarray([[2.0], [2.0]]))
    # Row 0: Q = 3, target 1 + 0.5 * Q_target(2, argmax online = 0) = 2; row 1: Q = 0, target 0.
    config = dqn.DQNConfig(loss="mse")
    loss, q_mean = dqn.make_loss(q_fn, config)(online, target, batch)
    assert float(loss) == pytest.approx((3 - 2) ** 2 / 2) and float(q_mean) == pytest.approx(1.5)
    # Without double Q-learning the target network's own max (8) bootstraps row 0: 1 + 4 = 5.
    loss, _ = dqn.make_loss(q_fn, dataclasses.replace(config, double_q=False))(online, target, batch)
    assert float(loss) == pytest.approx((3 - 5) ** 2 / 2)


def test_td_losses():
    q, target = jnp.asarray([0.0, 0.0]), jnp.asarray([0.5, 3.0])
    np.testing.assert_allclose(dqn.td_loss(q, target, "huber"), (0.5 * 0.25 + (3 - 0.5)) / 2)
    np.testing.assert_allclose(dqn.td_loss(q, target, "mse"), (0.25 + 9) / 2)


@pytest.mark.parametrize("period, tau", [(3, 1.0), (1, 0.25)])
def test_the_target_network_follows_every_period_by_tau(period, tau):
    config = dqn.DQNConfig(target_update_period=period, tau=tau)
    params, target = {"w": jnp.asarray(8.0)}, {"w": jnp.asarray(0.0)}
    seen = []
    for step in range(1, 7):
        target = dqn.target_update(params, target, jnp.asarray(step), config)
        seen.append(float(target["w"]))
    if tau == 1.0:  # a copy at steps 3 and 6, unchanged in between
        params_at = [0, 0, 8, 8, 8, 8]
    else:  # Polyak averaging: w <- 0.25 * 8 + 0.75 * w at every step
        params_at, w = [], 0.0
        for _ in range(6):
            w = 0.25 * 8 + 0.75 * w
            params_at.append(w)
    np.testing.assert_allclose(seen, params_at)


def test_epsilon_decays_linearly_over_its_updates():
    config = dqn.DQNConfig(epsilon_start=1.0, epsilon_end=0.1, epsilon_decay=10)
    got = [float(dqn.epsilon(config, jnp.asarray(s))) for s in (0, 5, 10, 20)]
    np.testing.assert_allclose(got, [1.0, 0.55, 0.1, 0.1], rtol=1e-6)


def test_the_manuals_own_update_snippet_runs_and_learns():
    import re

    from conftest import REPO_ROOT

    text = open(f"{REPO_ROOT}/docs/dqn.md").read()
    source = re.search(r"<!-- snippet: own-update -->\s*```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(source, "docs/dqn.md", "exec"), namespace)
    state, metrics = namespace["state"], namespace["metrics"]
    assert float(metrics["learning"]) == 1 and float(metrics["loss"]) > 0
    assert int(state.gradient_steps) == 1 and int(state.step) == 1
