"""Anakin: acting and learning in one jitted program, sharded over every device, for any agent.

Each device steps its slice of the environment batch with the agent's `act`
(`podracer.agent.Agent`), its `learn` averages over the mesh's data axis, and
`updates_per_call` updates run inside one `lax.scan` so the host only wakes up
to log. One builder (`make_programs`) makes every program a run needs: one
agent's, a population's (the same program vmapped over an agent axis) and, for
`--profile`, acting and learning compiled apart.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from podracer.agent import Agent, AgentFor, Trajectory, all_finite, first_episode
from podracer.protocol import parallel
from podracer.envs.jax_envs import EnvState, GymnaxEnv, TimeStep
from podracer.bounds import POSITIVE, bounded, check_bounds
from podracer.errors import PodracerError
from podracer.networks import reset_carry
from podracer import pbt as pbt_lib
from podracer.pbt import PBTConfig


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
    """One agent's run between calls; a population's has a leading agent axis [A, ...] on every leaf."""

    train: Any  # the agent's state (`Agent.init`), replicated
    env_state: EnvState  # [num_envs, ...], sharded
    obs: jax.Array  # [num_envs, ...], sharded: the observation to act on next
    key: jax.Array  # replicated
    carry: Any = ()  # a recurrent network's state before acting on `obs` ([num_envs, ...] leaves, sharded)
    hparams: Any = ()  # a population's swept settings (name -> [A] float32); () for one agent
    pbt: Any = ()  # a population's `podracer.pbt.PBTState` with --pbt; () otherwise


class AnakinLayout(NamedTuple):
    """Sizes derived from the config and the mesh, never written back into either."""

    num_devices: int
    envs_per_device: int
    steps_per_update: int  # global env steps


def make_layout(config: AnakinConfig, algo_config: Any, num_devices: int,
                recurrent: bool = False, agents_sharded: bool = False) -> AnakinLayout:
    """Sizes on a mesh of `num_devices` (every process's); refuses, in one line, a split that cannot work.

    `algo_config` is the agent's section (its `batch_problem`, and a recurrent
    PPO's `sequence_problem`: minibatches keep whole environment sequences).
    `agents_sharded`: a population's agents are split over the devices, each
    agent's environments all on its own device (`loop.make_programs`). The TPU
    preflight calls it with a slice's device count before the slice exists.
    """
    envs_per_device = config.num_envs if agents_sharded else parallel.split_evenly(
        config.num_envs, num_devices, "environments", "--num-envs")
    if recurrent:
        multiple = algo_config.minibatches * (1 if agents_sharded else num_devices)
        problem = algo_config.sequence_problem(
            envs_per_device, f"make --num-envs a multiple of {multiple} or lower --minibatches")
    else:
        problem = algo_config.batch_problem(config.rollout_len, envs_per_device)
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


def _env_index(num_local: int, axis_names) -> jax.Array:
    """The global indices [num_local] of this device's environments."""
    return parallel.axis_offset(num_local, axis_names) + jnp.arange(num_local)


def _env_keys(key: jax.Array, num_local: int, axis_names, index: jax.Array | None = None) -> jax.Array:
    """One key per environment, from its global index (or `index`): independent of the device split."""
    index = _env_index(num_local, axis_names) if index is None else index
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(index)


class Experience(NamedTuple):
    """What acting hands to learning: one rollout and the keys and counts that go with it."""

    batch: Any  # the agent's `prepare`d batch (an actor-critic's `Transition` [T, B, ...]), sharded along B
    bootstrap_value: Any  # `prepare`'s per-environment data after the last row ([B]), sharded
    update_key: jax.Array  # replicated
    episodes: dict  # episodes that ended during the rollout: count, return and length sums (psum'ed)
    carry: Any = ()  # a recurrent network's state before each environment's first row, sharded


class Steps(NamedTuple):
    """One agent's per-device functions, to run inside `shard_map`: one update is `act` then `learn`."""

    init: Callable  # key -> RunnerState
    act: Callable  # RunnerState -> (RunnerState, Experience)
    learn: Callable  # (agent state, Experience) -> (agent state, metrics)


def make_steps(env: GymnaxEnv, agent: Agent, num_envs: int, axes: tuple[str, ...]) -> Steps:
    """`agent`'s `Steps` on `num_envs` environments of `env` per device, split over the mesh `axes`."""
    rollout_len = agent.experience.length
    fresh = agent.fresh_episodes

    def rollout_draws(key):
        # The randomness of every (step, environment) of a rollout, drawn at once as
        # one vectorised computation outside the sequential loop, from one key per
        # (step, env) pair: [T, B, ...] acting randomness and environment draws. With
        # fresh episodes the environments' keys come from their episodes' indices, and
        # their draws are made in the step (`env.draw_restarting`: no reset to draw).
        step_keys = jax.random.split(key, rollout_len)
        split = lambda index=None: jnp.moveaxis(jax.vmap(jax.vmap(jax.random.split))(
            jax.vmap(lambda k: _env_keys(k, num_envs, axes, index))(step_keys)), 2, 0)
        action_keys, env_step_keys = split()
        randomness = jax.vmap(jax.vmap(agent.draw))(action_keys)
        if fresh is not None:
            return randomness, split(fresh(_env_index(num_envs, axes)))[1]
        return randomness, jax.vmap(jax.vmap(env.draw))(env_step_keys)

    def start_episodes(runner: RunnerState, key: jax.Array) -> RunnerState:
        """`runner` with every environment at the start of a new episode (`Agent.fresh_episodes`)."""
        episode_keys = _env_keys(key, num_envs, axes, fresh(_env_index(num_envs, axes)))
        # Typed per-device as the state it replaces (a reset's step counters are constants).
        env_state, timestep = jax.vmap(env.reset)(episode_keys)
        env_state, obs = parallel.vary((env_state, timestep.obs), axes)
        return runner._replace(env_state=env_state, obs=obs, carry=agent.initial_carry(num_envs))

    def init(key):
        agent_key, env_key, run_key = jax.random.split(key, 3)
        env_state, timestep = jax.vmap(env.reset)(_env_keys(env_key, num_envs, axes))
        return RunnerState(agent.init(agent_key), env_state, timestep.obs, run_key,
                           agent.initial_carry(num_envs))

    def episodes(ts: TimeStep) -> dict:
        done = jnp.logical_or(ts.terminated, ts.truncated)
        if fresh is not None:  # each environment's one episode: its rows up to its first end
            first = first_episode(ts)
            ended = jnp.any(done, axis=0)
            return parallel.psum({
                "episodes": ended.sum(),
                "episode_return_sum": jnp.where(ended, jnp.sum(jnp.where(first, ts.reward, 0.0), 0), 0.0).sum(),
                "episode_length_sum": jnp.where(ended, jnp.sum(first, 0), 0).sum(),
            }, axes)
        return parallel.psum({
            "episodes": done.sum(),
            "episode_return_sum": jnp.where(done, ts.episode_return, 0.0).sum(),
            "episode_length_sum": jnp.where(done, ts.episode_length, 0).sum(),
        }, axes)

    def act(runner: RunnerState) -> tuple[RunnerState, Experience]:
        key, rollout_key, update_key = jax.random.split(runner.key, 3)
        if fresh is not None:
            rollout_key, episodes_key = jax.random.split(rollout_key)
            runner = start_episodes(runner, episodes_key)
        first_obs, first_state = runner.obs, runner.env_state
        state = agent.for_rollout(agent.acting_state(runner.train), _env_index(num_envs, axes))
        packed, unpack = _pack_rows((runner.env_state, runner.obs))

        def step(carried, draws):
            packed, carry = carried
            env_state, obs = unpack(packed)
            randomness, env_draws = draws
            if fresh is not None:  # an episode that ends starts again where the rollout began
                env_draws = jax.vmap(env.draw_restarting)(env_draws, first_obs, first_state)
            action, carry, extras = agent.act(state, obs, randomness, carry)
            env_state, ts = env.step_batch(env_draws, env_state, action)
            # The carry that saw the final observation (its value bootstraps a truncation), then a fresh one.
            done = jnp.logical_or(ts.terminated, ts.truncated)
            next_carry = reset_carry(carry, done)
            return (_pack_rows((env_state, ts.obs))[0], next_carry), (obs, action, extras, ts, carry)

        (packed, carry), (obs_t, action, extras, ts, carry_t) = jax.lax.scan(
            step, (packed, runner.carry), rollout_draws(rollout_key))
        env_state, obs = unpack(packed)
        ts: TimeStep
        trajectory = Trajectory(obs_t, action, ts.reward, ts.terminated, ts.truncated, ts.final_obs, extras,
                                carry_t, obs, carry)
        batch, bootstrap = agent.prepare(state, trajectory)
        return (runner._replace(env_state=env_state, obs=obs, key=key, carry=carry),
                Experience(batch, bootstrap, update_key, episodes(ts), runner.carry))

    def learn(state, experience: Experience):
        state, metrics = agent.learn(state, experience.batch, experience.bootstrap_value,
                                     experience.update_key, experience.carry)
        # For the NaN guard: checked on the host before anything is saved.
        metrics["params_finite"] = all_finite(agent.learned_state(state))
        metrics.update(experience.episodes)
        return state, metrics

    return Steps(init, act, learn)



_RUNNER_SPECS = RunnerState(train=P(), env_state=P(parallel.DATA_AXIS), obs=P(parallel.DATA_AXIS),
                            key=P(), carry=P(parallel.DATA_AXIS), hparams=P(), pbt=P())
_EXPERIENCE_SPECS = Experience(batch=parallel.TIME_MAJOR_SPEC, bootstrap_value=P(parallel.DATA_AXIS),
                               update_key=P(), episodes=P(), carry=P(parallel.DATA_AXIS))


def _with_agent_axis(specs, sharded: bool):
    """One agent's specs for values with a leading agent axis: split over the devices, or on every one."""
    lift = lambda spec: P(parallel.DATA_AXIS) if sharded else P(None, *spec)
    return jax.tree.map(lift, specs, is_leaf=lambda x: isinstance(x, P))


class Programs(NamedTuple):
    """A run's jitted, sharded programs; `act` and `learn` together compute one update of `train`."""

    init: Callable  # key -> runner (a population's: (keys [A], hparams[, key with --pbt]) -> runner)
    train: Callable  # runner -> (runner, metrics [U, ...] (a population's [U, A, ...])); donates its input
    act: Callable  # runner -> (runner, experience): for `--profile`
    learn: Callable  # (agent state, experience) -> (agent state, metrics): for `--profile`


def make_programs(env: GymnaxEnv, agent_for: AgentFor, config: AnakinConfig, mesh: Mesh,
                  population: bool = False, sharded: bool = False, pbt: PBTConfig | None = None) -> Programs:
    """The one builder of Anakin's programs, for any agent: `agent_for(hparams, axis_names) -> Agent`.

    One agent: `init(key)`, and `train` runs `config.updates_per_call` updates
    (the agent's `act` then `learn`) in one `lax.scan`. A `population` is that
    program vmapped over a leading agent axis, each agent built with its swept
    settings (`runner.hparams`, traced); `sharded` splits the agents over the
    devices (each device steps all environments of its agents, and no
    collective runs), otherwise every device holds every agent and the
    environments are split as for one agent. With `pbt`, a population's
    `init` also takes the run's key (`init(keys, hparams, key)`) for its PBT
    state, and `train` ends with a PBT step (`podracer.pbt.after_call`) whose
    donors [U, A] (the same each update) and settings after it come out as the
    metrics `pbt_donor` and `pbt_settings`. `act` and `learn` are the same
    steps compiled apart, for profile mode (`podracer.anakin.profiled`).
    """
    num_devices = mesh.devices.size
    num_envs = config.num_envs if sharded else parallel.split_evenly(
        config.num_envs, num_devices, "environments", "--num-envs")
    # On one device there is nothing to average: no collectives at all (XLA keeps
    # even single-participant all-reduces, and each costs a rendezvous).
    axes = (parallel.DATA_AXIS,) if num_devices > 1 and not sharded else ()
    steps = lambda hparams: make_steps(env, agent_for(hparams, axes), num_envs, axes)

    def fused(runner: RunnerState):
        one = steps(runner.hparams or {})

        def train_step(runner, _):
            runner, experience = one.act(runner)
            train, metrics = one.learn(runner.train, experience)
            return runner._replace(train=train), metrics

        return jax.lax.scan(train_step, runner, length=config.updates_per_call)

    runner_specs, experience_specs, metric_specs = _RUNNER_SPECS, _EXPERIENCE_SPECS, P()
    if not population:
        init, train = steps({}).init, fused
        act = lambda runner: steps({}).act(runner)
        learn = lambda state, experience: steps({}).learn(state, experience)
    else:
        # Metrics come out update-major [U, A, ...], as each agent's scan stacks them:
        # agent-major, XLA:CPU would transpose every metric into a copy kernel of its
        # own, whose fully unrolled loop took longer to compile than most of the program.
        runner_specs, experience_specs = (_with_agent_axis(s, sharded) for s in (_RUNNER_SPECS, _EXPERIENCE_SPECS))
        metric_specs = _with_agent_axis(P(), sharded)
        experience_specs = (experience_specs, runner_specs.hparams)  # a learner needs its agent's settings

        def init(keys, hparams, key=None):
            # One agent after the other, not vmapped: the orthogonal initialisers' QR
            # factorisations, batched, run as a parallel map on XLA:CPU's thread pool,
            # which deadlocked with several devices' programs holding its threads.
            runner = jax.lax.map(steps({}).init, keys)._replace(hparams=hparams)
            return runner if pbt is None else runner._replace(pbt=pbt_lib.init_state(key, keys.shape[0]))

        def train(runner):
            runner, metrics = jax.vmap(fused, out_axes=(0, 1))(runner)
            if pbt is None:
                return runner, metrics
            pbt_state, train_state, hparams, donor = pbt_lib.after_call(
                pbt, runner.pbt, runner.train, runner.hparams, metrics["episodes"],
                metrics["episode_return_sum"], (parallel.DATA_AXIS,) if sharded else ())
            every_update = lambda x: jnp.broadcast_to(x, metrics["episodes"].shape)
            metrics.update(pbt_donor=every_update(donor), pbt_settings=jax.tree.map(every_update, hparams))
            return runner._replace(train=train_state, hparams=hparams, pbt=pbt_state), metrics

        def act(runner):
            runner, experience = jax.vmap(lambda r: steps(r.hparams).act(r))(runner)
            return runner, (experience, runner.hparams)

        def learn(state, experience_and_hparams):
            return jax.vmap(lambda s, e, h: steps(h).learn(s, e))(state, *experience_and_hparams)

    # With no axes there is no collective to prove replication by; one device is replicated anyway.
    # Environments and agents built on libraries not written for the check say so
    # (suites.base.SuiteEnv, agent.Agent.check_vma).
    agent = agent_for({}, axes)
    check = bool(axes) and getattr(env, "check_vma", True) and agent.check_vma
    options = parallel.training_options(mesh, agent.quick_cpu_compile)
    sharded_jit = lambda fn, in_specs, out_specs, **kw: jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check), **kw)
    init_in = P() if not population else (runner_specs.key, runner_specs.hparams) + ((P(),) if pbt else ())
    return Programs(
        init=sharded_jit(init, init_in, runner_specs, compiler_options=parallel.run_once_options(mesh)),
        train=sharded_jit(train, (runner_specs,), (runner_specs, P(None, *metric_specs)),
                          donate_argnums=0, compiler_options=options),
        act=sharded_jit(act, (runner_specs,), (runner_specs, experience_specs), compiler_options=options),
        learn=sharded_jit(learn, (runner_specs.train, experience_specs), (runner_specs.train, metric_specs),
                          compiler_options=options))
