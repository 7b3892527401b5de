"""Actor threads: step an envpool batch with the latest policy, ship trajectories to the learner.

Each actor thread owns its environments, its policy copy on its actor device
and a queue that holds one trajectory. It refreshes its parameters once per
trajectory, so every row of a trajectory carries the same policy version.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from podracer.networks import flatten_carry, is_recurrent, unflatten_carry
from podracer.protocol import parallel
from podracer.ppo import PPOConfig, make_act
from podracer.sebulba.control import Control
from podracer.sebulba.envs import EnvPoolEnvs
from podracer.sebulba.params import ParamsStore
from podracer.sebulba.trajectory import TrajectoryBuilder
from podracer.session.timing import Timings
from podracer.types import Transition


class Trajectory(NamedTuple):
    """What an actor ships: experience already on the learner devices, and its bookkeeping."""

    batch: Transition  # [T, N, ...], split along N over the learner devices
    bootstrap_value: jax.Array  # [N], split the same way
    policy_version: int  # updates applied to the parameters that acted
    actor_id: int
    episode_returns: np.ndarray  # episodes that ended while it was collected
    episode_lengths: np.ndarray
    dropped_steps: int
    reset_steps: int
    carry: jax.Array | tuple = ()  # [N, K] flat recurrent state at each column's first row, split like N


class ActorSettings(NamedTuple):
    rollout_len: int
    synchronous: bool  # wait for the update of each trajectory before acting again
    # Time the host-to-device copy, the policy and the device-to-host copy apart
    # (`--profile`). Each then waits for its result, which costs a dispatch per
    # step; otherwise acting is one call and `inference` includes both copies.
    time_transfers: bool = False


def make_policy_step(apply_fn: Callable, ppo_config: PPOConfig, network=None) -> Callable:
    """Jitted `(params, obs_stats, obs, key) -> (key, packed)`; `unpack_policy_output` reads `packed`.

    The key is split on the device and the action, log-probability and value
    come back as one float32 [M, action_size + 2] array: acting costs one
    dispatch and one device-to-host copy per step.

    For a recurrent `network` it is `(params, obs_stats, obs, key, carry)`, with
    `carry` the flat [M, K] state to act from (already zeroed where an episode
    starts), and the new state follows as K more columns of `packed`.
    """
    if network is not None and is_recurrent(network):
        act = make_act(apply_fn, ppo_config, recurrent=True)

        def recurrent_step(params, obs_stats, obs, key, carry):
            key, act_key = jax.random.split(key)
            no_reset = jnp.zeros(obs.shape[:1], bool)
            action, log_prob, value, carry = act(params, obs_stats, obs,
                                                 jax.random.split(act_key, obs.shape[0]),
                                                 unflatten_carry(network, carry), no_reset)
            columns = action.reshape(action.shape[0], -1).astype(jnp.float32)
            return key, jnp.concatenate([columns, log_prob[:, None], value[:, None],
                                         flatten_carry(carry)], axis=1)

        return jax.jit(recurrent_step)
    act = make_act(apply_fn, ppo_config)

    def policy_step(params, obs_stats, obs, key):
        key, act_key = jax.random.split(key)
        action, log_prob, value = act(params, obs_stats, obs, jax.random.split(act_key, obs.shape[0]))
        columns = action.reshape(action.shape[0], -1).astype(jnp.float32)
        return key, jnp.concatenate([columns, log_prob[:, None], value[:, None]], axis=1)

    return jax.jit(policy_step)


def unpack_policy_output(packed: np.ndarray, discrete: bool,
                         carry_width: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(action, log_prob, value) from `make_policy_step`'s packed array (discrete actions are exact in float32).

    With `carry_width` K, the last K columns (a recurrent policy's new state) are left out.
    """
    if carry_width:
        packed = packed[:, :-carry_width]
    action = packed[:, 0].astype(np.int32) if discrete else packed[:, :-2]
    return action, packed[:, -2], packed[:, -1]


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
    policy_step: Callable  # `make_policy_step`
    store: ParamsStore
    out: queue.Queue  # holds one trajectory
    learner_mesh: Mesh
    key: jax.Array
    control: Control
    timings: Timings
    carry_width: int = 0  # a recurrent policy's flat state per environment (0: feed-forward)


def run_actor(actor: Actor) -> None:
    """The body of one actor thread: acts on its environments until `control` says stop."""
    (actor_id, envs, settings, device, policy_step, store, out, learner_mesh, key, control,
     timings, carry_width) = actor
    try:
        spec = envs.spec
        action_shape, action_dtype = ((), np.int32) if spec.discrete else ((spec.action_dim,), np.float32)
        builder = TrajectoryBuilder(settings.rollout_len, envs.num_envs, spec.obs_shape,
                                    spec.obs_dtype, action_shape, action_dtype, carry_width)
        # A recurrent policy's state per environment, kept on the host (envpool answers
        # for any subset of environments), and where the next observation starts an episode.
        carry = np.zeros((envs.num_envs, carry_width), np.float32)
        starts = np.ones(envs.num_envs, bool)
        state_in = None  # the state acted from this step, when recurrent
        batch_sharding = parallel.time_major_sharded(learner_mesh)
        bootstrap_sharding = parallel.sharded(learner_mesh)
        with timings.measure("actor_params_wait"):
            policy = store.wait_for(0, device, control.stop)
        # A resumed run's first policy has the checkpoint's version, not 0.
        first_version = policy.version if policy is not None else 0
        key = jax.device_put(key, device)
        returns, lengths = [], []
        produced = 0

        def act(obs, env_ids):
            nonlocal key
            state = (state_in,) if carry_width else ()
            if not settings.time_transfers:
                with timings.measure("inference"):
                    key, packed = policy_step(policy.params, policy.obs_stats, obs, key, *state)
                    packed = np.asarray(packed)
            else:
                # Three steps timed apart (each waits for its result): the host-to-device
                # copy, the policy itself and the device-to-host copy of its output.
                with timings.measure("obs_to_device"):
                    obs, state = jax.block_until_ready(jax.device_put((obs, state), device))
                with timings.measure("inference"):
                    key, packed = jax.block_until_ready(
                        policy_step(policy.params, policy.obs_stats, obs, key, *state))
                with timings.measure("actions_to_host"):
                    packed = np.asarray(packed)
            if carry_width:  # committed once the actions are sent; a re-act starts from state_in again
                carry[env_ids] = packed[:, -carry_width:]
            return unpack_policy_output(packed, spec.discrete, carry_width)

        envs.start()
        while policy is not None and not control.stop.is_set():
            with timings.measure("env_step"):
                step = envs.recv()
            builder.record_results(step.env_ids, step.reward, step.terminated, step.truncated)
            if step.episode_done.any():
                returns.append(step.episode_return[step.episode_done])
                lengths.append(step.episode_length[step.episode_done])
            obs_is_final = step.terminated | step.truncated
            if carry_width:
                state_in = np.where(starts[step.env_ids, None], 0.0, carry[step.env_ids])
                starts[step.env_ids] = obs_is_final  # the observation after a final one starts an episode
            action, log_prob, value = act(step.obs, step.env_ids)
            builder.record_actions(step.env_ids, step.obs, obs_is_final, action, log_prob, value, state_in)
            if builder.full:
                rollout = builder.take()
                with timings.measure("actor_to_learner"):
                    batch = parallel.from_host(rollout.batch, batch_sharding)
                    bootstrap = parallel.from_host(rollout.bootstrap_value, bootstrap_sharding)
                    initial = (parallel.from_host(rollout.carry, bootstrap_sharding)
                               if carry_width else ())
                trajectory = Trajectory(batch, bootstrap, policy.version, actor_id,
                                        _concat(returns, np.float32), _concat(lengths, np.int32),
                                        rollout.dropped_steps, rollout.reset_steps, initial)
                returns, lengths = [], []
                with timings.measure("actor_queue_wait"):
                    if not put_until_stopped(out, trajectory, control.stop):
                        break
                produced += 1
                with timings.measure("actor_params_wait"):
                    wanted = first_version + produced if settings.synchronous else 0
                    policy = store.wait_for(wanted, device, control.stop)
                if policy is None:
                    break
                # The next trajectory starts from these observations, acted on by the new policy
                # (from the same state).
                action, log_prob, value = act(step.obs, step.env_ids)
                builder.record_actions(step.env_ids, step.obs, obs_is_final, action, log_prob, value,
                                       state_in)
            with timings.measure("env_step"):
                envs.send(action, step.env_ids)
    finally:
        envs.close()


def _concat(chunks: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(chunks).astype(dtype) if chunks else np.zeros((0,), dtype)

