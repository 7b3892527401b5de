"""Sebulba runs any agent of the contract: actors act with the acting state of the version they
report, and the learner keeps what acting does not read. Real actor threads, real envpool
CartPole, and agents (not actor-critics) whose actions are known in advance."""

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
from podracer.sebulba.learner import Learning, make_learn_step, run_learner
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


def switching_agent(rollout_len: int) -> Agent:
    """Acts `state["action"]` and switches it at every update; its state also keeps a buffer of
    the mean action of every batch it learned from, which acting never reads."""

    def init(key):
        return {"action": jnp.int32(0), "buffer": jnp.full(4, -1.0), "updates": jnp.int32(0)}

    def learn(state, batch, bootstrap, key, carry):
        mean_action = jax.lax.pmean(batch["action"].mean(), parallel.DATA_AXIS)
        buffer = state["buffer"].at[state["updates"]].set(mean_action)
        return ({"action": 1 - state["action"], "buffer": buffer, "updates": state["updates"] + 1},
                {"mean_action": mean_action})

    agent = fixed_action_agent(rollout_len)
    return agent._replace(init=init, learn=learn, acting_state=lambda state: {"action": state["action"]})


def test_the_learner_keeps_the_state_acting_does_not_read_and_publishes_the_rest():
    rollout_len, num_envs, updates = 8, 4, 3
    agent = switching_agent(rollout_len)
    devices = jax.devices()[:2]  # one actor device, one learner device
    mesh = parallel.make_mesh(devices[1:])
    state = jax.device_put(agent.init(None), parallel.replicated(mesh))
    store, out, control, timings = ParamsStore(devices[:1]), queue.Queue(maxsize=1), Control(), Timings()
    store.publish(agent.acting_state(state), 0)
    envs = EnvPoolEnvs("CartPole-v1", num_envs, num_envs, 1, seed=0)
    actor = Actor(0, envs, ActorSettings(rollout_len, synchronous=True), devices[0],
                  make_acting(agent, agent.acting_state(state), envs.spec), store, out, mesh,
                  jax.random.PRNGKey(1), control, timings)
    thread = threading.Thread(target=run_actor, args=(actor,), daemon=True)
    seen = []
    learning = Learning(make_learn_step(agent.learn, mesh), [out], store, updates, jax.random.PRNGKey(0),
                        control, timings, lambda update, shipments, metrics: seen.append(metrics["mean_action"]),
                        acting_state=agent.acting_state)
    thread.start()
    try:
        final = run_learner(learning, state)
    finally:
        control.stop.set()
        thread.join(timeout=30)
    assert seen == [0.0, 1.0, 0.0]  # each update learned from the version it published last
    np.testing.assert_array_equal(jax.device_get(final["buffer"]), [0.0, 1.0, 0.0, -1.0])
    assert {d.id for d in final["buffer"].devices()} == {devices[1].id}
    published = store.wait_for(updates, devices[0], control.stop)
    assert set(published.state) == {"action"} and int(published.state["action"]) == 1
