"""Actor threads: step an envpool batch with the agent's `act`, `prepare` each trajectory, ship it to the learner.

Each actor thread owns its environments, its copy of the agent's acting state
(`Agent.acting_state`) on its actor device and a queue that holds one
trajectory. It refreshes the acting state once per trajectory, so every row of
a trajectory was acted on by the same version, and `prepare` sees that version
(through `Agent.for_rollout`, computed once per trajectory from the global
indices of the thread's environments).

An agent with `Agent.fresh_episodes` (ES) has the whole envpool batch reset
before each trajectory, and its trajectory ends once every environment's first
episode has (`TrajectoryBuilder`'s `first_episode`). envpool draws each
environment's episodes from that environment's own seed, so it cannot give two
environments the same episode: the index `fresh_episodes` maps environments to
is not used here, and every environment lives an episode of its own.
"""

from __future__ import annotations

import math
import queue
import threading
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from podracer.agent import Agent, Trajectory, same_for_every_env
from podracer.protocol import parallel
from podracer.sebulba.control import Control
from podracer.sebulba.envs import EnvPoolEnvs
from podracer.sebulba.params import ParamsStore
from podracer.sebulba.trajectory import TrajectoryBuilder
from podracer.session.timing import Timings


class Shipment(NamedTuple):
    """What an actor ships: a prepared trajectory already on the learner devices, and its bookkeeping."""

    batch: Any  # `prepare`'s time-major [T, N, ...] batch, split along N over the learner devices
    bootstrap: Any  # `prepare`'s [N, ...] data after the last row, split the same way
    policy_version: int  # updates applied to the acting state that acted
    actor_id: int
    episode_returns: np.ndarray  # episodes that ended while it was collected
    episode_lengths: np.ndarray
    dropped_steps: int
    reset_steps: int
    carry: Any = ()  # [N, ...] leaves: the carry before each column's first row, split like N


class ActorSettings(NamedTuple):
    rollout_len: int
    synchronous: bool  # wait for the update of each trajectory before acting again
    # Time the host-to-device copy, the policy and the device-to-host copy apart
    # (`--profile`). Each then waits for its result, which costs a dispatch per
    # step; otherwise acting is one call and `inference` includes both copies.
    time_transfers: bool = False


class Acting(NamedTuple):
    """An agent's acting as an actor thread calls it: jitted, and the shapes of what it records."""

    step: Callable  # (acting state, obs [M, ...], randomness [M, ...], carry [M, ...]) -> packed [M, K] uint32
    draw: Callable  # (key, calls, M) -> (key, randomness [calls, M, ...]): `Agent.draw` for `calls` steps ahead
    unpack: Callable  # packed (numpy) -> (action, carry, extras), numpy [M, ...] leaves
    prepare: Callable  # the agent's `prepare`, jitted: runs where the acting state is
    row: Any  # one environment's (obs, action, extras): shapes and dtypes
    carry: Any  # one environment's carry: shapes and dtypes (() without one)
    for_rollout: Callable | None = None  # `Agent.for_rollout`, jitted; None: the agent acts with its acting state
    rollout_state: Any = None  # what `act` and `prepare` are given: shapes and dtypes
    fresh_episodes: bool = False  # `Agent.fresh_episodes`: each trajectory is one new episode per environment


def _as_words(x: jax.Array) -> jax.Array:
    """`x` [M, ...] as uint32 columns [M, k], bit for bit (narrower types widened first)."""
    if x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        x = x.astype(jnp.uint32)
    elif jnp.issubdtype(x.dtype, jnp.integer):
        x = jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint32)
    else:
        x = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return x.reshape(x.shape[0], -1)


def _wide(dtype) -> np.dtype:
    """The 32-bit type `_as_words` read a leaf of `dtype` as."""
    if dtype == np.bool_ or np.issubdtype(dtype, np.unsignedinteger):
        return np.dtype(np.uint32)
    return np.dtype(np.int32 if np.issubdtype(dtype, np.integer) else np.float32)


def make_acting(agent: Agent, acting_state: Any, spec: Any, num_envs: int | None = None) -> Acting:
    """`agent`'s `Acting` for observations of `spec` (`obs_shape`, `obs_dtype`); `acting_state` may be abstract.

    `num_envs`, an actor thread's environments, is needed by an agent with its
    own `Agent.for_rollout` (what it returns may be sized by them).

    The randomness of many steps is drawn in one call (`draw`, as `Agent.draw`
    intends), and everything `act` returns comes back as one uint32 array:
    acting costs one dispatch and one device-to-host copy per step, whatever the
    agent returns. Drawing inside the step cost two XLA:CPU while loops of
    threefry per call, in a branch independent of the network's, which XLA:CPU
    at times ran on a second thread: a hand-off per step (CartPole's MLP on 120
    environments: 120-176 us of CPU a call, against 48 us with the noise drawn ahead).
    """

    def draw(key, calls: int, batch: int):
        key, draw_key = jax.random.split(key)
        randomness = jax.vmap(agent.draw)(jax.random.split(draw_key, calls * batch))
        return key, jax.tree.map(lambda x: x.reshape(calls, batch, *x.shape[1:]), randomness)

    for_rollout = None
    if agent.for_rollout is not same_for_every_env:
        if num_envs is None:
            raise ValueError("make_acting needs num_envs for an agent with its own for_rollout")
        for_rollout = jax.jit(agent.for_rollout)
        acting_state = jax.eval_shape(agent.for_rollout, acting_state,
                                      jax.ShapeDtypeStruct((num_envs,), jnp.int32))
    # An agent acting with parameters per environment is evaluated on a whole batch at once.
    rows = 1 if for_rollout is None else num_envs
    one_obs = jax.ShapeDtypeStruct((rows, *spec.obs_shape), spec.obs_dtype)
    carry = jax.eval_shape(lambda: agent.initial_carry(rows))
    one_draw = jax.eval_shape(lambda key: draw(key, 1, rows)[1], jax.random.PRNGKey(0))
    one_draw = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), one_draw)
    outputs = jax.eval_shape(agent.act, acting_state, one_obs, one_draw, carry)
    per_env = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree)
    action, _, extras = per_env(outputs)
    leaves, treedef = jax.tree.flatten(outputs)
    widths = [math.prod(x.shape[1:]) for x in leaves]
    wide = [_wide(x.dtype) for x in leaves]  # worked out once: unpacking runs every step

    def step(state, obs, randomness, carry):
        return jnp.concatenate([_as_words(x) for x in jax.tree.leaves(agent.act(state, obs, randomness, carry))],
                               axis=1)

    def unpack(packed: np.ndarray):
        out, column = [], 0
        for leaf, width, as_type in zip(leaves, widths, wide):
            words = packed[:, column:column + width].view(as_type)
            out.append(words.reshape(packed.shape[:1] + leaf.shape[1:]).astype(leaf.dtype, copy=False))
            column += width
        return jax.tree.unflatten(treedef, out)

    return Acting(jax.jit(step), jax.jit(draw, static_argnums=(1, 2)), unpack, jax.jit(agent.prepare),
                  (per_env(one_obs), action, extras), per_env(carry), for_rollout, acting_state,
                  agent.fresh_episodes is not None)


def trajectory_shapes(acting: Acting, rollout_len: int, num_envs: int) -> Trajectory:
    """The abstract `Trajectory` of `num_envs` environments an actor records with `acting`."""
    column = lambda tree, lead: jax.tree.map(lambda x: jax.ShapeDtypeStruct((*lead, *x.shape), x.dtype), tree)
    rows, columns = (rollout_len, num_envs), (num_envs,)
    (obs, action, extras), carry = column(acting.row, rows), column(acting.carry, rows)
    flag = jax.ShapeDtypeStruct(rows, jnp.bool_)
    return Trajectory(obs, action, jax.ShapeDtypeStruct(rows, jnp.float32), flag, flag, obs, extras, carry,
                      column(acting.row[0], columns), column(acting.carry, columns))


class Draws:
    """An actor thread's randomness (`Acting.draw`): drawn `calls` steps ahead on its device, given out step by step.

    One call draws for many steps; each block comes to the host once, and each
    step's share goes back with that step's observations.
    """

    def __init__(self, acting: Acting, key: jax.Array, calls: int, batch: int):
        self._acting, self._key, self._calls, self._batch = acting, key, calls, batch
        self._leaves, self._treedef, self._next = [], None, calls

    def next(self) -> Any:
        """The randomness of the next step: numpy [batch, ...] leaves."""
        if self._next == self._calls:
            self._key, block = self._acting.draw(self._key, self._calls, self._batch)
            leaves, self._treedef = jax.tree.flatten(block)
            self._leaves, self._next = [np.asarray(leaf) for leaf in leaves], 0
        self._next += 1
        return self._treedef.unflatten([leaf[self._next - 1] for leaf in self._leaves])


def thread_env_index(thread: int, num_envs: int) -> np.ndarray:
    """[num_envs] int32: the global indices of the environments of actor thread `thread` (numbered over
    every process), what `Agent.for_rollout` is given."""
    return thread * num_envs + np.arange(num_envs, dtype=np.int32)


def warm_up(acting: Acting, acting_state: Any, device: jax.Device, env_batch: int, num_envs: int,
            rollout_len: int) -> None:
    """Compile `acting`'s draw, step and `prepare` for `device` and an actor thread's shapes, before any
    thread starts (and before a profile's trace window opens)."""
    zeros = lambda tree: jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), tree)
    one_batch = lambda tree: jax.tree.map(lambda x: np.zeros((env_batch, *x.shape), x.dtype), tree)
    state = jax.device_put(acting_state, device)
    if acting.for_rollout is not None:
        state = acting.for_rollout(state, jax.device_put(thread_env_index(0, num_envs), device))
    draws = Draws(acting, jax.device_put(jax.random.PRNGKey(0), device), rollout_len, env_batch)
    jax.block_until_ready(acting.step(state, one_batch(acting.row[0]), draws.next(), one_batch(acting.carry)))
    jax.block_until_ready(acting.prepare(state, zeros(trajectory_shapes(acting, rollout_len, num_envs))))


def put_until_stopped(out: queue.Queue, item, stop: threading.Event, poll_s: float = 0.05) -> bool:
    """Block until `item` is queued (True) or `stop` is set (False)."""
    while not stop.is_set():
        try:
            out.put(item, timeout=poll_s)
            return True
        except queue.Full:
            continue
    return False


class Actor(NamedTuple):
    """One actor thread's world: one record rather than a dozen arguments.

    `learner_mesh` spans the learner devices of every process; a trajectory goes
    to this process's part of it, as this process's columns of the global batch.
    """

    actor_id: int
    envs: EnvPoolEnvs  # owned: closed when the thread ends
    settings: ActorSettings
    device: jax.Device
    acting: Acting  # `make_acting`
    store: ParamsStore
    out: queue.Queue  # holds one trajectory
    learner_mesh: Mesh
    key: jax.Array
    control: Control
    timings: Timings
    env_index: np.ndarray | None = None  # global indices of `envs` (`thread_env_index`); None: 0, 1, ...


def run_actor(actor: Actor) -> None:
    """The body of one actor thread: acts on its environments until `control` says stop."""
    (actor_id, envs, settings, device, acting, store, out, learner_mesh, key, control, timings, env_index) = actor
    try:
        fresh = acting.fresh_episodes
        builder = TrajectoryBuilder(settings.rollout_len, envs.num_envs, acting.row, acting.carry,
                                    first_episode=fresh)
        if env_index is None:
            env_index = thread_env_index(0, envs.num_envs)
        env_index = jax.device_put(env_index, device)
        # The carry per environment, kept on the host (envpool answers for any subset
        # of environments), and where the next observation starts an episode.
        carry = jax.tree.map(lambda x: np.zeros((envs.num_envs, *x.shape), x.dtype), acting.carry)
        starts = np.ones(envs.num_envs, bool)
        carry_in = ()  # the carry acted from this step
        has_carry = bool(jax.tree.leaves(carry))  # (skipped per step without one)
        batch_sharding = parallel.time_major_sharded(learner_mesh)
        column_sharding = parallel.sharded(learner_mesh)
        with timings.measure("actor_params_wait"):
            policy = store.wait_for(0, device, control.stop)
        # A resumed run's first policy has the checkpoint's version, not 0.
        first_version = policy.version if policy is not None else 0
        draws = Draws(acting, jax.device_put(key, device), settings.rollout_len, envs.batch_size)
        returns, lengths = [], []
        produced = 0

        def for_rollout(acting_state):
            if acting.for_rollout is None:
                return acting_state
            with timings.measure("for_rollout"):
                return acting.for_rollout(acting_state, env_index)

        state = for_rollout(policy.state) if policy is not None else None

        def act(obs, env_ids):
            if not settings.time_transfers:
                with timings.measure("inference"):
                    packed = np.asarray(acting.step(state, obs, draws.next(), carry_in))
            else:
                # Three steps timed apart (each waits for its result): the host-to-device
                # copy, the policy itself and the device-to-host copy of its output.
                with timings.measure("obs_to_device"):
                    on_device = jax.block_until_ready(jax.device_put((obs, draws.next(), carry_in), device))
                with timings.measure("inference"):
                    packed = jax.block_until_ready(acting.step(state, *on_device))
                with timings.measure("actions_to_host"):
                    packed = np.asarray(packed)
            action, carry_out, extras = acting.unpack(packed)
            # Committed once the actions are sent; a re-act starts from carry_in again.
            if has_carry:
                for leaf, new in zip(jax.tree.leaves(carry), jax.tree.leaves(carry_out)):
                    leaf[env_ids] = new
            return action, carry_out, extras

        envs.start()
        while policy is not None and not control.stop.is_set():
            with timings.measure("env_step"):
                step = envs.recv()
            builder.record_results(step.env_ids, step.reward, step.terminated, step.truncated)
            counted = step.episode_done
            if counted.any():
                if fresh:  # each environment's first episode only: the others are not learned from
                    counted = counted & ~builder.complete[step.env_ids]
                returns.append(step.episode_return[counted])
                lengths.append(step.episode_length[counted])
            obs_is_final = step.terminated | step.truncated
            if has_carry:
                starting = starts[step.env_ids]
                carry_in = jax.tree.map(
                    lambda c: np.where(starting.reshape(-1, *(1,) * (c.ndim - 1)), 0, c[step.env_ids]), carry)
                starts[step.env_ids] = obs_is_final  # the observation after a final one starts an episode
            action, carry_out, extras = act(step.obs, step.env_ids)
            builder.record_actions(step.env_ids, step.obs, obs_is_final, action, extras, carry_in, carry_out)
            if builder.full:
                collected = builder.take()
                with timings.measure("prepare"):
                    batch, bootstrap = acting.prepare(state, collected.trajectory)
                with timings.measure("actor_to_learner"):
                    batch = parallel.from_host(batch, batch_sharding)
                    bootstrap, initial = parallel.from_host((bootstrap, collected.initial_carry),
                                                            column_sharding)
                shipment = Shipment(batch, bootstrap, policy.version, actor_id, _concat(returns, np.float32),
                                    _concat(lengths, np.int32), collected.dropped_steps, collected.reset_steps,
                                    initial)
                returns, lengths = [], []
                with timings.measure("actor_queue_wait"):
                    if not put_until_stopped(out, shipment, control.stop):
                        break
                produced += 1
                with timings.measure("actor_params_wait"):
                    wanted = first_version + produced if settings.synchronous else 0
                    policy = store.wait_for(wanted, device, control.stop)
                if policy is None:
                    break
                state = for_rollout(policy.state)
                if fresh:  # the next trajectory starts new episodes everywhere
                    with timings.measure("env_step"):
                        envs.start()
                    builder.restart()
                    starts[:] = True
                    continue
                # The next trajectory starts from these observations, acted on by the new
                # acting state (from the same carry).
                action, carry_out, extras = act(step.obs, step.env_ids)
                builder.record_actions(step.env_ids, step.obs, obs_is_final, action, extras, carry_in,
                                       carry_out)
            with timings.measure("env_step"):
                envs.send(action, step.env_ids)
    finally:
        envs.close()


def _concat(chunks: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(chunks).astype(dtype) if chunks else np.zeros((0,), dtype)
