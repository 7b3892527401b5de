"""Turn envpool's stream of steps into time-major trajectories PPO can learn from.

envpool ends an episode by returning its final observation; the environment's
next step is a reset that ignores the action and pays reward 0 (see
`podracer.sebulba.envs`). Acting on a final observation is therefore no
transition, and learning from it would teach the policy and the value function
about an action that did nothing. PPO's loss has no mask, so such rows are not
written at all: each environment's column holds only its real transitions, one
after another, and a column continues with the next episode's first observation
right after a row that ended an episode.

The value the policy computes on a final observation is kept as the
`final_value` of the row that ended the episode, which is what GAE bootstraps
from when that episode was truncated. The value computed on the observation
after an environment's last row is its `bootstrap_value`.

Environments do not finish their T rows at the same moment, because they skip
different numbers of reset steps. An environment with T rows (and a bootstrap
value) keeps stepping, its extra steps unrecorded (`dropped`), until every
environment is done; then the trajectory is taken and the next one starts from
the observations the actor holds. So every row of a trajectory was acted on by
the same parameters, and a trajectory is a contiguous stretch of each
environment's experience.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from podracer.types import Transition


class Rollout(NamedTuple):
    """A finished trajectory on the host: `batch` is a Transition of numpy [T, N, ...] arrays."""

    batch: Transition
    bootstrap_value: np.ndarray  # [N]
    dropped_steps: int  # steps of environments that already had their T rows
    reset_steps: int  # actions on final observations, ignored by the environment


_NONE, _RESET, _DROPPED = 0, 1, 2


class TrajectoryBuilder:
    """Collects T real transitions for each of N environments.

    Per `recv`, call `record_results` (the answer to the previous actions), then
    `record_actions` (the policy's output on the new observations). When `full`,
    `take` the trajectory; to start the next one from the same observations, call
    `record_actions` again with the new policy's outputs before sending them.
    """

    def __init__(self, rollout_len: int, num_envs: int, obs_shape: Sequence[int], obs_dtype,
                 action_shape: Sequence[int], action_dtype):
        self.rollout_len = rollout_len
        self.num_envs = num_envs
        self._shapes = dict(obs=(tuple(obs_shape), obs_dtype), action=(tuple(action_shape), action_dtype))
        self._fill = np.zeros(num_envs, np.int64)  # rows written per environment
        self._complete = np.zeros(num_envs, bool)  # T rows and a bootstrap value
        self._row_of_action = np.full(num_envs, -1, np.int64)  # row awaiting its result, or -1
        # The unrecorded action awaiting its result: _NONE, _RESET or _DROPPED.
        self._unrecorded = np.full(num_envs, _NONE, np.int8)
        self._new_buffers()

    def _new_buffers(self) -> None:
        # Fresh arrays per trajectory: a shipped trajectory may still be read (or
        # aliased by a device buffer) while the next one is being written.
        t, n = self.rollout_len, self.num_envs
        (obs_shape, obs_dtype), (action_shape, action_dtype) = self._shapes["obs"], self._shapes["action"]
        self._obs = np.zeros((t, n, *obs_shape), obs_dtype)
        self._action = np.zeros((t, n, *action_shape), action_dtype)
        self._reward = np.zeros((t, n), np.float32)
        self._terminated = np.zeros((t, n), bool)
        self._truncated = np.zeros((t, n), bool)
        self._value = np.zeros((t, n), np.float32)
        self._log_prob = np.zeros((t, n), np.float32)
        self._final_value = np.zeros((t, n), np.float32)
        self._bootstrap = np.zeros(n, np.float32)
        self._fill[:] = 0
        self._complete[:] = False
        self._dropped = 0
        self._resets = 0

    @property
    def full(self) -> bool:
        return bool(self._complete.all())

    def record_results(self, env_ids: np.ndarray, reward: np.ndarray, terminated: np.ndarray,
                       truncated: np.ndarray) -> None:
        """What the environments `env_ids` answered to the actions last recorded for them."""
        row = self._row_of_action[env_ids]
        has_row = row >= 0
        rows, cols = row[has_row], env_ids[has_row]
        self._reward[rows, cols] = reward[has_row]
        self._terminated[rows, cols] = terminated[has_row]
        self._truncated[rows, cols] = truncated[has_row]
        self._row_of_action[env_ids] = -1
        unrecorded = self._unrecorded[env_ids]
        self._resets += int((unrecorded == _RESET).sum())
        self._dropped += int((unrecorded == _DROPPED).sum())
        self._unrecorded[env_ids] = _NONE

    def record_actions(self, env_ids: np.ndarray, obs: np.ndarray, obs_is_final: np.ndarray,
                       action: np.ndarray, log_prob: np.ndarray, value: np.ndarray) -> None:
        """The policy's output on `obs`; `obs_is_final` where `obs` ended an episode."""
        fill = self._fill[env_ids]
        open_ = ~self._complete[env_ids]
        # A final observation's value is the final value of the row that ended there.
        ended = open_ & obs_is_final & (fill > 0)
        self._final_value[fill[ended] - 1, env_ids[ended]] = value[ended]
        # The observation after an environment's T-th row: its value bootstraps the column.
        at_end = open_ & (fill == self.rollout_len)
        self._bootstrap[env_ids[at_end]] = value[at_end]
        self._complete[env_ids[at_end]] = True
        write = open_ & ~obs_is_final & (fill < self.rollout_len)
        rows, cols = fill[write], env_ids[write]
        self._obs[rows, cols] = obs[write]
        self._action[rows, cols] = action[write]
        self._log_prob[rows, cols] = log_prob[write]
        self._value[rows, cols] = value[write]
        self._fill[cols] += 1
        row_of_action = np.full(len(env_ids), -1, np.int64)
        row_of_action[write] = rows
        self._row_of_action[env_ids] = row_of_action
        self._unrecorded[env_ids] = np.where(obs_is_final, _RESET, np.where(write, _NONE, _DROPPED))

    def take(self) -> Rollout:
        """The finished trajectory; the builder starts an empty one."""
        if not self.full:
            raise RuntimeError("trajectory is not full yet")
        batch = Transition(self._obs, self._action, self._reward, self._terminated, self._truncated,
                           self._value, self._log_prob, self._final_value)
        rollout = Rollout(batch, self._bootstrap, self._dropped, self._resets)
        self._new_buffers()
        return rollout
