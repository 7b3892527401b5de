"""Behaviour cloning: the loss by hand, and a warm start from an expert dataset that a
random policy cannot match (CartPole: random ~22, threshold 200)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from podracer import bc, data
from podracer.envs.jax_envs import make_env
from podracer.anakin.train import train_ppo
from podracer.data.train_hooks import HOOKS
from podracer.orchestrate.cli import main, parse_configs
from podracer.distributions import Categorical
from podracer.networks import make_network
from podracer.session.session import handing
from podracer.types import TrainState


def table_apply(params, obs):
    """A 'network' whose outputs are its parameters: one row per sample."""
    return Categorical(params["logits"]), params["value"]


def test_bc_loss_hand_computed():
    params = {"logits": jnp.log(jnp.array([[0.5, 0.5], [0.2, 0.8]])), "value": jnp.array([1.0, 0.0])}
    batch = bc.Demonstrations(obs=jnp.zeros((2, 1)), action=jnp.array([0, 1]),
                              return_to_go=jnp.array([2.0, 0.5]))
    loss, metrics = bc.bc_loss(params, table_apply, batch, bc.BCConfig(value_coef=0.5, ent_coef=0.1))
    log_likelihood = (np.log(0.5) + np.log(0.8)) / 2
    value_loss = 0.5 * ((1.0 - 2.0) ** 2 + (0.0 - 0.5) ** 2) / 2
    entropy = -(np.log(0.5) + 0.2 * np.log(0.2) + 0.8 * np.log(0.8)) / 2
    assert float(metrics["log_likelihood"]) == pytest.approx(log_likelihood, abs=1e-6)
    assert float(metrics["value_loss"]) == pytest.approx(value_loss, abs=1e-6)
    assert float(loss) == pytest.approx(-log_likelihood + 0.5 * value_loss - 0.1 * entropy, abs=1e-6)


def test_bc_update_is_pure_and_compiles_once():
    optimizer = optax.sgd(0.5)
    update = jax.jit(bc.make_bc_update(table_apply, optimizer, bc.BCConfig(batch_size=4, value_coef=0.0)))
    params = {"logits": jnp.zeros((4, 2)), "value": jnp.zeros(4)}
    state = TrainState(params, optimizer.init(params), None, jnp.zeros((), jnp.int32))
    # Every sample demonstrates action 1; the table has one row per drawn sample.
    demos = bc.Demonstrations(jnp.zeros((10, 1)), jnp.ones(10, jnp.int32), jnp.zeros(10))
    first, _ = update(state, demos, jax.random.PRNGKey(0))
    again, _ = update(state, demos, jax.random.PRNGKey(0))
    np.testing.assert_array_equal(first.params["logits"], again.params["logits"])
    for key in range(1, 4):
        state, metrics = update(state, demos, jax.random.PRNGKey(key))
    assert update._cache_size() == 1
    assert int(state.step) == 3
    assert (state.params["logits"][:, 1] > state.params["logits"][:, 0]).all()
    np.testing.assert_array_equal(state.params["value"], 0.0)  # value_coef=0 leaves it alone


def _controller(params, obs, keys):
    """Push the cart towards where the pole is falling: ~460 on CartPole."""
    action = (obs[:, 2] + obs[:, 3] > 0).astype(jnp.int32)
    return action, jnp.zeros(obs.shape[0])


def test_warm_start_from_expert_dataset_reaches_what_random_cannot(tmp_path):
    env = make_env("CartPole-v1")
    expert = jax.device_get(jax.jit(data.make_recorder(env, _controller, 8))(None, jax.random.PRNGKey(0)))
    assert expert.metadata["episode_return"].mean() >= 400
    # Time-limit truncation is not termination: episodes cut at 500 are not terminal.
    lengths = expert.metadata["episode_length"]
    np.testing.assert_array_equal(expert.steps["is_terminal"].any(axis=1), lengths < 500)
    with data.DatasetWriter(str(tmp_path / "expert"), data.step_spec_for_env(env.spec),
                            metadata={"env": "CartPole-v1", "policy": "controller"}) as writer:
        writer.add_episodes(expert)

    # lr=0: PPO changes nothing, so what the run scores and records is the cloned policy.
    configs = parse_configs([
        "--total-steps=8192", "--num-envs=8", "--rollout-len=64", "--updates-per-call=16", "--lr=0",
        "--epochs=1", "--minibatches=1",
        f"--run-dir={tmp_path / 'run'}", f"--init-from-dataset={tmp_path / 'expert'}", "--bc-steps=600",
        f"--record-dataset={tmp_path / 'cloned'}", "--record-episodes=6"])
    with handing(HOOKS):  # as the command line and podracer.train hand them to every run
        summary, runner = train_ppo(configs, devices=jax.devices()[:1])
    assert summary["bc_demonstrations"] == int(lengths.sum())
    assert summary["dataset_episodes"] == 6
    assert summary["dataset_return_mean"] >= 200, summary
    assert summary["episode_return_mean"] >= 150, summary  # a running mean biased to short episodes

    # The recorded dataset holds the cloned policy's own log-probabilities of its actions.
    cloned = data.load_episodes(str(tmp_path / "cloned"))
    assert data.dataset_metadata(str(tmp_path / "cloned"))["env"] == "CartPole-v1"
    np.testing.assert_allclose(cloned.metadata["episode_return"].mean(), summary["dataset_return_mean"])
    acting = cloned.mask & ~cloned.steps["is_last"]
    net = configs.network
    network = make_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete, net.hidden,
                           net.activation)
    params = jax.device_get(runner.train.params)
    log_prob = jax.jit(lambda obs, action: network.apply(params, obs)[0].log_prob(action))
    np.testing.assert_allclose(log_prob(cloned.steps["observation"][acting],
                                        cloned.steps["action"][acting]),
                               cloned.steps["policy_log_prob"][acting], rtol=1e-5, atol=1e-5)


def test_cli_rejects_bad_dataset_flags_in_one_line(tmp_path, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "file").write_text("keep me")
    cases = {
        f"--record-dataset={used}": "not empty",
        "--record-episodes=0": "--record-episodes must be > 0",
        "--bc-steps=-1": "--bc-steps must be > 0",
        f"--init-from-dataset={tmp_path / 'nowhere'}": "does not exist",
    }
    for flag, fragment in cases.items():
        assert main([flag, "--total-steps=1000", f"--run-dir={tmp_path / 'run'}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and fragment in err, err
    assert (used / "file").read_text() == "keep me"
