"""Anakin: acting and learning in one jitted program, sharded over every device.

Each device steps its slice of the environment batch, the PPO update averages
gradients over the mesh's data axis with `lax.pmean`, and `updates_per_call`
updates run inside one `lax.scan` so the host only wakes up to log.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

from podracer.protocol import parallel
from podracer.anakin.env import EnvState, GymnaxEnv, TimeStep
from podracer.bounds import POSITIVE, bounded, check_bounds
from podracer.distributions import sampling_noise
from podracer.errors import PodracerError
from podracer.networks import init_params, initial_carry, is_recurrent, reset_carry
from podracer.ppo import PPOConfig, Transition, init_train_state, make_act, policy_inputs
from podracer.ppo import make_update as ppo_make_update
from podracer.types import TrainState


@dataclasses.dataclass(frozen=True)
class AnakinConfig:
    """How Anakin produces experience; sizes are global (over every device)."""

    num_envs: int = bounded(64, POSITIVE)
    """Environments stepped in parallel, split evenly over every device."""
    rollout_len: int = bounded(64, POSITIVE)
    """Environment steps per environment between two updates."""
    updates_per_call: int = bounded(8, POSITIVE)
    """Updates fused into one jitted call; the host syncs (and logs) between calls."""

    def __post_init__(self):
        check_bounds(self)


class RunnerState(NamedTuple):
    train: TrainState  # replicated
    env_state: EnvState  # [num_envs, ...], sharded
    obs: jax.Array  # [num_envs, ...], sharded: the observation to act on next
    key: jax.Array  # replicated
    carry: Any = ()  # a recurrent network's state before acting on `obs` ([num_envs, ...] leaves, sharded)


class AnakinLayout(NamedTuple):
    """Sizes derived from the config and the mesh, never written back into either."""

    num_devices: int
    envs_per_device: int
    steps_per_update: int  # global env steps


def make_layout(config: AnakinConfig, ppo_config: PPOConfig, num_devices: int,
                recurrent: bool = False, agents_sharded: bool = False) -> AnakinLayout:
    """Sizes on a mesh of `num_devices` (every process's); refuses, in one line, a split that cannot work.

    `recurrent`: minibatches keep whole environment sequences. `agents_sharded`: a
    population's agents are split over the devices, each agent's environments all on
    its own device (`podracer.anakin.population`). The TPU preflight calls it
    with a slice's device count before the slice exists.
    """
    envs_per_device = config.num_envs if agents_sharded else parallel.split_evenly(
        config.num_envs, num_devices, "environments", "--num-envs")
    multiple = ppo_config.minibatches * (1 if agents_sharded else num_devices)
    fix = f"make --num-envs a multiple of {multiple} or lower --minibatches"
    problem = (ppo_config.sequence_problem(envs_per_device, fix) if recurrent
               else ppo_config.batch_problem(config.rollout_len, envs_per_device))
    if problem:
        raise PodracerError(problem)
    return AnakinLayout(num_devices, envs_per_device, config.num_envs * config.rollout_len)


def _pack_rows(tree) -> tuple[tuple[jax.Array, ...], Callable]:
    """Every [B, ...] leaf of `tree` as columns of one [B, k] array per dtype.

    Returns those arrays and `unpack(arrays) -> tree`. The rollout carries its
    environments packed: XLA:CPU copies each loop-carried buffer that a step both
    reads and rewrites, once per step, so CartPole's nine carried arrays cost nine
    copy kernels a step and its two packed ones two (with the slices and the
    concatenation fused into the step's own kernels).
    """
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(jnp.dtype(leaf.dtype), []).append(i)
    shapes = [leaf.shape[1:] for leaf in leaves]
    packed = tuple(jnp.concatenate([leaves[i].reshape(leaves[i].shape[0], -1) for i in group], axis=1)
                   for group in groups.values())

    def unpack(arrays):
        out = [None] * len(leaves)
        for array, group in zip(arrays, groups.values()):
            column = 0
            for i in group:
                width = int(np.prod(shapes[i], dtype=int))
                out[i] = array[:, column:column + width].reshape(array.shape[:1] + shapes[i])
                column += width
        return jax.tree.unflatten(treedef, out)

    return packed, unpack


def _env_keys(key: jax.Array, num_local: int, axis_names) -> jax.Array:
    """One key per environment, from its global index: independent of the device split."""
    index = parallel.axis_offset(num_local, axis_names) + jnp.arange(num_local)
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(index)


class Experience(NamedTuple):
    """What acting hands to learning: one rollout and the keys and counts that go with it."""

    batch: Transition  # [T, B, ...], sharded along B
    bootstrap_value: jax.Array  # [B], sharded
    update_key: jax.Array  # replicated
    episodes: dict  # episodes that ended during the rollout: count, return and length sums (psum'ed)
    carry: Any = ()  # a recurrent network's state before each environment's first row, sharded


def _make_steps(env: GymnaxEnv, network, optimizer: optax.GradientTransformation,
                ppo_config: PPOConfig, config: AnakinConfig, mesh: Mesh,
                make_update: Callable = ppo_make_update, agents_sharded: bool = False):
    """Per-device `init(key)`, `act(runner) -> (runner, experience)` and `learn(train, experience)`.

    `make_update` builds the learner's update from `ppo_config` (PPO's, or any
    with its signature: `podracer.vtrace.make_update` with an `ImpalaConfig`).
    With `agents_sharded` (a population split over the devices) each device
    holds whole agents: every environment of an agent, and no collectives.

    One update is `act` then `learn`; Anakin fuses them into one program,
    profile mode compiles them apart. Returns them with the mesh axes they use.
    """
    recurrent = is_recurrent(network)
    if recurrent and make_update is not ppo_make_update:
        raise PodracerError("--network=lstm/gru trains with --algo=ppo only; use --network=mlp for this algorithm")
    layout = make_layout(config, ppo_config, mesh.devices.size, recurrent, agents_sharded)
    # On one device there is nothing to average: no collectives at all (XLA keeps
    # even single-participant all-reduces, and each costs a rendezvous).
    axes = (parallel.DATA_AXIS,) if layout.num_devices > 1 and not agents_sharded else ()
    apply_fn = network.apply
    update = make_update(apply_fn, optimizer, ppo_config, axis_names=axes)
    act_fn = make_act(apply_fn, ppo_config, presampled=True, recurrent=recurrent)
    local_envs = layout.envs_per_device

    def _rollout_draws(key):
        # The randomness of every (step, environment) of a rollout, drawn at once as
        # one vectorised computation outside the sequential loop, from one key per
        # (step, env) pair: [T, B, ...] action noise and environment draws.
        step_keys = jax.random.split(key, config.rollout_len)
        env_keys = jax.vmap(lambda k: _env_keys(k, local_envs, axes))(step_keys)
        action_keys, env_step_keys = jnp.moveaxis(jax.vmap(jax.vmap(jax.random.split))(env_keys), 2, 0)
        noise = jax.vmap(jax.vmap(lambda k: sampling_noise(k, env.spec.discrete, env.spec.action_dim)))
        return noise(action_keys), jax.vmap(jax.vmap(env.draw))(env_step_keys)

    def init(key):
        param_key, env_key, run_key = jax.random.split(key, 3)
        params = init_params(network, env.spec.obs_shape, env.spec.obs_dtype, param_key)
        train = init_train_state(params, optimizer, env.spec.obs_shape)
        env_state, timestep = jax.vmap(env.reset)(_env_keys(env_key, local_envs, axes))
        return RunnerState(train, env_state, timestep.obs, run_key, initial_carry(network, local_envs))

    def env_step(params, obs_stats, carry, draws):
        env_state, obs = carry
        action_noise, env_draws = draws
        # The value is left out (XLA drops the critic from the loop): it is computed
        # for the whole rollout at once afterwards.
        action, log_prob, _ = act_fn(params, obs_stats, obs, action_noise)
        env_state, ts = env.step_batch(env_draws, env_state, action)
        return (env_state, ts.obs), (obs, action, log_prob, ts)

    def recurrent_env_step(params, obs_stats, carry, draws):
        env_state, obs, core = carry
        action_noise, env_draws = draws
        no_reset = jnp.zeros(obs.shape[:1], bool)  # `core` was reset where the last step ended
        action, log_prob, value, core = act_fn(params, obs_stats, obs, action_noise, core, no_reset)
        env_state, ts = env.step_batch(env_draws, env_state, action)
        done = jnp.logical_or(ts.terminated, ts.truncated)
        # The state that saw the final observation (its value bootstraps a truncation), then a fresh one.
        return (env_state, ts.obs, reset_carry(core, done)), (obs, action, log_prob, value, ts, core)

    def act_recurrent(runner: RunnerState) -> tuple[RunnerState, Experience]:
        # The carry goes through the loop beside the packed environments; values come
        # out of the loop (the core has to run there anyway), and the values of final
        # observations, with the state that saw them, in one batched step after it.
        key, rollout_key, update_key = jax.random.split(runner.key, 3)
        train = runner.train
        packed, unpack = _pack_rows((runner.env_state, runner.obs))

        def step(carry, draws):
            packed, core = carry
            (env_state, obs, core), out = recurrent_env_step(train.params, train.obs_stats,
                                                             (*unpack(packed), core), draws)
            return (_pack_rows((env_state, obs))[0], core), out

        (packed, core), (obs_t, action, log_prob, value, ts, core_t) = jax.lax.scan(
            step, (packed, runner.carry), _rollout_draws(rollout_key))
        env_state, obs = unpack(packed)
        num_steps = config.rollout_len

        def value_of(o, c):  # one step from state c on observations o: [N, ...]
            (_, v), _ = apply_fn(train.params, policy_inputs(o, train.obs_stats, ppo_config)[None], c,
                                 jnp.zeros((1, o.shape[0]), bool))
            return v[0]

        flat = lambda x: x.reshape((num_steps * local_envs,) + x.shape[2:])
        final_value = value_of(flat(ts.final_obs), jax.tree.map(flat, core_t)).reshape(num_steps, local_envs)
        bootstrap_value = value_of(obs, core)
        batch = Transition(obs_t, action, ts.reward, ts.terminated, ts.truncated, value, log_prob,
                           final_value)
        return (RunnerState(train, env_state, obs, key, core),
                Experience(batch, bootstrap_value, update_key, _episodes(ts), runner.carry))

    def _episodes(ts: TimeStep) -> dict:
        done = jnp.logical_or(ts.terminated, ts.truncated)
        return parallel.psum({
            "episodes": done.sum(),
            "episode_return_sum": jnp.where(done, ts.episode_return, 0.0).sum(),
            "episode_length_sum": jnp.where(done, ts.episode_length, 0).sum(),
        }, axes)

    def act(runner: RunnerState) -> tuple[RunnerState, Experience]:
        key, rollout_key, update_key = jax.random.split(runner.key, 3)
        train = runner.train
        packed, unpack = _pack_rows((runner.env_state, runner.obs))

        def step(packed, draws):
            carry, out = env_step(train.params, train.obs_stats, unpack(packed), draws)
            return _pack_rows(carry)[0], out

        packed, (obs_t, action, log_prob, ts) = jax.lax.scan(step, packed, _rollout_draws(rollout_key))
        env_state, obs = unpack(packed)
        ts: TimeStep
        # The behaviour parameters' values of every observation acted on, of those
        # that ended truncated episodes and of the next one, each in one batched call:
        # one [T * B] matrix product costs less than T small ones inside the loop.
        value_of = lambda o: apply_fn(train.params, policy_inputs(o, train.obs_stats, ppo_config))[1]
        value, final_value, bootstrap_value = value_of(obs_t), value_of(ts.final_obs), value_of(obs)
        batch = Transition(obs_t, action, ts.reward, ts.terminated, ts.truncated, value, log_prob,
                           final_value)
        return (RunnerState(train, env_state, obs, key),
                Experience(batch, bootstrap_value, update_key, _episodes(ts)))

    def learn(train: TrainState, experience: Experience):
        carry = (experience.carry,) if recurrent else ()
        train, metrics = update(train, experience.batch, experience.bootstrap_value,
                                experience.update_key, *carry)
        # For the NaN guard: checked on the host before anything is saved.
        metrics["params_finite"] = jnp.all(jnp.stack(
            [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(train.params)]))
        metrics.update(experience.episodes)
        return train, metrics

    return init, act_recurrent if recurrent else act, learn, axes


_RUNNER_SPECS = RunnerState(train=P(), env_state=P(parallel.DATA_AXIS), obs=P(parallel.DATA_AXIS),
                            key=P(), carry=P(parallel.DATA_AXIS))
_EXPERIENCE_SPECS = Experience(batch=parallel.TIME_MAJOR_SPEC, bootstrap_value=P(parallel.DATA_AXIS),
                               update_key=P(), episodes=P(), carry=P(parallel.DATA_AXIS))


def make_anakin(
    env: GymnaxEnv,
    network,
    optimizer: optax.GradientTransformation,
    ppo_config: PPOConfig,
    config: AnakinConfig,
    mesh: Mesh,
    make_update: Callable = ppo_make_update,
) -> tuple[Callable[[jax.Array], RunnerState], Callable[[RunnerState], tuple[RunnerState, Any]]]:
    """Build the jitted, sharded `init(key) -> runner` and `train(runner) -> (runner, metrics)`.

    `train` runs `config.updates_per_call` updates and donates its input; the
    update is `make_update`'s (PPO's by default, IMPALA's with an `ImpalaConfig`). Its
    metrics are stacked over those updates: the PPO losses plus `episodes`,
    `episode_return_sum` and `episode_length_sum` of episodes that ended.
    """
    init, act, learn, axes = _make_steps(env, network, optimizer, ppo_config, config, mesh, make_update)

    def train_step(runner: RunnerState, _):
        runner, experience = act(runner)
        train, metrics = learn(runner.train, experience)
        return runner._replace(train=train), metrics

    def train(runner):
        return jax.lax.scan(train_step, runner, length=config.updates_per_call)

    # With no axes there is no collective to prove replication by; one device is replicated anyway.
    check = bool(axes) and getattr(env, "check_vma", True)  # see suites.base.SuiteEnv
    init_sharded = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=_RUNNER_SPECS,
                                         check_vma=check), compiler_options=parallel.run_once_options(mesh))
    train_sharded = jax.jit(jax.shard_map(train, mesh=mesh, in_specs=(_RUNNER_SPECS,),
                                          out_specs=(_RUNNER_SPECS, P()), check_vma=check),
                            donate_argnums=0, compiler_options=parallel.actor_critic_options(mesh))
    return init_sharded, train_sharded


def make_anakin_phases(
    env: GymnaxEnv,
    network,
    optimizer: optax.GradientTransformation,
    ppo_config: PPOConfig,
    config: AnakinConfig,
    mesh: Mesh,
    make_update: Callable = ppo_make_update,
) -> tuple[Callable, Callable]:
    """One update as two jitted, sharded programs, for profile mode to time apart.

    `act(runner) -> (runner, experience)` steps the environments for one
    rollout; `learn(train, experience) -> (train, metrics)` is the PPO update.
    Together they compute what one step of `make_anakin`'s `train` computes,
    with one host round trip in between instead of none.
    """
    _, act, learn, axes = _make_steps(env, network, optimizer, ppo_config, config, mesh, make_update)
    check = bool(axes) and getattr(env, "check_vma", True)  # see suites.base.SuiteEnv
    act_sharded = jax.jit(jax.shard_map(act, mesh=mesh, in_specs=(_RUNNER_SPECS,),
                                        out_specs=(_RUNNER_SPECS, _EXPERIENCE_SPECS), check_vma=check),
                          compiler_options=parallel.actor_critic_options(mesh))
    learn_sharded = jax.jit(jax.shard_map(learn, mesh=mesh, in_specs=(P(), _EXPERIENCE_SPECS),
                                          out_specs=(P(), P()), check_vma=check),
                            compiler_options=parallel.actor_critic_options(mesh))
    return act_sharded, learn_sharded
