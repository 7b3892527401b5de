"""A short PPO run per JAX suite beats a random policy by a margin a broken adapter cannot reach.

Each test also runs its control: the same compiled program from the same
start, with the optimizer's step counters set to the end of its schedule,
where the learning rate has decayed to 0 (its parameters are checked not to
move), so it costs no second compilation. Untrained returns, measured so: Navix Empty-5x5 0.43, brax
inverted_pendulum 20 (the pole falls), Jumanji PacMan 98 (uniform over the
legal moves), Craftax about 1.3. Each run is Anakin's PPO program on one CPU
device, in this process (its time is mostly compilation, paid once for both);
the returns are those of the episodes that ended during a call.

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


def _schedule_spent(train_state, num_updates):
    """`train_state` with its optimizer's step counters at `num_updates`, the end of the learning rate's
    linear decay: the learning rate is 0 there, so the update moves nothing."""
    opt_state = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 0 + num_updates if jax.tree_util.keystr(path).endswith(".count") else x,
        train_state.opt_state)
    return train_state._replace(opt_state=opt_state)


def _returns(env_id, calls, num_envs, control_calls=1, rollout_len=32, updates_per_call=8, lr=1e-3,
             hidden=(64, 64), **ppo):
    """The mean return of the episodes that ended in each of `calls` train calls, and in each of
    `control_calls` calls of the control (the same program, from the same start, at a learning rate of 0)."""
    env = make_env(env_id)
    network = make_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete, hidden=hidden,
                           action_mask=env.spec.action_mask)
    ppo_config = PPOConfig(**ppo)
    config = AnakinConfig(num_envs=num_envs, rollout_len=rollout_len, updates_per_call=updates_per_call)
    num_updates = calls * updates_per_call * ppo_config.epochs * ppo_config.minibatches
    optimizer = make_optimizer(OptimConfig(lr=lr), num_updates)
    init, train, _, _ = make_programs(env, fixed_agent(make_agent, network, optimizer, ppo_config, env.spec,
                                                      config.rollout_len), config, parallel.make_mesh(jax.devices()[:1]))

    def play(runner, num_calls):
        returns = []
        for _ in range(num_calls):
            runner, metrics = train(runner)
            episodes = float(np.sum(metrics["episodes"]))
            returns.append(float(np.sum(metrics["episode_return_sum"])) / max(episodes, 1.0))
        return runner, returns

    _, learned = play(init(jax.random.PRNGKey(0)), calls)
    runner = init(jax.random.PRNGKey(0))
    initial = jax.device_get(runner.train.params)
    runner, control = play(runner._replace(train=_schedule_spent(runner.train, num_updates)), control_calls)
    # Zero to float precision (XLA may divide by the schedule's length as a product with its
    # reciprocal): a step of the learning run moves the parameters by about 1e-4.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6),
                 jax.device_get(runner.train.params), initial)
    return learned, control


def test_navix_learns_empty_room():
    pytest.importorskip("navix")
    returns, control = _returns("navix:Navix-Empty-5x5-v0", calls=4, num_envs=32)  # 32,768 steps
    assert returns[-1] > 0.9, returns  # untrained: 0.43; the goal is a few cells away
    assert control[-1] < 0.7, control


def test_brax_learns_inverted_pendulum():
    pytest.importorskip("brax")
    returns, control = _returns("brax:inverted_pendulum", calls=4, num_envs=64)  # 65,536 steps
    assert returns[-1] > 50, returns  # untrained: 20 steps upright; learned: about 67
    assert control[-1] < 35, control


def test_jumanji_learns_pacman_with_masks():
    pytest.importorskip("jumanji")
    assert make_env("jumanji:PacMan-v1").spec.action_mask
    returns, control = _returns("jumanji:PacMan-v1", calls=4, num_envs=64)  # 65,536 steps
    assert returns[-1] > 160, returns  # untrained: 98; learned: about 190; mask misread: about 120
    assert control[-1] < 130, control


def test_craftax_learns_what_a_blind_policy_cannot():
    pytest.importorskip("craftax")
    # 20 calls of 4 updates of 64 envs x 64 steps: 327,680 steps; about 2 minutes on a quiet
    # 2-core CPU, one of them compiling.
    returns, control = _returns("craftax:Craftax-Classic-Symbolic-v1", calls=20, num_envs=64, control_calls=2,
                                rollout_len=64, updates_per_call=4, lr=3e-4, hidden=(256, 256), ent_coef=0.01)
    # Blind (observations zeroed, measured apart): 2.94; seeing: 3.69.
    assert np.mean(returns[-4:]) > 3.3, returns
    # Untrained: 1.2-1.4 per episode (episodes end in the second call too: about 150 steps each).
    assert np.mean(control) < 2.0, control
