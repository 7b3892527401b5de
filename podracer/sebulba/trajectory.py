"""Turn envpool's stream of steps into time-major trajectories PPO can learn from.

envpool ends an episode by returning its final observation; the environment's
next step is a reset that ignores the action and pays reward 0 (see
`podracer.sebulba.envs`). Acting on a final observation is therefore no
transition, and learning from it would teach the policy and the value function
about an action that did nothing. PPO's loss has no mask, so such rows are not
written at all: each environment's column holds only its real transitions, one
after another, and a column continues with the next episode's first observation
right after a row that ended an episode.

A recurrent policy's state (its carry, flattened to [K] per environment) is
recorded where each column's first row is written: the state that row was
acted on with. The learner replays the column from it, zeroing the state after
every row that ended an episode, as the actor did before the next episode's
first observation (the final observation in between is acted on but not
recorded, and its state is discarded by that reset).

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
    carry: np.ndarray | None = None  # [N, K]: a recurrent policy's state at each column's first row


# What became of the action an environment was last sent (_UNSENT: none yet).
_ROW, _RESET, _DROPPED, _UNSENT = 0, 1, 2, 3


class TrajectoryBuilder:
    """Collects T real transitions for each of N environments.

    Per `recv`, call `record_results` (the answer to the previous actions), then
    `record_actions` (the policy's output on the new observations). When `full`,
    `take` the trajectory; to start the next one from the same observations, call
    `record_actions` again with the new policy's outputs before sending them.

    Buffers are flat [(T + 1) * N, ...] arrays: every call scatters the whole
    batch at once, and whatever must not be recorded lands in the spare row T,
    which `take` leaves out. This keeps the per-step cost to a few numpy calls.
    """

    def __init__(self, rollout_len: int, num_envs: int, obs_shape: Sequence[int], obs_dtype,
                 action_shape: Sequence[int], action_dtype, carry_width: int = 0):
        self.rollout_len = rollout_len
        self.carry_width = carry_width
        self.num_envs = num_envs
        self._shapes = dict(obs=(tuple(obs_shape), obs_dtype), action=(tuple(action_shape), action_dtype))
        self._fill = np.zeros(num_envs, np.int64)  # rows written per environment
        self._complete = np.zeros(num_envs, bool)  # T rows and a bootstrap value
        # Where the result of each environment's last action goes (row T: nowhere), and why.
        self._row_of_action = np.full(num_envs, rollout_len, np.int64)
        self._fate = np.full(num_envs, _UNSENT, np.int8)
        self._new_buffers()

    def _new_buffers(self) -> None:
        # Fresh arrays per trajectory: a shipped trajectory may still be read (or
        # aliased by a device buffer) while the next one is being written.
        rows = (self.rollout_len + 1) * self.num_envs
        (obs_shape, obs_dtype), (action_shape, action_dtype) = self._shapes["obs"], self._shapes["action"]
        self._obs = np.zeros((rows, *obs_shape), obs_dtype)
        self._action = np.zeros((rows, *action_shape), action_dtype)
        self._reward = np.zeros(rows, np.float32)
        self._terminated = np.zeros(rows, bool)
        self._truncated = np.zeros(rows, bool)
        self._value = np.zeros(rows, np.float32)
        self._log_prob = np.zeros(rows, np.float32)
        self._final_value = np.zeros(rows, np.float32)
        self._bootstrap = np.zeros(self.num_envs + 1, np.float32)  # [N] is the spare slot
        self._carry = np.zeros((self.num_envs + 1, self.carry_width), np.float32)  # [N] spare
        self._fill[:] = 0
        self._complete[:] = False
        self._counts = np.zeros(4, np.int64)  # results per fate, this trajectory

    @property
    def full(self) -> bool:
        return bool(self._complete.all())

    def record_results(self, env_ids: np.ndarray, reward: np.ndarray, terminated: np.ndarray,
                       truncated: np.ndarray) -> None:
        """What the environments `env_ids` answered to the actions last recorded for them."""
        flat = self._row_of_action[env_ids] * self.num_envs + env_ids
        self._reward[flat] = reward
        self._terminated[flat] = terminated
        self._truncated[flat] = truncated
        self._counts += np.bincount(self._fate[env_ids], minlength=4)

    def record_actions(self, env_ids: np.ndarray, obs: np.ndarray, obs_is_final: np.ndarray,
                       action: np.ndarray, log_prob: np.ndarray, value: np.ndarray,
                       carry: np.ndarray | None = None) -> None:
        """The policy's output on `obs`; `obs_is_final` where `obs` ended an episode.

        `carry` [M, K]: a recurrent policy's state it acted on `obs` with.
        """
        t, n = self.rollout_len, self.num_envs
        fill = self._fill[env_ids]
        open_ = ~self._complete[env_ids]
        # A final observation's value is the final value of the row that ended there.
        ended = open_ & obs_is_final & (fill > 0)
        self._final_value[np.where(ended, fill - 1, t) * n + env_ids] = value
        # The observation after an environment's T-th row: its value bootstraps the column.
        at_end = open_ & (fill == t)
        self._bootstrap[np.where(at_end, env_ids, n)] = value
        self._complete[env_ids] = ~open_ | at_end
        write = open_ & ~obs_is_final & (fill < t)
        row = np.where(write, fill, t)
        flat = row * n + env_ids
        if carry is not None:
            self._carry[np.where(write & (fill == 0), env_ids, n)] = carry
        self._obs[flat] = obs
        self._action[flat] = action
        self._log_prob[flat] = log_prob
        self._value[flat] = value
        self._fill[env_ids] = fill + write
        self._row_of_action[env_ids] = row
        self._fate[env_ids] = np.where(write, _ROW, np.where(obs_is_final, _RESET, _DROPPED))

    def take(self) -> Rollout:
        """The finished trajectory; the builder starts an empty one."""
        if not self.full:
            raise RuntimeError("trajectory is not full yet")
        t, n = self.rollout_len, self.num_envs
        column = lambda flat: flat[: t * n].reshape(t, n, *flat.shape[1:])
        batch = Transition(column(self._obs), column(self._action), column(self._reward),
                           column(self._terminated), column(self._truncated), column(self._value),
                           column(self._log_prob), column(self._final_value))
        rollout = Rollout(batch, self._bootstrap[:n], int(self._counts[_DROPPED]), int(self._counts[_RESET]),
                          self._carry[:n] if self.carry_width else None)
        self._new_buffers()
        return rollout
