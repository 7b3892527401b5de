"""Legal-action masks: masked acting never takes an illegal action; illegal logits get no gradient."""

import jax
import jax.numpy as jnp
import pytest

from podracer.networks import make_network
from podracer.ppo import PPOConfig, make_act
from podracer.ppo.losses import Samples, ppo_loss

A, FEATURES, N = 5, 6, 512


def _batch(key):
    """Observations whose last A entries are a random mask with at least one legal action."""
    feature_key, mask_key = jax.random.split(key)
    legal = jax.random.bernoulli(mask_key, 0.4, (N, A)).at[:, 1].set(True)
    obs = jnp.concatenate([jax.random.normal(feature_key, (N, FEATURES)), legal.astype(jnp.float32)], -1)
    return obs, legal


def _tempting_params(network, obs):
    """Parameters whose policy all but always picks an action the masks mostly forbid (4)."""
    params = network.init(jax.random.PRNGKey(0), obs[:1])
    head = params["params"]["PolicyHead_0"]["Dense_0"]
    head["bias"] = head["bias"].at[4].set(50.0)
    return params


def test_masked_acting_never_takes_an_illegal_action():
    network = make_network((FEATURES + A,), A, True, action_mask=True)
    obs, legal = _batch(jax.random.PRNGKey(1))
    params = _tempting_params(network, obs)
    act = jax.jit(make_act(network.apply, PPOConfig()))
    mode = jax.jit(make_act(network.apply, PPOConfig(), deterministic=True))
    stats = None
    for seed in range(5):
        action, log_prob, _ = act(params, stats, obs, jax.random.split(jax.random.PRNGKey(seed), N))
        assert bool(jnp.all(legal[jnp.arange(N), action])), seed
        assert bool(jnp.all(jnp.isfinite(log_prob)))
    action = mode(params, stats, obs, jax.random.split(jax.random.PRNGKey(0), N))[0]
    assert bool(jnp.all(legal[jnp.arange(N), action]))
    assert bool(jnp.any(action == 4))  # where 4 is legal, the tempting action is taken


def test_masked_loss_gives_illegal_logits_no_gradient():
    network = make_network((FEATURES + A,), A, True, action_mask=True)
    obs, legal = _batch(jax.random.PRNGKey(2))
    legal = legal.at[:, 0].set(False)  # action 0 illegal everywhere
    obs = obs.at[:, FEATURES:].set(legal.astype(jnp.float32))
    params = network.init(jax.random.PRNGKey(0), obs[:1])
    action = jnp.argmax(jnp.where(legal, jax.random.uniform(jax.random.PRNGKey(3), (N, A)), -1.0), -1)
    samples = Samples(obs, action, jnp.full((N,), -1.0), jnp.zeros(N), jax.random.normal(jax.random.PRNGKey(4), (N,)),
                      jnp.ones(N))
    config = PPOConfig(ent_coef=0.01)
    grads = jax.grad(lambda p: ppo_loss(p, network.apply, samples, config)[0])(params)
    head = grads["params"]["PolicyHead_0"]["Dense_0"]
    assert float(jnp.abs(head["bias"][0])) == 0.0 and float(jnp.abs(head["kernel"][:, 0]).max()) == 0.0
    assert float(jnp.abs(head["bias"][1:]).min()) > 0.0  # the legal logits do learn
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_snake_rollout_takes_only_legal_actions():
    pytest.importorskip("jumanji")
    from podracer.envs.jax_envs import make_env

    env = make_env("jumanji:Snake-v1")
    network = make_network(env.spec.obs_shape, env.spec.action_dim, True, action_mask=env.spec.action_mask)
    n, steps = 16, 150
    state, ts = jax.vmap(env.reset)(jax.random.split(jax.random.PRNGKey(0), n))
    params = network.init(jax.random.PRNGKey(0), ts.obs[:1])
    act = make_act(network.apply, PPOConfig())

    @jax.jit
    def rollout(state, obs, key):
        def step(carry, key):
            state, obs = carry
            act_key, env_key = jax.random.split(key)
            action = act(params, None, obs, jax.random.split(act_key, n))[0]
            legal = obs[:, -env.spec.action_dim:][jnp.arange(n), action] > 0.5
            state, ts = jax.vmap(env.step)(jax.random.split(env_key, n), state, action)
            return (state, ts.obs), (legal, obs[:, -env.spec.action_dim:].min(-1) < 0.5)
        return jax.lax.scan(step, (state, obs), jax.random.split(key, steps))[1]

    legal, forbidding = rollout(state, ts.obs, jax.random.PRNGKey(1))
    assert bool(jnp.all(legal))
    assert float(jnp.mean(forbidding)) > 0.1  # the masks forbid moves (into walls, its body) often
