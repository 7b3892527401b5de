"""V-trace against rlax (an oracle only), hand-computed values and n-step returns; the IMPALA update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from podracer import vtrace
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
