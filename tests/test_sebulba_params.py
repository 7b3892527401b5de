"""Sebulba's actors act with the parameters of the version they report: a real actor thread,
real envpool CartPole, policies published whose actions are known in advance."""

import queue
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax

from podracer.distributions import Categorical
from podracer.ppo import PPOConfig, init_train_state
from podracer.protocol import parallel
from podracer.sebulba.actor import Actor, ActorSettings, make_policy_step, run_actor
from podracer.sebulba.control import Control
from podracer.sebulba.envs import EnvPoolEnvs
from podracer.sebulba.params import ParamsStore
from podracer.session.timing import Timings


def fixed_action_apply(params, obs):
    """A policy that ignores its observation: the same logits for every environment."""
    logits = jnp.broadcast_to(params["logits"], (obs.shape[0],) + params["logits"].shape)
    return Categorical(logits), jnp.zeros(obs.shape[0])


def always(action: int):
    """A policy that takes `action` with probability 1 - 2e-9 (the other logit 20 lower)."""
    logits = jnp.full(2, -10.0).at[action].set(10.0)
    return init_train_state({"logits": logits}, optax.sgd(0.0), (4,))


def test_each_trajectory_is_acted_by_the_version_it_reports():
    rollout_len, num_envs = 8, 4
    envs = EnvPoolEnvs("CartPole-v1", num_envs, num_envs, 1, seed=0)
    device = jax.devices()[0]
    store, out, control = ParamsStore([device]), queue.Queue(maxsize=1), Control()
    store.publish(always(0), 0)
    actor = Actor(0, envs, ActorSettings(rollout_len, synchronous=True), device,
                  make_policy_step(fixed_action_apply, PPOConfig()), store, out,
                  parallel.make_mesh([device]), jax.random.PRNGKey(1), control, Timings())
    thread = threading.Thread(target=run_actor, args=(actor,), daemon=True)
    thread.start()
    try:
        seen = []
        for version, action in [(0, 0), (1, 1), (2, 0), (3, 1)]:
            if version:  # the synchronous actor waits for this version before acting again
                store.publish(always(action), version)
            trajectory = out.get(timeout=120)
            actions = np.asarray(jax.device_get(trajectory.batch.action))
            seen.append((trajectory.policy_version, np.unique(actions).tolist()))
            assert trajectory.policy_version == version, seen
            np.testing.assert_array_equal(actions, action, err_msg=str(seen))
    finally:
        control.stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
