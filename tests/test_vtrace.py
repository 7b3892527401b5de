"""V-trace against rlax (an oracle only), hand-computed values and n-step returns; the IMPALA update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from podracer import vtrace
from podracer.distributions import Categorical
from podracer.networks import init_params, make_network
from podracer.ppo import gae_advantages, init_train_state
from podracer.protocol import parallel
from podracer.types import Transition

GAMMA = 0.9


def _random(seed, t=12, b=5, truncations=False):
    rng = np.random.default_rng(seed)
    terminated = rng.random((t, b)) < 0.15
    truncated = (rng.random((t, b)) < 0.15) & ~terminated if truncations else np.zeros((t, b), bool)
    return dict(r_t=rng.normal(size=(t, b)).astype(np.float32), v_t=rng.normal(size=(t, b)).astype(np.float32),
                bootstrap_value=rng.normal(size=b).astype(np.float32), terminated_t=terminated,
                truncated_t=truncated, final_value_t=rng.normal(size=(t, b)).astype(np.float32),
                log_rho_t=rng.normal(scale=0.7, size=(t, b)).astype(np.float32))


def _rlax_column(rlax, a, b, rows, next_value_last, rho_bar, pg_rho_bar):
    """rlax's V-trace on rows `rows` of column b, bootstrapping the last row from `next_value_last`."""
    v = a["v_t"][rows, b]
    v_next = np.append(a["v_t"][rows[1:], b], next_value_last)
    discount = (GAMMA * (1.0 - a["terminated_t"][rows, b])).astype(np.float32)
    return rlax.vtrace_td_error_and_advantage(
        jnp.asarray(v), jnp.asarray(v_next, jnp.float32), jnp.asarray(a["r_t"][rows, b]), jnp.asarray(discount),
        jnp.exp(a["log_rho_t"][rows, b]), 1.0, rho_bar, pg_rho_bar)


@pytest.mark.parametrize("rho_bar,pg_rho_bar", [(1.0, 1.0), (0.8, 1.5), (100.0, 100.0)])
def test_matches_rlax_with_terminations(rho_bar, pg_rho_bar):
    rlax = pytest.importorskip("rlax")
    a = _random(0)
    ours = vtrace.vtrace_td_error_and_advantage(**a, gamma=GAMMA, rho_bar=rho_bar, pg_rho_bar=pg_rho_bar)
    t, b = a["r_t"].shape
    for column in range(b):
        theirs = _rlax_column(rlax, a, column, np.arange(t), a["bootstrap_value"][column], rho_bar, pg_rho_bar)
        np.testing.assert_allclose(ours.errors[:, column], theirs.errors, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ours.pg_advantage[:, column], theirs.pg_advantage, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ours.q_estimate[:, column], theirs.q_estimate, rtol=1e-5, atol=1e-5)


def test_matches_rlax_on_each_episode_with_truncations():
    """A truncation ends the column's episode: rlax on each piece, the piece bootstrapped from its final value."""
    rlax = pytest.importorskip("rlax")
    a = _random(1, t=16, b=6, truncations=True)
    assert a["truncated_t"].any()
    ours = vtrace.vtrace_td_error_and_advantage(**a, gamma=GAMMA)
    t, b = a["r_t"].shape
    for column in range(b):
        ends = [int(i) for i in np.flatnonzero(a["truncated_t"][:, column])] + [t - 1]
        start = 0
        for end in dict.fromkeys(ends):
            rows = np.arange(start, end + 1)
            last = a["final_value_t"][end, column] if a["truncated_t"][end, column] else a["bootstrap_value"][column]
            theirs = _rlax_column(rlax, a, column, rows, last, 1.0, 1.0)
            np.testing.assert_allclose(ours.errors[rows, column], theirs.errors, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(ours.pg_advantage[rows, column], theirs.pg_advantage, rtol=1e-5, atol=1e-5)
            start = end + 1


def test_hand_computed_with_truncation_and_clipping():
    # One column, three rows: row 0 is cut by a time limit, rows 1-2 are one episode.
    r = jnp.array([[1.0], [2.0], [3.0]])
    v = jnp.array([[0.5], [1.0], [1.5]])
    rho = np.array([2.0, 0.5, 1.0])
    a = dict(r_t=r, v_t=v, bootstrap_value=jnp.array([4.0]), terminated_t=jnp.zeros((3, 1), bool),
             truncated_t=jnp.array([[True], [False], [False]]), final_value_t=jnp.array([[10.0], [0.0], [0.0]]),
             log_rho_t=jnp.log(jnp.asarray(rho))[:, None])
    out = vtrace.vtrace_td_error_and_advantage(**a, gamma=0.5, rho_bar=1.0, c_bar=1.0, pg_rho_bar=1.0)
    # Row 2: rho 1: delta = 3 + 0.5 * 4 - 1.5 = 3.5; vs - v = 3.5.
    # Row 1: rho 0.5: delta = 0.5 * (2 + 0.5 * 1.5 - 1) = 0.875; c = 0.5: 0.875 + 0.5 * 0.5 * 3.5 = 1.75.
    # Row 0: rho clipped to 1, bootstraps from the final value 10 and nothing past it: 1 + 5 - 0.5 = 5.5.
    np.testing.assert_allclose(out.errors[:, 0], [5.5, 1.75, 3.5], rtol=1e-6)
    # q: row 0: 1 + 0.5 * 10 = 6; row 1: 2 + 0.5 * (vs_2 = 1.5 + 3.5) = 4.5; row 2: 3 + 0.5 * 4 = 5.
    np.testing.assert_allclose(out.q_estimate[:, 0], [6.0, 4.5, 5.0], rtol=1e-6)
    # pg advantage: min(1, rho) * (q - v).
    np.testing.assert_allclose(out.pg_advantage[:, 0], [5.5, 0.5 * 3.5, 3.5], rtol=1e-6)


# One column of three rows, no episode end, gamma 0.5: ratios 2 (row 0), 0.5 (row 1) and 3 (row 2).
# V(x) = [0.5, 1, 1.5], bootstrap 4, so the one-step TD errors r + 0.5 V(x') - V(x) are [1, 1.75, 3.5].
@pytest.mark.parametrize("bars,lambda_,errors,pg_advantage", [
    # rho_bar = c_bar = pg_rho_bar = 1: rows 0 and 2 clipped to 1, row 1 kept at 0.5.
    # e2 = 3.5; e1 = 0.5 * 1.75 + 0.5 * 0.5 * 3.5 = 1.75; e0 = 1 + 0.5 * 1 * 1.75 = 1.875.
    # q = r + 0.5 * vs_next = [1 + 0.5 * 2.75, 2 + 0.5 * 5, 3 + 0.5 * 4] = [2.375, 4.5, 5].
    ((1.0, 1.0, 1.0), 1.0, [1.875, 1.75, 3.5], [1.875, 0.5 * 3.5, 3.5]),
    # No clipping (bars 10): rho = c = [2, 0.5, 3].
    # e2 = 3 * 3.5 = 10.5; e1 = 0.875 + 0.25 * 10.5 = 3.5; e0 = 2 * 1 + 0.5 * 2 * 3.5 = 5.5.
    # q = [1 + 0.5 * 4.5, 2 + 0.5 * 12, 5] = [3.25, 8, 5]; A = ratio * (q - V).
    ((10.0, 10.0, 10.0), 1.0, [5.5, 3.5, 10.5], [2 * 2.75, 0.5 * 7.0, 3 * 3.5]),
    # Only c clipped (c_bar 1): e0 = 2 + 0.5 * 1 * 3.5 = 3.75; q and A as unclipped.
    ((10.0, 1.0, 10.0), 1.0, [3.75, 3.5, 10.5], [5.5, 3.5, 10.5]),
    # Only the policy-gradient weight clipped (pg_rho_bar 1): A = min(1, ratio) * (q - V).
    ((10.0, 10.0, 1.0), 1.0, [5.5, 3.5, 10.5], [2.75, 3.5, 3.5]),
    # lambda 0.5 scales c: c = [1, 0.25, 1.5]; e1 = 0.875 + 0.5 * 0.25 * 10.5 = 2.1875;
    # e0 = 2 + 0.5 * 1 * 2.1875 = 3.09375; q0 = 1 + 0.5 * (1 + 2.1875).
    ((10.0, 10.0, 10.0), 0.5, [3.09375, 2.1875, 10.5], [2 * (1 + 0.5 * 3.1875 - 0.5), 3.5, 10.5]),
])
def test_hand_computed_clipping_active_and_inactive(bars, lambda_, errors, pg_advantage):
    rho_bar, c_bar, pg_rho_bar = bars
    a = dict(r_t=jnp.array([[1.0], [2.0], [3.0]]), v_t=jnp.array([[0.5], [1.0], [1.5]]),
             bootstrap_value=jnp.array([4.0]), terminated_t=jnp.zeros((3, 1), bool),
             truncated_t=jnp.zeros((3, 1), bool), final_value_t=jnp.zeros((3, 1)),
             log_rho_t=jnp.log(jnp.array([[2.0], [0.5], [3.0]])))
    out = vtrace.vtrace_td_error_and_advantage(**a, gamma=0.5, lambda_=lambda_, rho_bar=rho_bar, c_bar=c_bar,
                                               pg_rho_bar=pg_rho_bar)
    np.testing.assert_allclose(out.errors[:, 0], errors, rtol=1e-6)
    np.testing.assert_allclose(out.pg_advantage[:, 0], pg_advantage, rtol=1e-6)


@pytest.mark.parametrize("rho_bar,pg_rho_bar,lambda_", [(1.0, 1.0, 1.0), (4.0, 2.0, 1.0), (1.0, 1.0, 0.7)])
def test_matches_rlax_far_off_policy(rho_bar, pg_rho_bar, lambda_):
    """Importance weights far from 1 (log-ratios with std 2: weights from ~0.005 to ~200)."""
    rlax = pytest.importorskip("rlax")
    a = _random(4, t=10, b=4)
    a["log_rho_t"] = np.random.default_rng(5).normal(scale=2.0, size=a["r_t"].shape).astype(np.float32)
    assert np.exp(np.abs(a["log_rho_t"])).max() > 20
    ours = vtrace.vtrace_td_error_and_advantage(**a, gamma=GAMMA, lambda_=lambda_, rho_bar=rho_bar,
                                                pg_rho_bar=pg_rho_bar)
    for column in range(a["r_t"].shape[1]):
        v = a["v_t"][:, column]
        v_next = np.append(v[1:], a["bootstrap_value"][column]).astype(np.float32)
        discount = (GAMMA * (1.0 - a["terminated_t"][:, column])).astype(np.float32)
        theirs = rlax.vtrace_td_error_and_advantage(
            jnp.asarray(v), jnp.asarray(v_next), jnp.asarray(a["r_t"][:, column]), jnp.asarray(discount),
            jnp.exp(a["log_rho_t"][:, column]), lambda_, rho_bar, pg_rho_bar)
        np.testing.assert_allclose(ours.errors[:, column], theirs.errors, rtol=1e-5, atol=1e-5)
        if lambda_ == 1.0:  # below 1, rlax mixes V(x') into q's bootstrap; ours takes v_s' whole
            np.testing.assert_allclose(ours.pg_advantage[:, column], theirs.pg_advantage, rtol=1e-5, atol=1e-5)


def test_impala_loss_weights_are_learner_over_behaviour():
    """The loss on a table 'network' equals the V-trace loss written out with rho = pi / mu."""
    rng = np.random.default_rng(6)
    t, n, actions = 5, 3, 3
    logits = rng.normal(scale=2.0, size=(t * n, actions)).astype(np.float32)
    value = rng.normal(size=t * n).astype(np.float32)
    params = {"logits": jnp.asarray(logits), "value": jnp.asarray(value)}
    action = rng.integers(0, actions, (t, n)).astype(np.int32)
    behaviour = rng.normal(scale=2.0, size=(t, n)).astype(np.float32) - 1.5  # log mu, far from log pi
    seqs = vtrace.Sequences(obs=jnp.zeros((t, n, 1)), action=jnp.asarray(action),
                            reward=jnp.asarray(rng.normal(size=(t, n))),
                            terminated=jnp.asarray(rng.random((t, n)) < 0.2), truncated=jnp.zeros((t, n), bool),
                            log_prob=jnp.asarray(behaviour), final_value=jnp.zeros((t, n)),
                            bootstrap_value=jnp.asarray(rng.normal(size=n)))
    config = vtrace.ImpalaConfig(gamma=0.9, rho_bar=1.0, c_bar=1.0, pg_rho_bar=1.0)
    _, m = vtrace.impala_loss(params, _table_apply, seqs, config)

    log_pi = np.asarray(Categorical(jnp.asarray(logits)).log_prob(jnp.asarray(action.reshape(-1)))).reshape(t, n)
    out = vtrace.vtrace_td_error_and_advantage(
        seqs.reward, value.reshape(t, n), seqs.bootstrap_value, seqs.terminated, seqs.truncated,
        seqs.final_value, log_pi - behaviour, 0.9)
    np.testing.assert_allclose(m["policy_loss"], -np.mean(np.asarray(out.pg_advantage) * log_pi), rtol=1e-5)
    np.testing.assert_allclose(m["value_loss"], 0.5 * np.mean(np.asarray(out.errors) ** 2), rtol=1e-5)
    assert float(m["rho_clipped_fraction"]) == pytest.approx(np.mean(log_pi - behaviour > 0))


def _table_apply(params, obs):
    """A 'network' whose outputs are its parameters: one row per sample."""
    return Categorical(params["logits"]), params["value"]


def test_on_policy_is_the_n_step_return():
    a = _random(2, t=10, b=4, truncations=True)
    a["log_rho_t"] = np.zeros_like(a["log_rho_t"])
    out = vtrace.vtrace_td_error_and_advantage(**a, gamma=GAMMA, rho_bar=2.0, c_bar=2.0)
    advantage, returns = gae_advantages(a["r_t"], a["v_t"], a["bootstrap_value"], a["terminated_t"],
                                        a["truncated_t"], a["final_value_t"], GAMMA, 1.0)
    np.testing.assert_allclose(out.errors + a["v_t"], returns, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.pg_advantage, advantage, rtol=1e-5, atol=1e-5)
    # And written out: in a column with no episode end, the discounted rewards to the end plus the bootstrap.
    clean = _random(3, t=6, b=1)
    clean["terminated_t"][:] = False
    clean["log_rho_t"] = np.zeros_like(clean["log_rho_t"])
    out = vtrace.vtrace_td_error_and_advantage(**clean, gamma=GAMMA)
    r, boot = clean["r_t"][:, 0], clean["bootstrap_value"][0]
    n_step = [sum(GAMMA ** (k - s) * r[k] for k in range(s, 6)) + GAMMA ** (6 - s) * boot for s in range(6)]
    np.testing.assert_allclose(out.errors[:, 0] + clean["v_t"][:, 0], n_step, rtol=1e-5)


def _setup(num_envs=8, num_steps=8, minibatches=1, importance_weights=True):
    network = make_network((4,), 2, True, (16,), "tanh")
    optimizer = optax.adam(1e-2)
    params = init_params(network, (4,), jnp.float32, jax.random.PRNGKey(0))
    state = init_train_state(params, optimizer, (4,))
    rng = np.random.default_rng(0)
    shape = (num_steps, num_envs)
    batch = Transition(rng.normal(size=shape + (4,)).astype(np.float32), rng.integers(0, 2, shape).astype(np.int32),
                       rng.normal(size=shape).astype(np.float32), rng.random(shape) < 0.1,
                       rng.random(shape) < 0.05, np.zeros(shape, np.float32),
                       np.log(rng.uniform(0.2, 0.8, shape)).astype(np.float32),
                       rng.normal(size=shape).astype(np.float32))
    config = vtrace.ImpalaConfig(minibatches=minibatches, importance_weights=importance_weights)
    return network, optimizer, state, batch, rng.normal(size=num_envs).astype(np.float32), config


def test_update_is_the_same_on_one_device_and_sharded_over_four():
    network, optimizer, state, batch, bootstrap, config = _setup()
    key = jax.random.PRNGKey(1)
    single, metrics = jax.jit(vtrace.make_update(network.apply, optimizer, config))(state, batch, bootstrap, key)
    mesh = parallel.make_mesh(jax.devices()[:4])
    update = vtrace.make_update(network.apply, optimizer, config, axis_names=(parallel.DATA_AXIS,))
    sharded = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P(), parallel.TIME_MAJOR_SPEC,
                                                                 P(parallel.DATA_AXIS), P()),
                                    out_specs=(P(), P())))
    split, split_metrics = sharded(state, batch, bootstrap, key)
    changed = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), single.params, state.params)
    assert max(jax.tree.leaves(changed)) > 1e-3  # it learned something
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), single.params, split.params)
    np.testing.assert_allclose(metrics["loss"], split_metrics["loss"], rtol=1e-4)
    assert int(split.step) == 1


def test_importance_weights_change_the_update_and_minibatches_split_environments():
    network, optimizer, state, batch, bootstrap, config = _setup(minibatches=4)
    key = jax.random.PRNGKey(1)
    corrected = jax.jit(vtrace.make_update(network.apply, optimizer, config))(state, batch, bootstrap, key)[0]
    ablation = vtrace.ImpalaConfig(minibatches=4, importance_weights=False)
    uncorrected = jax.jit(vtrace.make_update(network.apply, optimizer, ablation))(state, batch, bootstrap, key)[0]
    gap = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), corrected.params, uncorrected.params)
    assert max(jax.tree.leaves(gap)) > 1e-4
    with pytest.raises(ValueError, match="do not split"):
        vtrace.make_update(network.apply, optimizer, vtrace.ImpalaConfig(minibatches=3))(
            state, batch, bootstrap, key)
