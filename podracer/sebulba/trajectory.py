"""Turn envpool's stream of steps into the agent contract's time-major `Trajectory`.

envpool ends an episode by returning its final observation; the environment's
next step is a reset that ignores the action and pays reward 0 (see
`podracer.sebulba.envs`). Acting on a final observation is therefore no
transition, and learning from it would teach the agent about an action that
did nothing. So such rows are not written at all: each environment's column
holds only its real transitions, one after another, and a column continues
with the next episode's first observation right after a row that ended an
episode. The final observation is kept as the `final_obs` of the row that
ended the episode (what a truncated episode bootstraps from), and the
observation after an environment's last row as its `next_obs`: the same
`Trajectory` Anakin records, which the agent's `prepare` turns into its batch.

An agent's carry (its recurrent state) is recorded per row as `act` returned
it, and where each column's first row is written as the carry that row was
acted on with (`Collected.initial_carry`). The learner replays the column from
it, zeroing the carry after every row that ended an episode, as the actor did
before the next episode's first observation (the final observation in between
is acted on but not recorded, and its carry is discarded by that reset).

Environments do not finish their T rows at the same moment, because they skip
different numbers of reset steps. An environment with T rows (and its next
observation) keeps stepping, its extra steps unrecorded (`dropped`), until
every environment is done; then the trajectory is taken and the next one
starts from the observations the actor holds. So every row of a trajectory was
acted on by the same parameters, and a trajectory is a contiguous stretch of
each environment's experience.

For an agent that evaluates one new episode per environment and rollout
(`Agent.fresh_episodes`), the actor resets the whole batch before each
rollout (`restart`), and a column is complete as soon as its first episode
ends: its remaining rows stay zeros, which the agent's `prepare` masks
(`podracer.agent.first_episode`). The trajectory is taken once every
environment's first episode has ended (or filled its T rows), not after T
rows of each.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from podracer.agent import Trajectory


class Collected(NamedTuple):
    """A finished trajectory on the host: numpy [T, N, ...] rows, and what went with them."""

    trajectory: Trajectory
    initial_carry: Any  # [N, ...] leaves: the carry each column's first row was acted on with (() without one)
    dropped_steps: int  # steps of environments that already had their T rows
    reset_steps: int  # actions on final observations, ignored by the environment


# What became of the action an environment was last sent (_UNSENT: none yet).
_ROW, _RESET, _DROPPED, _UNSENT = 0, 1, 2, 3


def _zeros(example, leading: int):
    """Zeros of `example`'s leaves (anything with `shape` and `dtype`: one environment's) for `leading` rows."""
    return jax.tree.map(lambda x: np.zeros((leading, *x.shape), x.dtype), example)


def _scatter(buffers, index: np.ndarray, values) -> None:
    for buffer, value in zip(jax.tree.leaves(buffers), jax.tree.leaves(values), strict=True):
        buffer[index] = value


class TrajectoryBuilder:
    """Collects T real transitions for each of N environments.

    Per `recv`, call `record_results` (the answer to the previous actions), then
    `record_actions` (what `act` did on the new observations). When `full`,
    `take` the trajectory; to start the next one from the same observations, call
    `record_actions` again with the new acting state's outputs before sending them.

    `step` is one environment's `(obs, action, extras)` and `carry` its carry
    (`()` without one): leaves with a `shape` and a `dtype`, as `jax.eval_shape`
    gives them. Buffers are flat [(T + 1) * N, ...] arrays: every call scatters
    the whole batch at once, and whatever must not be recorded lands in the
    spare row T, which `take` leaves out. This keeps the per-step cost to a few
    numpy calls.
    """

    def __init__(self, rollout_len: int, num_envs: int, step: Any, carry: Any = (), first_episode: bool = False):
        self.rollout_len = rollout_len
        self._first_episode = first_episode  # a column ends with its first episode
        self.num_envs = num_envs
        self._step, self._carry_example = step, carry
        self._has_carry = bool(jax.tree.leaves(carry))
        # Rows of an observation and an action only (no extras, no carry): written without flattening.
        self._plain = not jax.tree.leaves((step[2], carry))
        self._fill = np.zeros(num_envs, np.int64)  # rows written per environment
        self._complete = np.zeros(num_envs, bool)  # T rows and a next observation
        # Where the result of each environment's last action goes (row T: nowhere), and why.
        self._row_of_action = np.full(num_envs, rollout_len, np.int64)
        self._fate = np.full(num_envs, _UNSENT, np.int8)
        self._new_buffers()

    def _new_buffers(self) -> None:
        # Fresh arrays per trajectory: a shipped trajectory may still be read (or
        # aliased by a device buffer) while the next one is being written.
        rows, n = (self.rollout_len + 1) * self.num_envs, self.num_envs
        obs = self._step[0]
        self._rows = _zeros((self._step, self._carry_example), rows)  # ((obs, action, extras), carry after)
        self._row_leaves = jax.tree.leaves(self._rows)
        self._final_obs = _zeros(obs, rows)
        self._reward = np.zeros(rows, np.float32)
        self._terminated = np.zeros(rows, bool)
        self._truncated = np.zeros(rows, bool)
        # [N] is the spare slot of these.
        self._next = _zeros((obs, self._carry_example), n + 1)  # (next_obs, next_carry)
        self._initial_carry = _zeros(self._carry_example, n + 1)
        self._fill[:] = 0
        self._complete[:] = False
        self._counts = np.zeros(4, np.int64)  # results per fate, this trajectory

    def restart(self) -> None:
        """Every environment was reset: the results that follow answer no recorded action."""
        self._row_of_action[:] = self.rollout_len
        self._fate[:] = _UNSENT

    @property
    def complete(self) -> np.ndarray:
        """[N] bool: the environments whose column is finished (read-only)."""
        return self._complete

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
                       action: np.ndarray, extras: Any = (), carry_in: Any = (), carry_out: Any = ()) -> None:
        """What `act` did on `obs` from `carry_in` (returning `action`, `carry_out`, `extras`).

        `obs_is_final` where `obs` ended an episode. Leaves are [M, ...], for the M
        environments `env_ids`.
        """
        t, n = self.rollout_len, self.num_envs
        fill = self._fill[env_ids]
        open_ = ~self._complete[env_ids]
        # A final observation is the final observation of the row that ended there.
        # (The writes of rare events are skipped when none happened: this runs every step.)
        ended = open_ & obs_is_final & (fill > 0) if obs_is_final.any() else obs_is_final
        if ended.any():
            self._final_obs[np.where(ended, fill - 1, t) * n + env_ids] = obs
            if self._first_episode:
                self._complete[env_ids] |= ended
        # The observation after an environment's T-th row, and the carry to act on it with.
        at_end = open_ & (fill == t)
        if at_end.any():
            _scatter(self._next, np.where(at_end, env_ids, n), (obs, carry_in))
            self._complete[env_ids] |= at_end
        write = open_ & ~obs_is_final & (fill < t)
        row = np.where(write, fill, t)
        if self._has_carry:
            _scatter(self._initial_carry, np.where(write & (fill == 0), env_ids, n), carry_in)
        values = (obs, action) if self._plain else jax.tree.leaves(((obs, action, extras), carry_out))
        index = row * n + env_ids
        for buffer, value in zip(self._row_leaves, values, strict=True):
            buffer[index] = value
        self._fill[env_ids] = fill + write
        self._row_of_action[env_ids] = row
        self._fate[env_ids] = np.where(write, _ROW, np.where(obs_is_final, _RESET, _DROPPED))

    def take(self) -> Collected:
        """The finished trajectory; the builder starts an empty one."""
        if not self.full:
            raise RuntimeError("trajectory is not full yet")
        t, n = self.rollout_len, self.num_envs
        column = lambda flat: flat[: t * n].reshape(t, n, *flat.shape[1:])
        ((obs, action, extras), carry), final_obs = jax.tree.map(column, (self._rows, self._final_obs))
        next_obs, next_carry = jax.tree.map(lambda x: x[:n], self._next)
        trajectory = Trajectory(obs, action, column(self._reward), column(self._terminated),
                                column(self._truncated), final_obs, extras, carry, next_obs, next_carry)
        collected = Collected(trajectory, jax.tree.map(lambda x: x[:n], self._initial_carry),
                              int(self._counts[_DROPPED]), int(self._counts[_RESET]))
        self._new_buffers()
        return collected
