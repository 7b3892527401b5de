"""envpool environments for Sebulba actors: one batch per actor thread, stepped with send/recv.

envpool auto-resets in a way that shapes everything downstream. When a step ends
an episode (terminated or truncated) it returns the episode's *final*
observation; the next step for that environment ignores its action, resets, and
returns the first observation of the next episode with reward 0. Atari with
`episodic_life` does the same on every life lost. `EnvStep` passes this on
unchanged; `podracer.sebulba.trajectory` turns it into learnable transitions.
"""

from __future__ import annotations

import difflib
import functools
import warnings
from typing import NamedTuple

import numpy as np

from podracer.envs.spec import EnvSpec
from podracer.errors import PodracerError
from podracer.sebulba.gym_envs import (VectorPool, feature_keys, flatten_obs, gym_episode_limit, gym_spec, is_gym_id,
                                       spec_of_spaces)


class EnvStep(NamedTuple):
    """What one `recv` returns for the M environments `env_ids`.

    `reward`, `terminated`, `truncated` answer the action last sent to each of
    them (on Atari: clipped reward, and a life lost counts as terminated). When
    `terminated | truncated`, `obs` is the episode's final observation and the
    next action sent is ignored. `episode_done` marks the end of a real episode
    (on Atari: game over), with its `episode_return` (the unclipped game score)
    and `episode_length` (agent steps, reset steps excluded).
    """

    env_ids: np.ndarray  # [M] int32
    obs: np.ndarray  # [M, *obs_shape]
    reward: np.ndarray  # [M] float32
    terminated: np.ndarray  # [M] bool
    truncated: np.ndarray  # [M] bool
    episode_done: np.ndarray  # [M] bool
    episode_return: np.ndarray  # [M] float32, meaningful where episode_done
    episode_length: np.ndarray  # [M] int32, meaningful where episode_done


# Partially observable variants: id -> (envpool id, observation columns kept). Without
# its velocities CartPole needs memory (`--network=lstm`): a feed-forward policy
# sees positions only.
MASKED: dict[str, tuple[str, tuple[int, ...]]] = {
    "CartPole-NoVel-v1": ("CartPole-v1", (0, 2)),  # cart position, pole angle
}


def _base(env_id: str) -> str:
    return MASKED[env_id][0] if env_id in MASKED else env_id


@functools.lru_cache(maxsize=None)
def _make_spec(env_id: str):
    """envpool's spec of `env_id`, made once per process (the command line's check and the run share it)."""
    import envpool

    from podracer.envs.ids import is_suite_id

    known = envpool.list_all_envs()
    if is_suite_id(env_id):
        raise PodracerError(f"{env_id} is a JAX suite environment; use --arch=anakin (--arch=sebulba "
                            f"runs envpool ids and gymnasium:ID or py:MODULE:FUNCTION vector envs)")
    env_id = _base(env_id)
    if env_id not in known:
        from podracer.envs.ids import gymnax_ids

        if env_id in gymnax_ids():
            raise PodracerError(f"{env_id} is a gymnax environment, written in JAX; use "
                                f"--arch=anakin (--arch=sebulba runs envpool environments)")
        close = difflib.get_close_matches(env_id, known, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise PodracerError(f"unknown envpool environment {env_id!r}{hint}; "
                            f"pass --env with an id from envpool.list_all_envs()")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gymnasium's float64 -> float32 bound notices
        return envpool.make_spec(env_id)


def episode_limit(env_id: str) -> int:
    """The most agent steps an episode of `env_id` lasts (its time limit): what one fresh episode per
    environment (ES's generations) is cut at."""
    limit = gym_episode_limit(env_id) if is_gym_id(env_id) else _make_spec(_base(env_id)).config.max_episode_steps
    if not limit:
        raise PodracerError(f"--env={env_id} has no time limit (max_episode_steps), which one fresh episode "
                            f"per environment is cut at; register it with one, or use an environment that has one")
    return int(limit)


def is_atari(env_id: str) -> bool:
    return not is_gym_id(env_id) and "episodic_life" in _make_spec(env_id)._config_keys


def env_spec(env_id: str) -> EnvSpec:
    """Spaces of an envpool (or Gymnasium vector) environment; float64 observations are delivered as float32."""
    if is_gym_id(env_id):
        return gym_spec(env_id)
    spec = _make_spec(env_id)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gymnasium's float64 -> float32 bound notices
        obs_space, action_space = spec.observation_space, spec.action_space
    spec = spec_of_spaces(env_id, obs_space, action_space)
    if env_id in MASKED:
        spec = spec._replace(obs_shape=(len(MASKED[env_id][1]),))
    return spec


class EnvPoolEnvs:
    """A batch of `num_envs` envpool environments, `batch_size` of them returned per `recv`.

    With `batch_size == num_envs` every `recv` returns all of them in env-id
    order (synchronous stepping); smaller batches return whichever finished first.
    Atari runs with episodic life and clipped rewards for training, and reports
    the unclipped game score per game. `gymnasium:ID` and `py:MODULE:FUNCTION`
    ids run a Gymnasium vector environment instead (`podracer.sebulba.gym_envs`).
    """

    def __init__(self, env_id: str, num_envs: int, batch_size: int, num_threads: int, seed: int):
        self.spec = env_spec(env_id)
        self._kept = np.asarray(MASKED[env_id][1]) if env_id in MASKED else None
        env_id = _base(env_id)
        self.atari = is_atari(env_id)
        options = dict(episodic_life=True, reward_clip=True) if self.atari else {}
        if is_gym_id(env_id):
            self._pool = VectorPool(env_id, num_envs, batch_size, seed)
        else:
            import envpool

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._pool = envpool.make(env_id, env_type="gymnasium", num_envs=num_envs,
                                          batch_size=batch_size, num_threads=num_threads, seed=seed,
                                          **options)
                self._pool.observation_space  # built on first use; here, where its notices are silenced
        # Dict observations (envpool's Jumanji ports) are flattened, their action mask last.
        self._keys = feature_keys(self._pool.observation_space)
        self.num_envs, self.batch_size = num_envs, batch_size
        self._return = np.zeros(num_envs, np.float32)
        self._length = np.zeros(num_envs, np.int32)
        # The next result of an environment is a reset (after an episode end, or the first).
        self._resetting = np.ones(num_envs, bool)

    def start(self) -> None:
        """Reset every environment, also mid-episode; results arrive through `recv`.

        Episode bookkeeping restarts with them: ES resets its environments at
        the start of every generation, leaving unfinished episodes behind.
        """
        self._return[:] = 0.0
        self._length[:] = 0
        self._resetting[:] = True
        self._pool.async_reset()

    def send(self, action: np.ndarray, env_ids: np.ndarray) -> None:
        if not self.spec.discrete:
            action = np.clip(action, self.spec.action_low, self.spec.action_high)
        self._pool.send(np.asarray(action), env_ids)

    def recv(self) -> EnvStep:
        obs, reward, terminated, truncated, info = self._pool.recv()
        ids = np.asarray(info["env_id"], np.int32)
        reward = np.asarray(reward, np.float32)
        terminated = np.asarray(terminated, bool)
        truncated = np.asarray(truncated, bool)
        obs = flatten_obs(obs, self._keys)
        if obs.dtype == np.float64:
            obs = obs.astype(np.float32)
        if self._kept is not None:
            obs = obs[:, self._kept]
        # A reset step pays 0 (in the game score too) and is no agent step.
        score = np.asarray(info["reward"], np.float32) if self.atari else reward
        episode_return = self._return[ids] + score
        episode_length = self._length[ids] + ~self._resetting[ids]
        game_over = np.asarray(info["terminated"], bool) if self.atari else terminated
        episode_done = game_over | truncated
        self._return[ids] = np.where(episode_done, 0.0, episode_return)
        self._length[ids] = np.where(episode_done, 0, episode_length)
        self._resetting[ids] = terminated | truncated
        return EnvStep(ids, obs, reward, terminated, truncated, episode_done, episode_return,
                       episode_length)

    def close(self) -> None:
        self._pool.close()


class EpisodeTally:
    """The return and length of each environment's first complete episode since `EnvPoolEnvs.start`.

    Uses `EnvStep.episode_done`/`episode_return`, the true episodic return
    (on Atari, the game score of a whole game, not of one life).
    """

    def __init__(self, num_envs: int):
        self.returns = np.zeros(num_envs, np.float32)
        self.lengths = np.zeros(num_envs, np.int64)
        self.finished = np.zeros(num_envs, bool)

    @property
    def done(self) -> bool:
        return bool(self.finished.all())

    def record(self, step: EnvStep) -> None:
        """Take one `recv`'s results."""
        ids = step.env_ids
        ends = step.episode_done & ~self.finished[ids]
        self.returns[ids[ends]] = step.episode_return[ends]
        self.lengths[ids[ends]] = step.episode_length[ends]
        self.finished[ids] |= step.episode_done


def in_env_order(step: EnvStep) -> EnvStep:
    """`step` with its rows sorted by environment id (envpool returns a full batch in order already)."""
    if np.array_equal(step.env_ids, np.arange(step.env_ids.shape[0])):
        return step
    order = np.argsort(step.env_ids)
    return EnvStep(*(field[order] for field in step))
