"""Sebulba's actors act with the acting state of the version they report: a real actor thread,
real envpool CartPole, and an agent of the contract (not an actor-critic) whose actions are
known in advance."""

import queue
import threading

import jax
import jax.numpy as jnp
import numpy as np

from podracer.agent import Agent, Rollout
from podracer.protocol import parallel
from podracer.sebulba.actor import Actor, ActorSettings, make_acting, run_actor
from podracer.sebulba.control import Control
from podracer.sebulba.envs import EnvPoolEnvs
from podracer.sebulba.params import ParamsStore
from podracer.session.timing import Timings


def fixed_action_agent(rollout_len: int) -> Agent:
    """An agent whose state names the one action it takes, and whose batch is what it did."""

    def act(state, obs, randomness, carry):
        return jnp.broadcast_to(state["action"], obs.shape[:1]), carry, ()

    def prepare(state, trajectory):
        return {"action": trajectory.action, "obs": trajectory.obs}, ()

    return Agent(lambda key: {"action": jnp.int32(0)}, act, prepare, None, Rollout(rollout_len),
                 draw=lambda key: key, initial_carry=lambda num_envs: ())


def always(action: int):
    return {"action": jnp.int32(action)}


def test_each_trajectory_is_acted_by_the_version_it_reports():
    rollout_len, num_envs = 8, 4
    envs = EnvPoolEnvs("CartPole-v1", num_envs, num_envs, 1, seed=0)
    device = jax.devices()[0]
    store, out, control = ParamsStore([device]), queue.Queue(maxsize=1), Control()
    store.publish(always(0), 0)
    agent = fixed_action_agent(rollout_len)
    actor = Actor(0, envs, ActorSettings(rollout_len, synchronous=True), device,
                  make_acting(agent, always(0), envs.spec), store, out,
                  parallel.make_mesh([device]), jax.random.PRNGKey(1), control, Timings())
    thread = threading.Thread(target=run_actor, args=(actor,), daemon=True)
    thread.start()
    try:
        seen = []
        for version, action in [(0, 0), (1, 1), (2, 0), (3, 1)]:
            if version:  # the synchronous actor waits for this version before acting again
                store.publish(always(action), version)
            shipment = out.get(timeout=120)
            actions = np.asarray(jax.device_get(shipment.batch["action"]))
            seen.append((shipment.policy_version, np.unique(actions).tolist()))
            assert shipment.policy_version == version, seen
            assert actions.shape == (rollout_len, num_envs)
            np.testing.assert_array_equal(actions, action, err_msg=str(seen))
    finally:
        control.stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
