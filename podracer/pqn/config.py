"""PQN's algorithm settings: one frozen dataclass, nothing about devices or envs."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from podracer.bounds import NON_NEGATIVE, POSITIVE, UNIT, bounded, check_bounds
from podracer.ppo.config import PPOConfig

if TYPE_CHECKING:  # the command line's run spec, built above this layer
    from podracer.orchestrate.spec import RunSpec


# What the NaN guard tells a user whose PQN run diverged.
PQN_FIX = "lower --lr or --max-grad-norm, or scale rewards down with --reward-scale"


@dataclasses.dataclass(frozen=True)
class PQNConfig:
    """PQN (Gallici et al. 2024, "Simplifying Deep Temporal Difference Learning") hyperparameters.

    Parallelised Q-learning: a layer-normed Q-network learns from Q(lambda)
    targets of the rollout the vectorised environments just produced, in a few
    epochs of minibatches, with no target network and no replay buffer. Field
    names shared with `PPOConfig` (gamma, epochs, minibatches) mean the same and
    are the same flags.
    """

    gamma: float = bounded(0.99, UNIT)
    """Discount factor."""
    q_lambda: float = bounded(0.65, UNIT)
    """Q(lambda)'s trade-off: 0 is one-step Q-learning, 1 the rollout's discounted return bootstrapped at its end."""
    epsilon_start: float = bounded(1.0, UNIT)
    """Epsilon-greedy's chance of a random action at the first update."""
    epsilon_end: float = bounded(0.05, UNIT)
    """Epsilon once decayed, kept to the end of the run (and used by a stochastic evaluation)."""
    epsilon_decay_fraction: float = bounded(0.2, UNIT)
    """Fraction of the run's updates over which epsilon falls linearly from --epsilon-start to --epsilon-end."""
    schedule_updates: int = bounded(0, NON_NEGATIVE)
    """Updates the epsilon schedule spans (--epsilon-decay-fraction is a fraction of them). 0: the run's own count, from --total-steps, filled in when the command line is read; a run resumed with a larger --total-steps keeps its schedule by giving the saved value."""
    reward_scale: float = bounded(1.0, POSITIVE)
    """Rewards are multiplied by this before the targets are computed (the returns logged are not)."""
    epochs: int = bounded(4, POSITIVE)
    """Passes over each rollout."""
    minibatches: int = bounded(4, POSITIVE)
    """Minibatches per epoch; the rollout length must divide by it."""

    def __post_init__(self):
        check_bounds(self)

    # Minibatches are cut along each environment's steps, as PPO's are: the same rollout lengths fit.
    batch_problem = PPOConfig.batch_problem


def with_run_updates(configs: RunSpec) -> PQNConfig:
    """The `pqn` section with `schedule_updates` set to the updates the run trains for, unless given.

    Anakin trains whole calls of `updates_per_call` updates of `num_envs x
    rollout_len` steps (`podracer.anakin.train.build`), Sebulba whole updates.
    """
    config, run = configs.agent, configs.run
    if config.schedule_updates:
        return config
    arch = configs.architecture
    per_call = getattr(arch, "updates_per_call", 1)
    calls = max(1, math.ceil(run.total_steps / (arch.num_envs * arch.rollout_len * per_call)))
    return dataclasses.replace(config, schedule_updates=calls * per_call)
