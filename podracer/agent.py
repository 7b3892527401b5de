"""The agent contract: what every agent gives the architectures, as a record of pure functions.

An agent is one folder (`podracer/ppo/`, `podracer/vtrace/`) with a frozen
config and a `make_agent(...)` that returns an `Agent`: how to initialise its
state, how to act on a batch of observations, which experience it wants, and
how to learn from it. The architectures run any `Agent` and never name the
algorithm: Anakin's one program builder (`podracer.anakin.loop`) steps the
environments with `act`, hands the rollout to `prepare` and `learn`, vmaps the
whole program over a population's agents and compiles `act` and `learn` apart
for `--profile`. Sebulba's actor threads (`podracer.sebulba.actor`) call `act`
on their actor device with the latest `acting_state` the learner published,
build the same `Trajectory` from the host environments' stream, `prepare` it
there and ship the batch to the learner devices, which run `learn`
(`podracer.sebulba.learner`) on the whole state. Both run the optional
`for_rollout` and `fresh_episodes` (ES).

Every function is pure and jittable, and `make_agent` takes `axis_names` as
`ppo.make_update` does: inside `shard_map` the architecture passes the mesh
axes its environments are split over, and `learn` averages over them. Batches
are [B, ...] over this device's environments, rollouts time-major [T, B, ...].
`make_agent` is also told `num_envs`, how many environments the agent steps
over every device: an agent that keeps something per environment in its state
(MuZero's replay of each environment's history) sizes it at `init`, before
any rollout shows it.

A new agent plugs in by writing its own `make_agent` (a sketch: a REINFORCE
agent on a network `apply(params, obs) -> (distribution, value)`):

    def make_agent(network, optimizer, config, spec, rollout_len, axis_names=(), *, num_envs=None):
        def init(key):
            params = network.init(key, jnp.zeros((1, *spec.obs_shape), spec.obs_dtype))
            return TrainState(params, optimizer.init(params), init_running_stats(spec.obs_shape),
                              jnp.zeros((), jnp.int32))

        def act(state, obs, key, carry):
            dist, _ = network.apply(state.params, obs)
            action = jax.vmap(lambda d, k: d.sample(k))(dist, key)
            return action, carry, ()

        def prepare(state, rollout):
            return rollout, ()                                   # learn from the raw rollout

        def learn(state, rollout, bootstrap, key, carry):
            grads = jax.grad(reinforce_loss)(state.params, network.apply, rollout, config)
            grads = jax.lax.pmean(grads, axis_names) if axis_names else grads
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            return state._replace(params=params, opt_state=opt_state, step=state.step + 1), {}

        return Agent(init, act, prepare, learn, Rollout(rollout_len),
                     draw=lambda key: key, initial_carry=lambda num_envs: ())

`act` and `prepare` see only `acting_state(state)`: the part of the state
acting needs (by default all of it). Sebulba copies it to every actor device
after each update, so an agent leaves out what would be costly to ship and
acting never reads (PPO: its optimizer state; an agent with a replay buffer:
the buffer, which then stays on the learner devices).

Which experience an agent wants is a value the architecture reads: today a
`Rollout` of T steps of every environment, learned from once. An agent that
replays (DQN, SAC, MuZero) keeps wanting rollouts (short ones, of a few
steps) and keeps its buffer in its state, adding each rollout in `learn`
before sampling from it; a buffer too large to replicate gets an experience
type of its own here, which the architecture places beside the environments.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp


class Rollout(NamedTuple):
    """The experience an on-policy agent learns from: `length` consecutive steps of every environment."""

    length: int


class Trajectory(NamedTuple):
    """What the architecture recorded while `act` stepped the environments; rows are time-major [T, B, ...].

    Row t holds the observation acted on, the action, what `act` returned
    beside it (`extras`, e.g. the log-probability) and what the environment
    answered. `final_obs` is the observation that ended the episode at row t
    (the one a truncation bootstraps from); `carry` the acting carry after row
    t, before the architecture zeroed it where the episode ended.
    """

    obs: jax.Array
    action: jax.Array
    reward: jax.Array  # [T, B]
    terminated: jax.Array  # [T, B]
    truncated: jax.Array  # [T, B]
    final_obs: jax.Array
    extras: Any
    carry: Any  # () for an agent without one
    next_obs: jax.Array  # [B, ...]: the observation after the last row
    next_carry: Any  # [B, ...] leaves: the carry to act on `next_obs` with


def first_episode(trajectory: Trajectory) -> jax.Array:
    """[T, B] bool: the rows of each environment's first episode in `trajectory`, its end included.

    What an agent with `Agent.fresh_episodes` learns from (the rest of its rollout
    is ignored). From the index of the first end, not a cumulative sum: XLA:CPU
    runs a cumulative sum over T rows as a window of T, T * T work per column.
    """
    done = jnp.logical_or(trajectory.terminated, trajectory.truncated)
    rows = done.shape[0]
    first_end = jnp.where(jnp.any(done, axis=0), jnp.argmax(done, axis=0), rows)
    return jnp.arange(rows)[:, None] <= first_end[None, :]


def same_for_every_env(acting_state, env_index):
    """`Agent.for_rollout`'s default: every environment acts with the acting state itself."""
    del env_index
    return acting_state


class Agent(NamedTuple):
    """An agent as pure functions; `make_agent(..., axis_names)` of each agent folder builds one.

    `state` is the agent's own pytree of arrays (parameters, optimizer state,
    observation statistics, step counter; later a replay buffer); the
    architecture carries it, checkpoints it and checks it is finite. `act` and
    `prepare` are given `acting_state(state)`, `learn` the whole state.
    """

    init: Callable[[jax.Array], Any]
    """`init(key) -> state`."""
    act: Callable
    """`act(acting_state, obs [B, ...], randomness [B, ...], carry) -> (action [B, ...], carry, extras)`: one step
    of B environments. `carry` is the recurrent state before acting (`()` without one), zeroed by
    the architecture where an episode ended."""
    prepare: Callable
    """`prepare(acting_state, trajectory) -> (batch, bootstrap)`: what `learn` is given, computed with the
    acting state right after the rollout (e.g. the behaviour values of every row, in one batch)."""
    learn: Callable
    """`learn(state, batch, bootstrap, key, carry) -> (state, metrics)`, where `carry` is the acting
    carry before the rollout's first row; metrics are scalars averaged over `axis_names`."""
    experience: Rollout
    """The experience `learn` wants."""
    draw: Callable[[jax.Array], Any]
    """`draw(key) -> randomness` of one environment's one action, drawn for a whole rollout ahead of
    the loop (e.g. a sample's noise); `lambda key: key` to draw inside `act`."""
    initial_carry: Callable[[int], Any]
    """`initial_carry(num_envs) -> carry` of fresh episodes (zeros); `()` for a feed-forward agent."""
    acting_state: Callable[[Any], Any] = lambda state: state
    """`acting_state(state) -> the part of it that `act` and `prepare` read`: what Sebulba's learner
    publishes to its actors after every update (default: the whole state)."""
    for_rollout: Callable[[Any, jax.Array], Any] = same_for_every_env
    """`for_rollout(acting_state, env_index [B]) -> what `act` and `prepare` are given in its place` for
    one rollout, computed once before it from the global indices of this device's environments
    (default: the acting state itself). An agent whose environments act with different parameters
    (ES: each environment its population member's perturbed ones) draws them here once, not at
    every step."""
    fresh_episodes: Callable[[jax.Array], jax.Array] | None = None
    """With it, every rollout is one new episode per environment, as ES evaluates a member: before
    each rollout the architecture resets the environments (and `initial_carry`), environment `i`'s
    reset and steps drawn from the index `fresh_episodes(i)` instead of `i`, so environments given
    one index live the same episode (ES: both members of an antithetic pair). What follows an
    episode's end within the rollout is for the agent to ignore (`prepare` masks it), so an ended
    episode restarts from the rollout's first state rather than drawing a new reset at every step.
    Sebulba resets its envpool batch before each rollout and ends the rollout once every
    environment's first episode has ended (or run its T rows); envpool draws each environment's
    episodes from that environment's own seed, so there the index is not used and every
    environment lives an episode of its own (both members of an ES pair play different ones).
    `None` (default): episodes run on across rollouts."""
    learned_state: Callable[[Any], Any] = lambda state: state
    """`learned_state(state) -> the part of it that learning computes`: what the architecture checks is
    finite after every update, for the NaN guard (default: all of it). An agent with a replay buffer
    leaves the buffer out: it holds what the environments answered, never a learned number, and reading
    all of it after every update costs more than a small network's gradient step."""
    check_vma: bool = True
    """Whether `jax.shard_map` may check replication through `act` and `learn`. A library not written
    for the check is run without it (mctx's search loops start from constants and carry per-device
    data); a test then proves one device and several train alike."""
    quick_cpu_compile: bool = True
    """Whether Anakin may compile the agent's training program with LLVM's optimisation level 1 on
    CPU (`parallel.training_options`): a fifth to a third less compile time, and as fast for agents
    whose time is in library matrix products and short fusions. An agent whose environments act with
    parameters of their own (ES: a batch of members' matrix-vector products, which XLA emits as its
    own loops) says False: at level 1 its rollouts took 1.3x the CPU time."""


def all_finite(tree: Any) -> jax.Array:
    """Whether every floating-point leaf of `tree` is finite (a scalar bool): the NaN guard's reading."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
                              if jnp.issubdtype(x.dtype, jnp.inexact)] or [jnp.bool_(True)]))


AgentFor = Callable[[dict, tuple], Agent]
"""`agent_for(swept settings, axis names) -> Agent`: how an architecture builds a population member's agent."""


def fixed_agent(make_agent: Callable, *args, **kwargs) -> AgentFor:
    """`agent_for` of an agent whose settings nothing sweeps: `make_agent(*args, axis_names, **kwargs)`.

    For your own loop: `make_programs(env, fixed_agent(ppo.make_agent, network,
    optimizer, PPOConfig(), env.spec, rollout_len), config, mesh)`.
    """
    return lambda _hparams, axis_names: make_agent(*args, axis_names, **kwargs)
