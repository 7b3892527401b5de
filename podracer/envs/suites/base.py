"""What every suite adapter shares: auto-reset, truncation kept apart, episode statistics.

An adapter gives three pure functions of the library's own environment,

    reset_fn(key) -> (inner, raw_obs)
    step_fn(key, inner, action) -> (inner, raw_obs, reward, terminated, truncated)
    obs_fn(raw_obs) -> obs array          # flattens dicts, puts the action mask last

and `SuiteEnv` turns them into the Anakin protocol of `podracer.envs.jax_envs`:
the reset an episode's end needs is drawn ahead (`draw`), the step selects it
where the episode ended, and `final_obs` keeps the last observation of the old
episode. A `time_limit` (for libraries whose environments never end on their
own, such as brax) truncates episodes at that many steps.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from podracer.envs.jax_envs import EnvState, StepDraws, TimeStep, _strongly_typed
from podracer.envs.spec import EnvSpec


def flatten_obs(raw, mask_key: str | None = None) -> tuple[jax.Array, jax.Array | None]:
    """A dict or tuple observation as one float32 vector, and its action mask (if any) apart.

    Leaves are taken in the pytree's order (dict keys sorted, namedtuple fields in
    order); the mask leaf, named `mask_key`, is returned on its own.
    """
    if hasattr(raw, "_asdict"):
        raw = raw._asdict()
    mask = None
    if isinstance(raw, dict) and mask_key in raw:
        raw = dict(raw)
        mask = jnp.asarray(raw.pop(mask_key), bool)
    leaves = [jnp.asarray(leaf, jnp.float32).reshape(-1) for leaf in jax.tree.leaves(raw)]
    return jnp.concatenate(leaves) if len(leaves) > 1 else leaves[0], mask


def with_mask(features: jax.Array, mask: jax.Array | None) -> jax.Array:
    """The policy's input: features, then the legal-action mask as 0/1 (the last `action_dim` entries)."""
    if mask is None:
        return features
    return jnp.concatenate([features.reshape(-1).astype(jnp.float32), mask.astype(jnp.float32)])


class SuiteEnv:
    """A pure Anakin environment built from a library's reset and step functions."""

    def __init__(self, env_id: str, spec: EnvSpec, reset_fn: Callable, step_fn: Callable,
                 obs_fn: Callable, horizon: int, time_limit: int | None = None, render_fn=None,
                 check_vma: bool = False, costly_reset: bool = False):
        self.env_id = env_id
        self.spec = spec
        self.horizon = int(horizon)  # the longest an episode can be: evaluation steps this many
        self.time_limit = time_limit
        self.render_fn = render_fn  # inner state -> [H, W, 3] uint8 frame, where the suite draws
        # Whether shard_map may check the replication of values through the library's
        # step. Libraries are not written for the check: Navix's and Jumanji PacMan's
        # lax.cond branches differ in varying-ness (a constant in one, per-device data
        # in the other), which it refuses. Anakin runs suites unchecked; a test proves
        # one device and eight still train alike.
        self.check_vma = check_vma
        # Resets that cost far more than a step (Craftax generates a world) are made only
        # where an episode ended (`step_batch`), not drawn ahead for every step.
        self.costly_reset = costly_reset
        self._reset_fn, self._step_fn, self._obs_fn = reset_fn, step_fn, obs_fn

    def _action(self, action):
        if self.spec.discrete:
            return action
        return jnp.clip(action, self.spec.action_low, self.spec.action_high)

    def _initial(self, key):
        inner, raw = self._reset_fn(key)
        return _strongly_typed(inner), self._obs_fn(raw).astype(self.spec.obs_dtype)

    def reset(self, key: jax.Array) -> tuple[EnvState, TimeStep]:
        inner, obs = self._initial(key)
        zero = jnp.zeros((), jnp.float32)
        timestep = TimeStep(obs, zero, jnp.array(False), jnp.array(False), obs, zero,
                            jnp.zeros((), jnp.int32))
        return EnvState(inner, zero, jnp.zeros((), jnp.int32)), timestep

    def draw(self, key: jax.Array) -> StepDraws:
        step_key, reset_key = jax.random.split(key)
        if self.costly_reset:
            return StepDraws(step_key, None, None, reset_key)
        reset_state, reset_obs = self._initial(reset_key)
        return StepDraws(step_key, reset_obs, reset_state)

    def draw_restarting(self, key: jax.Array, obs: jax.Array, state: EnvState) -> StepDraws:
        """`draw(key)`, except that an episode that ends starts again from `obs`/`state`
        (an earlier reset): for ES episodes, which ignore what follows their end."""
        step_key, _ = jax.random.split(key)
        return StepDraws(step_key, obs, state.inner)

    def step(self, key: jax.Array, state: EnvState, action: jax.Array) -> tuple[EnvState, TimeStep]:
        return self.step_with(self.draw(key), state, action)

    def step_with(self, draws: StepDraws, state: EnvState, action: jax.Array) -> tuple[EnvState, TimeStep]:
        moved = self._advance(draws.step_key, state, action)
        if draws.reset_obs is None:  # a costly reset, made from its key only here
            reset_state, reset_obs = self._initial(draws.reset_key)
        else:
            reset_state, reset_obs = draws.reset_state, draws.reset_obs
        return self._finish(moved, reset_state, reset_obs)

    def stepped_inner(self, key: jax.Array, state: EnvState, action: jax.Array):
        """The library state `step(key, state, action)` reaches before its auto-reset."""
        return self._step_fn(self.draw(key).step_key, state.inner, self._action(action))[0]

    def step_batch(self, draws: StepDraws, state: EnvState, action: jax.Array) -> tuple[EnvState, TimeStep]:
        """`step_with` over a batch; a costly reset is made only for the environments that ended.

        Vmapped, `step_with` would make every environment's reset on every step
        and select it where an episode ended: a Craftax world is generated that
        way about 64 times per step at 64 environments, where one ends every few
        steps. Here the environments that ended are gathered and reset a few at a
        time (`_resets_per_pass`) in a loop that runs as often as needed, usually
        never. Each reset comes from that environment's own key, so the result is
        `step_with`'s, bit for bit.
        """
        if draws.reset_obs is not None:
            return jax.vmap(self.step_with)(draws, state, action)
        moved = jax.vmap(self._advance)(draws.step_key, state, action)
        done = moved.terminated | moved.truncated
        reset_state, reset_obs = self._reset_where(done, draws.reset_key, moved.inner, moved.obs)
        return jax.vmap(self._finish)(moved, reset_state, reset_obs)

    def _reset_where(self, done: jax.Array, keys: jax.Array, inner, obs):
        """`(inner, obs)` with environment i replaced by its reset from `keys[i]` where `done[i]`."""
        num = done.shape[0]
        per_pass = _resets_per_pass(num)
        # The ended environments first (in index order), then padding that is never written.
        order = jnp.concatenate([jnp.argsort(~done, stable=True), jnp.full((per_pass,), num)])
        ended = done.sum()

        def reset_some(carry):
            start, inner, obs = carry
            index = jax.lax.dynamic_slice(order, (start,), (per_pass,))
            index = jnp.where(start + jnp.arange(per_pass) < ended, index, num)  # num: dropped
            new_inner, new_obs = jax.vmap(self._initial)(keys[jnp.minimum(index, num - 1)])
            put = lambda old, new: old.at[index].set(new, mode="drop")
            return start + per_pass, jax.tree.map(put, inner, new_inner), put(obs, new_obs)

        _, inner, obs = jax.lax.while_loop(lambda carry: carry[0] < ended, reset_some,
                                           (jnp.zeros((), ended.dtype), inner, obs))
        return inner, obs

    def _advance(self, step_key: jax.Array, state: EnvState, action: jax.Array) -> "_Moved":
        """One step of the library's environment, before any reset."""
        inner, raw, reward, terminated, truncated = self._step_fn(step_key, state.inner,
                                                                  self._action(action))
        terminated = jnp.asarray(terminated, bool)
        episode_length = state.episode_length + 1
        truncated = jnp.asarray(truncated, bool)
        if self.time_limit is not None:
            truncated = truncated | (episode_length >= self.time_limit)
        reward = jnp.asarray(reward, jnp.float32)
        return _Moved(_strongly_typed(inner), self._obs_fn(raw).astype(self.spec.obs_dtype), reward,
                      terminated, truncated & ~terminated, state.episode_return + reward, episode_length)

    def _finish(self, moved: "_Moved", reset_state, reset_obs) -> tuple[EnvState, TimeStep]:
        """Where the episode ended, the environment starts again from the reset."""
        done = moved.terminated | moved.truncated
        select = lambda reset, stepped: jax.lax.select(done, reset, stepped)
        timestep = TimeStep(obs=select(reset_obs, moved.obs), reward=moved.reward,
                            terminated=moved.terminated, truncated=moved.truncated, final_obs=moved.obs,
                            episode_return=moved.episode_return, episode_length=moved.episode_length)
        new_state = EnvState(jax.tree.map(select, reset_state, moved.inner),
                             jnp.where(done, 0.0, moved.episode_return),
                             jnp.where(done, 0, moved.episode_length))
        return new_state, timestep


class _Moved(NamedTuple):
    """An environment after its step and before its reset."""

    inner: Any
    obs: jax.Array
    reward: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    episode_return: jax.Array
    episode_length: jax.Array


def _resets_per_pass(num_envs: int) -> int:
    """Resets made together in one pass of `SuiteEnv._reset_where`'s loop: an eighth of the batch."""
    return max(1, num_envs // 8)


def discrete_spec(obs: jax.Array, num_actions: int, masked: bool = False) -> EnvSpec:
    """The spec of a discrete-action environment whose observations look like `obs`."""
    dtype = jnp.float32 if jnp.issubdtype(obs.dtype, jnp.floating) else obs.dtype
    return EnvSpec(tuple(obs.shape), dtype, int(num_actions), True, None, None, masked)


def box_spec(obs: jax.Array, low, high) -> EnvSpec:
    """The spec of a continuous-action environment with actions in [low, high]."""
    low, high = np.asarray(low, np.float32), np.asarray(high, np.float32)
    return EnvSpec(tuple(obs.shape), jnp.float32, int(low.size), False, low.reshape(-1), high.reshape(-1))
