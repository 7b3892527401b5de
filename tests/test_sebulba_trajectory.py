"""Trajectories from envpool's auto-reset stream: hand-made sequences, GAE on them, real envs."""

import numpy as np
import pytest

from podracer.ppo import gae_advantages
from podracer.sebulba.envs import EnvPoolEnvs
from podracer.sebulba.trajectory import TrajectoryBuilder

F, T = False, True


def _builder(rollout_len, num_envs, obs_dtype=np.float32, carry=()):
    # One environment's (observation, action, extras: a log-probability).
    step = (np.zeros((), obs_dtype), np.zeros((), np.int32), np.zeros((), np.float32))
    return TrajectoryBuilder(rollout_len, num_envs, step, carry)


def _feed(builder, ids, obs, reward, term, trunc, log_prob=None):
    """One recv: results of the previous actions, then what `act` did on `obs`."""
    ids = np.asarray(ids)
    term, trunc = np.asarray(term), np.asarray(trunc)
    builder.record_results(ids, np.asarray(reward, np.float32), term, trunc)
    log_prob = np.zeros(len(ids), np.float32) if log_prob is None else np.asarray(log_prob, np.float32)
    builder.record_actions(ids, np.asarray(obs, np.float32), term | trunc, np.zeros(len(ids), np.int32), log_prob)


def test_reset_steps_are_skipped_and_final_observations_kept():
    # Two environments, T = 3. Env 0 is truncated after its 2nd step, env 1
    # terminates after its 1st and is truncated after its 3rd. Observation ids
    # are 100+k (env 0) and 200+k (env 1).
    b = _builder(3, 2)
    _feed(b, [0, 1], [100, 200], [0, 0], [F, F], [F, F])   # reset
    _feed(b, [0, 1], [101, 201], [1, 1], [F, T], [F, F])   # env 1: final obs
    _feed(b, [0, 1], [102, 202], [1, 0], [F, F], [T, F])   # env 0: final obs; env 1: reset
    _feed(b, [0, 1], [103, 203], [0, 1], [F, F], [F, F])   # env 0: reset
    assert not b.full
    _feed(b, [0, 1], [104, 204], [1, 1], [F, F], [F, T])   # env 1: final obs
    assert b.full
    collected = b.take()
    x = collected.trajectory
    np.testing.assert_array_equal(x.obs, [[100, 200], [101, 202], [103, 203]])
    np.testing.assert_array_equal(x.reward, [[1, 1], [1, 1], [1, 1]])
    np.testing.assert_array_equal(x.terminated, [[F, T], [F, F], [F, F]])
    np.testing.assert_array_equal(x.truncated, [[F, F], [T, F], [F, T]])
    # Where an episode ended, the final observation is the one that ended it.
    np.testing.assert_array_equal(x.final_obs[x.terminated | x.truncated], [201, 102, 204])
    np.testing.assert_array_equal(x.next_obs, [104, 204])
    assert collected.reset_steps == 2 and collected.dropped_steps == 0  # env 1's 2nd reset is pending


def test_first_episode_columns_end_with_their_episode_and_restart_after_a_whole_reset():
    """One fresh episode per environment (ES): a column is complete when its first episode ends,
    its other rows zeros; the trajectory is taken once every column is, not after T rows of each."""
    b = TrajectoryBuilder(4, 2, (np.zeros((), np.float32), np.zeros((), np.int32), np.zeros((), np.float32)),
                          first_episode=True)
    for rollout in range(2):  # the second after the whole batch was reset
        _feed(b, [0, 1], [100, 200], [0, 0], [F, F], [F, F])   # reset
        _feed(b, [0, 1], [101, 201], [1, 2], [T, F], [F, F])   # env 0 ends after one step
        assert b.complete.tolist() == [True, False] and not b.full
        _feed(b, [0, 1], [102, 202], [0, 2], [F, F], [F, F])   # env 0 resets and plays on, unrecorded
        _feed(b, [0, 1], [103, 203], [5, 2], [F, F], [F, T])   # env 1 is cut after three
        assert b.full
        collected = b.take()
        x = collected.trajectory
        np.testing.assert_array_equal(x.obs, [[100, 200], [0, 201], [0, 202], [0, 0]])
        np.testing.assert_array_equal(x.reward, [[1, 2], [0, 2], [0, 2], [0, 0]])
        np.testing.assert_array_equal(x.terminated, [[T, F], [F, F], [F, F], [F, F]])
        np.testing.assert_array_equal(x.truncated, [[F, F], [F, F], [F, T], [F, F]])
        # Env 0's reset and its step after it: results that count for nothing.
        assert (collected.reset_steps, collected.dropped_steps) == (1, 1)
        b.restart()


def test_gae_on_a_built_trajectory_matches_hand_computation():
    b = _builder(3, 2)
    _feed(b, [0, 1], [100, 200], [0, 0], [F, F], [F, F])
    _feed(b, [0, 1], [101, 201], [1, 1], [F, T], [F, F])
    _feed(b, [0, 1], [102, 202], [1, 0], [F, F], [T, F])
    _feed(b, [0, 1], [103, 203], [0, 1], [F, F], [F, F])
    _feed(b, [0, 1], [104, 204], [1, 1], [F, F], [F, T])
    x = b.take().trajectory
    # What an actor-critic's `prepare` does: values of the observations acted on, of
    # the final ones and of the next one. Here obs 10k -> value k, obs 20k -> value 2k.
    value_of = lambda obs: np.where(obs < 200, obs - 90, obs - 180).astype(np.float32)
    gamma, lam = 0.9, 0.8
    advantages, _ = gae_advantages(x.reward, value_of(x.obs), value_of(x.next_obs), x.terminated,
                                   x.truncated, value_of(x.final_obs), gamma, lam)
    # Env 0: rows act on obs 100, 101, 103 (102 was the final obs, truncated).
    a2 = 1 + gamma * 14 - 13
    a1 = 1 + gamma * 12 - 11  # bootstraps from the final obs, no carry past the episode end
    a0 = 1 + gamma * 11 - 10 + gamma * lam * a1
    # Env 1: terminated on row 0; rows 1, 2 act on 202, 203; 204 ended it truncated.
    b2 = 1 + gamma * 24 - 23
    b1 = 1 + gamma * 23 - 22 + gamma * lam * b2
    b0 = 1 - 20
    np.testing.assert_allclose(np.asarray(advantages), [[a0, b0], [a1, b1], [a2, b2]], atol=1e-5)


def test_finished_environments_wait_unrecorded_and_next_trajectory_starts_where_acted():
    b = _builder(2, 2)
    _feed(b, [0, 1], [100, 200], [0, 0], [F, F], [F, F])
    _feed(b, [0, 1], [101, 201], [1, 1], [F, T], [F, F])
    _feed(b, [0, 1], [102, 202], [1, 0], [F, F], [F, F])  # env 0 has 2 rows, 102 bootstraps
    _feed(b, [0, 1], [103, 203], [1, 1], [F, F], [F, F])  # env 0's step 102 -> 103 is dropped
    assert b.full
    first = b.take()
    np.testing.assert_array_equal(first.trajectory.obs, [[100, 200], [101, 202]])
    np.testing.assert_array_equal(first.trajectory.next_obs, [102, 203])
    assert (first.dropped_steps, first.reset_steps) == (1, 1)
    # The next trajectory starts from the observations just acted on, re-acted on
    # by the new acting state (log-probabilities 7 and 8).
    b.record_actions(np.array([0, 1]), np.array([103.0, 203.0], np.float32), np.array([F, F]),
                     np.zeros(2, np.int32), np.array([7.0, 8.0], np.float32))
    _feed(b, [0, 1], [104, 204], [5, 6], [F, F], [F, F])
    _feed(b, [0, 1], [105, 205], [1, 1], [F, F], [F, F])
    second = b.take().trajectory
    np.testing.assert_array_equal(second.obs, [[103, 203], [104, 204]])
    np.testing.assert_array_equal(second.extras[0], [7, 8])
    np.testing.assert_array_equal(second.reward[0], [5, 6])


class _ScriptedEnvs:
    """Envpool's auto-reset semantics in miniature: observation ids count every recv of an env."""

    def __init__(self, num_envs, rng, end_prob=0.2):
        self.rng, self.end_prob = rng, end_prob
        self.count = np.zeros(num_envs, np.int64)
        self.final = np.zeros(num_envs, bool)

    def step(self, ids):
        """Results for `ids`: (obs id, reward, terminated, truncated)."""
        reset = self.final[ids]
        self.count[ids] += 1
        end = (self.rng.random(len(ids)) < self.end_prob) & ~reset
        term = end & (self.rng.random(len(ids)) < 0.5)
        trunc = end & ~term
        self.final[ids] = end
        obs = ids * 100_000 + self.count[ids]
        return obs, np.where(reset, 0.0, 1.0), term, trunc


@pytest.mark.parametrize("async_batches", [False, True])
def test_random_streams_give_contiguous_columns_of_real_transitions(async_batches):
    rng = np.random.default_rng(0)
    n, t = 6, 5
    envs = _ScriptedEnvs(n, rng)
    # A carry [2] per environment: acted on with (count, 0), returning (count, 1).
    b = _builder(t, n, np.float64, carry=np.zeros(2, np.float32))
    trajectories = []

    def act(ids, obs, term, trunc):
        count = (obs % 100_000).astype(np.float32)
        carry_in = np.stack([count, np.zeros_like(count)], axis=1)
        b.record_actions(ids, obs.astype(np.float64), term | trunc, np.zeros(len(ids), np.int32),
                         np.zeros(len(ids), np.float32), carry_in, carry_in + [0, 1])

    for _ in range(400):
        ids = np.sort(rng.choice(n, size=3, replace=False)) if async_batches else np.arange(n)
        obs, reward, term, trunc = envs.step(ids)
        b.record_results(ids, reward, term, trunc)
        act(ids, obs, term, trunc)
        if b.full:
            trajectories.append(b.take())
            act(ids, obs, term, trunc)
    assert len(trajectories) > 10
    for collected in trajectories:
        x = collected.trajectory
        count = x.obs % 100_000
        done = x.terminated | x.truncated
        assert np.all(x.reward == 1.0)  # no reset step became a row
        # After a row that ends an episode, skip the final obs and the reset result.
        np.testing.assert_array_equal(count[1:], count[:-1] + np.where(done[:-1], 2, 1))
        np.testing.assert_array_equal(x.final_obs[done] % 100_000, count[done] + 1)
        np.testing.assert_array_equal(x.next_obs % 100_000, count[-1] + 1)
        # Each row's carry is the one acting on it returned; a column's first carry
        # and its next one are those acted from.
        np.testing.assert_array_equal(x.carry, np.stack([count, np.ones_like(count)], axis=-1))
        np.testing.assert_array_equal(collected.initial_carry, np.stack([count[0], 0 * count[0]], axis=-1))
        np.testing.assert_array_equal(x.next_carry, np.stack([count[-1] + 1, 0 * count[-1]], axis=-1))


def test_cartpole_episode_returns_count_agent_steps_only():
    envs = EnvPoolEnvs("CartPole-v1", num_envs=16, batch_size=16, num_threads=1, seed=3)
    envs.start()
    rng = np.random.default_rng(0)
    returns, lengths = [], []
    for _ in range(300):
        step = envs.recv()
        returns += list(step.episode_return[step.episode_done])
        lengths += list(step.episode_length[step.episode_done])
        envs.send(rng.integers(0, 2, size=len(step.env_ids)), step.env_ids)
    envs.close()
    assert len(returns) > 50
    np.testing.assert_array_equal(returns, lengths)  # reward 1 per agent step, 0 on resets
    assert 8 <= min(lengths) and np.mean(lengths) < 60  # a random policy's episodes


def test_atari_reports_the_game_not_each_life():
    envs = EnvPoolEnvs("Breakout-v5", num_envs=2, batch_size=2, num_threads=1, seed=0)
    envs.start()
    rng = np.random.default_rng(0)
    lives_lost = np.zeros(2, int)
    finished = []
    for _ in range(3000):
        step = envs.recv()
        lives_lost[step.env_ids] += step.terminated
        for i in step.env_ids[step.episode_done]:
            finished.append(lives_lost[i])
            lives_lost[i] = 0
        if len(finished) >= 2:
            break
        envs.send(rng.integers(0, 4, size=len(step.env_ids)), step.env_ids)
    envs.close()
    assert finished == [5, 5]  # every life lost is `terminated` for learning; the game is one episode
