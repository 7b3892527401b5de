"""Your own simulator on Sebulba: any Gymnasium vector environment beside envpool's.

    --env=gymnasium:CartPole-v1       gymnasium.make_vec("CartPole-v1", num_envs)
    --env=py:my_package.sims:make     my_package.sims.make(num_envs) -> gymnasium.vector.VectorEnv

Gymnasium's default autoreset mode (`AutoresetMode.NEXT_STEP`) is envpool's: a
step that ends an episode returns its final observation, and the next step of
that environment ignores its action and returns the first observation of a new
episode. `VectorPool` gives such an environment envpool's send/recv face, so
`EnvPoolEnvs` keeps its episode bookkeeping and the actor threads, trajectories
and breakdown are the same as for envpool ids. Every recv returns the whole
batch: `--async-envs` is envpool's alone.

A `Dict` observation space is flattened into one float32 vector, its entries in
the space's order; an `action_mask` entry (a legal-action mask over Discrete
actions) goes last, where the network reads it and masks its logits, as for
Jumanji on Anakin. envpool's environments with Dict observations (its Jumanji
ports: Knapsack-v1, Game2048-v1, ...) are read the same way.
"""

from __future__ import annotations

import importlib
import inspect
import warnings

import numpy as np

from podracer.envs.spec import EnvSpec
from podracer.errors import PodracerError

PREFIXES = ("gymnasium:", "py:")
MASK_KEY = "action_mask"


def is_gym_id(env_id: str) -> bool:
    return env_id.startswith(PREFIXES)


def make_vector_env(env_id: str, num_envs: int):
    """The Gymnasium vector environment that `env_id` names, with `num_envs` environments."""
    import gymnasium

    if env_id.startswith("gymnasium:"):
        name = env_id[len("gymnasium:"):]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return gymnasium.make_vec(name, num_envs=num_envs, vectorization_mode="sync")
        except gymnasium.error.Error as err:
            raise PodracerError(f"--env={env_id}: gymnasium cannot make {name!r} ({err})") from None
    module_name, _, function = env_id[len("py:"):].partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError, ValueError) as err:
        raise PodracerError(f"--env={env_id}: cannot import {function or '?'} from {module_name!r} "
                            f"({err}); name a factory as py:MODULE:FUNCTION, importable here") from None
    envs = _call_factory(env_id, factory, function, num_envs)
    if not isinstance(envs, gymnasium.vector.VectorEnv) or envs.num_envs != num_envs:
        raise PodracerError(f"--env={env_id}: {function}({num_envs}) must return a "
                            f"gymnasium.vector.VectorEnv of {num_envs} environments")
    return envs


def _call_factory(env_id: str, factory, function: str, num_envs: int):
    """`factory(num_envs)`; a factory that cannot take that call, or fails in it, is one line."""
    try:
        inspect.signature(factory).bind(num_envs)
    except TypeError:
        raise PodracerError(f"--env={env_id}: {function} must take one argument, the number of "
                            f"environments, as {function}(num_envs); its signature is "
                            f"{function}{inspect.signature(factory)}") from None
    except ValueError:  # a builtin without a signature: the call itself says
        pass
    try:
        return factory(num_envs)
    except Exception as err:  # noqa: BLE001 - the user's code: any failure is theirs to fix
        raise PodracerError(f"--env={env_id}: {function}({num_envs}) raised {type(err).__name__}: "
                            f"{(str(err).splitlines() or [''])[0]}; fix the factory") from None


def _check_autoreset(envs, env_id: str) -> None:
    from gymnasium.vector import AutoresetMode

    mode = envs.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
    if mode not in (AutoresetMode.NEXT_STEP, "NextStep"):
        raise PodracerError(f"--env={env_id} resets in mode {mode}; Sebulba needs "
                            f"autoreset_mode=NEXT_STEP (gymnasium's default)")


def feature_keys(obs_space) -> list[str] | None:
    """A Dict space's entries other than the action mask, in order (None for other spaces)."""
    import gymnasium

    if not isinstance(obs_space, gymnasium.spaces.Dict):
        return None
    return [key for key in obs_space.spaces if key != MASK_KEY]


def flatten_obs(obs, keys: list[str] | None) -> np.ndarray:
    """A batch of Dict observations as [N, features (+ mask)] float32; others as they are."""
    if keys is None:
        return obs
    n = len(np.asarray(obs[keys[0]] if keys else obs[MASK_KEY]))
    parts = [np.asarray(obs[key]).reshape(n, -1) for key in keys]
    if MASK_KEY in obs:
        parts.append(np.asarray(obs[MASK_KEY]).reshape(n, -1))
    return np.concatenate([part.astype(np.float32) for part in parts], axis=1)


def gym_episode_limit(env_id: str) -> int | None:
    """The time limit of `env_id`'s episodes (its spec's `max_episode_steps`); None without one."""
    envs = make_vector_env(env_id, 1)
    try:
        return getattr(getattr(envs, "spec", None), "max_episode_steps", None)
    finally:
        envs.close()


def gym_spec(env_id: str) -> EnvSpec:
    envs = make_vector_env(env_id, 1)
    try:
        obs_space, action_space = envs.single_observation_space, envs.single_action_space
        _check_autoreset(envs, env_id)
    finally:
        envs.close()
    return spec_of_spaces(env_id, obs_space, action_space)


def spec_of_spaces(env_id: str, obs_space, action_space) -> EnvSpec:
    """The spec of one environment with these Gymnasium spaces (envpool's are Gymnasium's too).

    A Dict observation is `flatten_obs`'s vector, with the action mask last where there is one.
    """
    keys = feature_keys(obs_space)
    if keys is not None:
        masked = MASK_KEY in obs_space.spaces
        size = sum(int(np.prod(obs_space[key].shape)) for key in keys)
        if masked:
            if not hasattr(action_space, "n") or tuple(obs_space[MASK_KEY].shape) != (int(action_space.n),):
                raise PodracerError(f"--env={env_id}: its action_mask must have one entry per action "
                                    f"of a Discrete action space")
            return EnvSpec((size + int(action_space.n),), np.float32, int(action_space.n), True, None, None,
                           True)
        obs_shape, obs_dtype = (size,), np.float32
    else:
        obs_shape = tuple(obs_space.shape)
        obs_dtype = np.float32 if obs_space.dtype == np.float64 else obs_space.dtype
    if hasattr(action_space, "n"):
        return EnvSpec(obs_shape, obs_dtype, int(action_space.n), True, None, None)
    if not hasattr(action_space, "low"):
        raise PodracerError(f"--env={env_id} has {type(action_space).__name__} actions; Sebulba "
                            f"runs Discrete or Box action spaces")
    shape = action_space.shape
    return EnvSpec(obs_shape, obs_dtype, int(np.prod(shape)), False,
                   np.broadcast_to(np.asarray(action_space.low, np.float32), shape),
                   np.broadcast_to(np.asarray(action_space.high, np.float32), shape))


class VectorPool:
    """A Gymnasium vector environment behind envpool's `async_reset/send/recv`."""

    def __init__(self, env_id: str, num_envs: int, batch_size: int, seed: int):
        if batch_size != num_envs:
            raise PodracerError(f"--env={env_id} steps its whole batch at once; drop --async-envs "
                                f"(envpool only)")
        self._envs = make_vector_env(env_id, num_envs)
        _check_autoreset(self._envs, env_id)
        self.observation_space = self._envs.single_observation_space
        self._ids = np.arange(num_envs, dtype=np.int32)
        self._seed = seed
        self._pending = None

    def async_reset(self) -> None:
        obs, _ = self._envs.reset(seed=self._seed)
        self._seed = None  # later resets continue the environments' own generators
        zeros = np.zeros(len(self._ids), bool)
        self._pending = (obs, np.zeros(len(self._ids), np.float32), zeros, zeros)

    def send(self, action: np.ndarray, env_ids: np.ndarray) -> None:
        order = np.argsort(env_ids)
        obs, reward, terminated, truncated, _ = self._envs.step(np.asarray(action)[order])
        self._pending = (obs, reward, terminated, truncated)

    def recv(self):
        obs, reward, terminated, truncated = self._pending
        return obs, reward, terminated, truncated, {"env_id": self._ids}

    def close(self) -> None:
        self._envs.close()
