"""A short PPO run per JAX suite beats a random policy by a margin a broken adapter cannot reach.

Untrained-policy returns, measured with the same runs at a learning rate of 0:
Navix Empty-5x5 0.43, brax inverted_pendulum 20 (the pole falls), Jumanji
PacMan 98 (uniform over the legal moves). Each of these tests runs that control
too, for one call (a policy that never changes scores the same in any call). Each run is Anakin's PPO program on
one CPU device, in this process (its time is mostly compilation); the returns
are those of the episodes that ended during a call.

Craftax-Classic (symbolic) pays +1 per achievement unlocked in an episode
and +-0.1 per health point gained or lost: untrained, episodes of about 150
steps return 1.2-1.4 (four calls at a learning rate of 0). A policy that sees
nothing learns to about 3 too (the same run with every observation zeroed:
2.8-3.2 from 100k steps on, 2.94 over its last four calls), so the test runs
on until seeing pays: 3.69 over the last four calls of 328k steps.

Jumanji's Snake is no learning test at this size: uniform over its legal moves
a snake already eats about 5 fruit a game, and 100k steps of PPO do not eat
faster. PacMan learns within 50k steps, and its legal-move mask carries
weight: with the mask put first in the observation instead of last (the
network then reads features as legality), the same run stays near 120.
"""

import jax
import numpy as np
import pytest

from podracer.envs.jax_envs import make_env
from podracer.agent import fixed_agent
from podracer.anakin.loop import AnakinConfig, make_programs
from podracer.ppo import make_agent
from podracer.config import OptimConfig, make_optimizer
from podracer.networks import make_network
from podracer.ppo import PPOConfig
from podracer.protocol import parallel


def _returns(env_id, calls, num_envs, rollout_len=32, updates_per_call=8, lr=1e-3, hidden=(64, 64), **ppo):
    """The mean return of the episodes that ended in each of `calls` train calls."""
    env = make_env(env_id)
    network = make_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete, hidden=hidden,
                           action_mask=env.spec.action_mask)
    ppo_config = PPOConfig(**ppo)
    config = AnakinConfig(num_envs=num_envs, rollout_len=rollout_len, updates_per_call=updates_per_call)
    optimizer = make_optimizer(OptimConfig(lr=lr),
                               calls * updates_per_call * ppo_config.epochs * ppo_config.minibatches)
    init, train, _, _ = make_programs(env, fixed_agent(make_agent, network, optimizer, ppo_config, env.spec,
                                                      config.rollout_len), config, parallel.make_mesh(jax.devices()[:1]))
    runner, returns = init(jax.random.PRNGKey(0)), []
    for _ in range(calls):
        runner, metrics = train(runner)
        episodes = float(np.sum(metrics["episodes"]))
        returns.append(float(np.sum(metrics["episode_return_sum"])) / max(episodes, 1.0))
    return returns


def test_navix_learns_empty_room():
    pytest.importorskip("navix")
    returns = _returns("navix:Navix-Empty-5x5-v0", calls=4, num_envs=32)  # 32,768 steps
    assert returns[-1] > 0.9, returns  # untrained: 0.43; the goal is a few cells away
    control = _returns("navix:Navix-Empty-5x5-v0", calls=1, num_envs=32, lr=0.0)
    assert control[-1] < 0.7, control


def test_brax_learns_inverted_pendulum():
    pytest.importorskip("brax")
    returns = _returns("brax:inverted_pendulum", calls=4, num_envs=64)  # 65,536 steps
    assert returns[-1] > 50, returns  # untrained: 20 steps upright; learned: about 67
    control = _returns("brax:inverted_pendulum", calls=1, num_envs=64, lr=0.0)
    assert control[-1] < 35, control


def test_jumanji_learns_pacman_with_masks():
    pytest.importorskip("jumanji")
    assert make_env("jumanji:PacMan-v1").spec.action_mask
    returns = _returns("jumanji:PacMan-v1", calls=4, num_envs=64)  # 65,536 steps
    assert returns[-1] > 160, returns  # untrained: 98; learned: about 190; mask misread: about 120
    control = _returns("jumanji:PacMan-v1", calls=1, num_envs=64, lr=0.0)
    assert control[-1] < 130, control


def test_craftax_learns_what_a_blind_policy_cannot():
    pytest.importorskip("craftax")
    # 20 calls of 4 updates of 64 envs x 64 steps: 327,680 steps; about 2 minutes on a quiet
    # 2-core CPU, one of them compiling.
    returns = _returns("craftax:Craftax-Classic-Symbolic-v1", calls=20, num_envs=64, rollout_len=64,
                       updates_per_call=4, lr=3e-4, hidden=(256, 256), ent_coef=0.01)
    # Untrained: 1.2-1.4 per episode; blind (observations zeroed): 2.94; seeing: 3.69.
    assert np.mean(returns[-4:]) > 3.3, returns
