"""Trajectories from envpool's auto-reset stream: hand-made sequences, GAE on them, real envs."""

import numpy as np
import pytest

from podracer.ppo import gae_advantages
from podracer.sebulba.envs import EnvPoolEnvs
from podracer.sebulba.trajectory import TrajectoryBuilder

F, T = False, True


def _builder(rollout_len, num_envs):
    return TrajectoryBuilder(rollout_len, num_envs, (), np.float32, (), np.int32)


def _feed(builder, ids, obs, reward, term, trunc, value):
    """One recv: results of the previous actions, then the policy's output on `obs`."""
    ids = np.asarray(ids)
    term, trunc = np.asarray(term), np.asarray(trunc)
    builder.record_results(ids, np.asarray(reward, np.float32), term, trunc)
    builder.record_actions(ids, np.asarray(obs, np.float32), term | trunc,
                           np.zeros(len(ids), np.int32), np.zeros(len(ids), np.float32),
                           np.asarray(value, np.float32))


def test_reset_steps_are_skipped_and_final_values_kept():
    # Two environments, T = 3. Env 0 is truncated after its 2nd step, env 1
    # terminates after its 1st and is truncated after its 3rd. Observation ids
    # are 100+k (env 0) and 200+k (env 1); the policy's value of each is its id / 10.
    b = _builder(3, 2)
    _feed(b, [0, 1], [100, 200], [0, 0], [F, F], [F, F], [10.0, 20.0])   # reset
    _feed(b, [0, 1], [101, 201], [1, 1], [F, T], [F, F], [10.1, 20.1])   # env 1: final obs
    _feed(b, [0, 1], [102, 202], [1, 0], [F, F], [T, F], [10.2, 20.2])   # env 0: final obs; env 1: reset
    _feed(b, [0, 1], [103, 203], [0, 1], [F, F], [F, F], [10.3, 20.3])   # env 0: reset
    assert not b.full
    _feed(b, [0, 1], [104, 204], [1, 1], [F, F], [F, T], [10.4, 20.4])   # env 1: final obs
    assert b.full
    rollout = b.take()
    batch = rollout.batch
    np.testing.assert_array_equal(batch.obs, [[100, 200], [101, 202], [103, 203]])
    np.testing.assert_array_equal(batch.reward, [[1, 1], [1, 1], [1, 1]])
    np.testing.assert_array_equal(batch.terminated, [[F, T], [F, F], [F, F]])
    np.testing.assert_array_equal(batch.truncated, [[F, F], [T, F], [F, T]])
    np.testing.assert_allclose(batch.value, [[10.0, 20.0], [10.1, 20.2], [10.3, 20.3]])
    # Where truncated, the final value is the value of the episode's final observation.
    np.testing.assert_allclose(batch.final_value[batch.truncated], [10.2, 20.4])
    np.testing.assert_allclose(rollout.bootstrap_value, [10.4, 20.4])
    assert rollout.reset_steps == 2 and rollout.dropped_steps == 0  # env 1's 2nd reset is pending


def test_gae_on_a_built_trajectory_matches_hand_computation():
    b = _builder(3, 2)
    _feed(b, [0, 1], [100, 200], [0, 0], [F, F], [F, F], [10.0, 20.0])
    _feed(b, [0, 1], [101, 201], [1, 1], [F, T], [F, F], [11.0, 21.0])
    _feed(b, [0, 1], [102, 202], [1, 0], [F, F], [T, F], [12.0, 22.0])
    _feed(b, [0, 1], [103, 203], [0, 1], [F, F], [F, F], [13.0, 23.0])
    _feed(b, [0, 1], [104, 204], [1, 1], [F, F], [F, T], [14.0, 24.0])
    rollout = b.take()
    x = rollout.batch
    gamma, lam = 0.9, 0.8
    advantages, _ = gae_advantages(x.reward, x.value, rollout.bootstrap_value, x.terminated,
                                   x.truncated, x.final_value, gamma, lam)
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
    _feed(b, [0, 1], [100, 200], [0, 0], [F, F], [F, F], [0, 0])
    _feed(b, [0, 1], [101, 201], [1, 1], [F, T], [F, F], [0, 0])
    _feed(b, [0, 1], [102, 202], [1, 0], [F, F], [F, F], [0, 0])  # env 0 has 2 rows, 102 bootstraps
    _feed(b, [0, 1], [103, 203], [1, 1], [F, F], [F, F], [0, 0])  # env 0's step 102 -> 103 is dropped
    assert b.full
    first = b.take()
    np.testing.assert_array_equal(first.batch.obs, [[100, 200], [101, 202]])
    np.testing.assert_array_equal(first.bootstrap_value, [0, 0])
    assert (first.dropped_steps, first.reset_steps) == (1, 1)
    # The next trajectory starts from the observations just acted on, re-acted on
    # by the new policy (values 7 and 8).
    b.record_actions(np.array([0, 1]), np.array([103.0, 203.0], np.float32), np.array([F, F]),
                     np.zeros(2, np.int32), np.zeros(2, np.float32), np.array([7.0, 8.0], np.float32))
    _feed(b, [0, 1], [104, 204], [5, 6], [F, F], [F, F], [0, 0])
    _feed(b, [0, 1], [105, 205], [1, 1], [F, F], [F, F], [0, 0])
    second = b.take()
    np.testing.assert_array_equal(second.batch.obs, [[103, 203], [104, 204]])
    np.testing.assert_array_equal(second.batch.value[0], [7, 8])
    np.testing.assert_array_equal(second.batch.reward[0], [5, 6])


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
    b = TrajectoryBuilder(t, n, (), np.float64, (), np.int32)
    obs_of = np.zeros(n, np.int64)
    trajectories = []
    for _ in range(400):
        ids = np.sort(rng.choice(n, size=3, replace=False)) if async_batches else np.arange(n)
        obs, reward, term, trunc = envs.step(ids)
        obs_of[ids] = obs
        b.record_results(ids, reward, term, trunc)
        value = obs.astype(np.float32) % 100_000  # the value of an observation is its count
        b.record_actions(ids, obs.astype(np.float64), term | trunc, np.zeros(len(ids), np.int32),
                         np.zeros(len(ids), np.float32), value)
        if b.full:
            trajectories.append(b.take())
            b.record_actions(ids, obs.astype(np.float64), term | trunc, np.zeros(len(ids), np.int32),
                             np.zeros(len(ids), np.float32), value)
    assert len(trajectories) > 10
    for rollout in trajectories:
        x = rollout.batch
        count = x.obs % 100_000
        done = x.terminated | x.truncated
        assert np.all(x.reward == 1.0)  # no reset step became a row
        # After a row that ends an episode, skip the final obs and the reset result.
        np.testing.assert_array_equal(count[1:], count[:-1] + np.where(done[:-1], 2, 1))
        np.testing.assert_array_equal(x.final_value[x.truncated], count[x.truncated] + 1)
        np.testing.assert_array_equal(rollout.bootstrap_value, count[-1] + 1)


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
