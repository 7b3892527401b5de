"""Pure-JAX environments for Anakin: a gymnax adapter with auto-reset and episode stats.

The protocol every Anakin environment follows (single, unbatched env; Anakin
vmaps it):

    reset(key) -> (state, timestep)
    step(key, state, action) -> (state, timestep)
    draw(key) -> draws                   # the randomness of step(key, ...), ahead
    step_with(draws, state, action)      # == step(key, state, action), bit for bit
    step_batch(draws, state, action)     # step_with over a batch ([B, ...] everything)
"""

from __future__ import annotations

import difflib
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from podracer.envs.ids import import_gymnax, is_envpool_id, is_suite_id
from podracer.envs.spec import EnvSpec
from podracer.errors import PodracerError


class TimeStep(NamedTuple):
    """What an environment answers. After a step that ends an episode, `obs` is
    already the first observation of the next one and `final_obs` the last of the
    old one; `episode_return`/`episode_length` describe the episode that ended."""

    obs: jax.Array
    reward: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    final_obs: jax.Array
    episode_return: jax.Array
    episode_length: jax.Array


class EnvState(NamedTuple):
    inner: Any
    episode_return: jax.Array
    episode_length: jax.Array


class StepDraws(NamedTuple):
    """The randomness of one `step(key, ...)`, computed ahead of it.

    A rollout draws these for every (step, environment) at once, vmapped, outside
    its sequential loop: on XLA:CPU each PRNG draw inside the loop is a rolled
    loop of small kernels of its own, and the auto-reset draws one on every step.
    Memory: one reset state and observation per (step, environment) of a rollout.
    """

    step_key: jax.Array  # for the transition (most classic-control envs ignore it)
    reset_obs: Any  # where an episode that ends on this step starts again; None if
    reset_state: Any  # the environment resets inside its own `step` (then it draws there),
    reset_key: Any = None  # or if the reset is too costly to make ahead: then its key


def _strongly_typed(tree):
    """`tree` with every leaf strongly typed (its dtype kept).

    gymnax builds some state fields from Python scalars (CartPole's step counter),
    which makes them weakly typed; whatever rebuilds a state (a loop that packs its
    carry) returns it strongly typed, and a jitted step whose output types differ
    from its input's compiles again on its second call.
    """
    return jax.tree.map(lambda x: jax.lax.convert_element_type(x, jnp.result_type(x)), tree)


class GymnaxEnv:
    """Any gymnax environment, as a pure Anakin environment.

    Continuous actions are clipped to the action space's bounds before stepping.
    """

    def __init__(self, env_id: str):
        gymnax = import_gymnax()

        if env_id not in gymnax.registered_envs:
            if is_envpool_id(env_id):
                raise PodracerError(f"{env_id} is an envpool environment, which runs on the host "
                                    f"CPU; use --arch=sebulba (--arch=anakin runs gymnax "
                                    f"environments, written in JAX)")
            close = difflib.get_close_matches(env_id, gymnax.registered_envs, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise PodracerError(f"unknown gymnax environment {env_id!r}{hint}; "
                                f"pass --env with one of gymnax.registered_envs")
        self.env_id = env_id
        self.env, self.params = gymnax.make(env_id)
        space = self.env.action_space(self.params)
        obs_space = self.env.observation_space(self.params)
        discrete = hasattr(space, "n")
        # Environments that override gymnax's step (bsuite's DeepSea keeps counters
        # across resets) keep their own; the rest step through `step_env`.
        self._standard_step = type(self.env).step is gymnax.environments.environment.Environment.step
        self.spec = EnvSpec(
            obs_shape=tuple(obs_space.shape),
            obs_dtype=jnp.float32 if obs_space.dtype in (jnp.float64, np.float64) else obs_space.dtype,
            action_dim=int(space.n) if discrete else int(np.prod(space.shape)),
            discrete=discrete,
            action_low=None if discrete else np.broadcast_to(np.asarray(space.low, np.float32), space.shape),
            action_high=None if discrete else np.broadcast_to(np.asarray(space.high, np.float32), space.shape),
        )

    @property
    def horizon(self) -> int:
        """The longest an episode can be: evaluation steps this many."""
        return int(self.params.max_steps_in_episode)

    def _env_action(self, action):
        if self.spec.discrete:
            return action
        action = jnp.clip(action, self.spec.action_low, self.spec.action_high)
        # gymnax's scalar continuous envs (Pendulum) take a shape-[] or [1] action.
        return action.reshape(self.env.action_space(self.params).shape)

    def reset(self, key: jax.Array) -> tuple[EnvState, TimeStep]:
        obs, inner = self.env.reset(key, self.params)
        inner = _strongly_typed(inner)
        obs = obs.astype(self.spec.obs_dtype)
        zero = jnp.zeros((), jnp.float32)
        timestep = TimeStep(obs, zero, jnp.array(False), jnp.array(False), obs, zero,
                            jnp.zeros((), jnp.int32))
        return EnvState(inner, zero, jnp.zeros((), jnp.int32)), timestep

    def step(self, key: jax.Array, state: EnvState, action: jax.Array) -> tuple[EnvState, TimeStep]:
        return self.step_with(self.draw(key), state, action)

    def draw_restarting(self, key: jax.Array, obs: jax.Array, state: EnvState) -> StepDraws:
        """The draws of `step(key, ...)`, but an episode that ends starts again from
        `obs`/`state` (an earlier reset) instead of a new random one.

        For a caller that ignores what follows the end of an episode (an ES
        episode): the same steps up to that end, without drawing a reset at every
        step. Environments that reset inside their own step draw as `draw`.
        """
        if not self._standard_step:
            return StepDraws(key, None, None)
        step_key, _ = jax.random.split(key)
        return StepDraws(step_key, obs, state.inner)

    def draw(self, key: jax.Array) -> StepDraws:
        """Everything `step(key, ...)` draws: gymnax's own key split and reset."""
        if not self._standard_step:
            return StepDraws(key, None, None)
        step_key, reset_key = jax.random.split(key)
        reset_obs, reset_state = self.env.reset_env(reset_key, self.params)
        return StepDraws(step_key, reset_obs, _strongly_typed(reset_state))

    def stepped_inner(self, key: jax.Array, state: EnvState, action: jax.Array):
        """The library state `step(key, state, action)` reaches before its auto-reset
        (the state that ended an episode, which `step` replaces; a video shows it)."""
        return self.env.step_env(self.draw(key).step_key, state.inner, self._env_action(action), self.params)[1]

    def step_batch(self, draws: StepDraws, state: EnvState, action: jax.Array) -> tuple[EnvState, TimeStep]:
        """`step_with` over a batch of environments (every leaf with a leading [B] axis)."""
        return jax.vmap(self.step_with)(draws, state, action)

    def step_with(self, draws: StepDraws, state: EnvState, action: jax.Array) -> tuple[EnvState, TimeStep]:
        """One step with its randomness drawn ahead (`draw`); auto-resets."""
        action = self._env_action(action)
        if self._standard_step:
            # gymnax's Environment.step, with the reset it would draw taken from `draws`.
            obs_step, inner_step, reward, terminated, _ = self.env.step_env(
                draws.step_key, state.inner, action, self.params)
            truncated = self.env.is_truncated(inner_step, self.params)
            done = jnp.logical_or(terminated, truncated)
            select = lambda reset, stepped: jax.lax.select(done, reset, stepped)
            inner = jax.tree.map(select, draws.reset_state, inner_step)
            obs = jax.tree.map(select, draws.reset_obs, obs_step)
            final_obs = obs_step
        else:
            obs, inner, reward, terminated, truncated, info = self.env.step(
                draws.step_key, state.inner, action, self.params)
            final_obs = info["final_observation"]
        reward = jnp.asarray(reward, jnp.float32)
        done = jnp.logical_or(terminated, truncated)
        episode_return = state.episode_return + reward
        episode_length = state.episode_length + 1
        timestep = TimeStep(
            obs=obs.astype(self.spec.obs_dtype),
            reward=reward,
            terminated=jnp.asarray(terminated, bool),
            truncated=jnp.logical_and(truncated, jnp.logical_not(terminated)),
            final_obs=final_obs.astype(self.spec.obs_dtype),
            episode_return=episode_return,
            episode_length=episode_length,
        )
        new_state = EnvState(inner, jnp.where(done, 0.0, episode_return),
                             jnp.where(done, 0, episode_length))
        return new_state, timestep


@functools.lru_cache(maxsize=None)
def make_env(env_id: str) -> GymnaxEnv:
    """The Anakin environment for `env_id`: a gymnax id (CartPole-v1, Pendulum-v1) or
    `SUITE:ID` of a JAX suite (`podracer.envs.suites`: brax, jumanji, craftax, navix).

    Made once per id and process: an environment holds no state of its own, and
    the command line's check of `--env` and the run then share it.
    """
    if is_suite_id(env_id):
        from podracer.envs.suites import make_suite_env

        return make_suite_env(env_id)
    if env_id.startswith(("gymnasium:", "py:")):
        raise PodracerError(f"{env_id} is a Gymnasium vector environment, which runs on the host CPU; "
                            f"use --arch=sebulba")
    return GymnaxEnv(env_id)
