"""DQN's algorithm settings: one frozen dataclass, nothing about devices or envs."""

from __future__ import annotations

import dataclasses

from podracer import replay
from podracer.bounds import NON_NEGATIVE, POSITIVE, UNIT, Bound, bounded, check_bounds

# What the NaN guard tells a user whose DQN run diverged.
DQN_FIX = "lower --lr, or use --loss=huber, or a longer --target-update-period"

LOSSES = ("huber", "mse")


@dataclasses.dataclass(frozen=True)
class DQNConfig:
    """Deep Q-learning (Mnih et al. 2015) with double Q-learning (van Hasselt et al. 2016) and n-step returns.

    Counts: an "update" is one learning step of the architecture (one rollout
    added to the buffer); each takes `updates_per_rollout` gradient steps once
    the buffer holds `learning_starts` transitions (and at least one batch).
    """

    gamma: float = bounded(0.99, UNIT)
    """Discount factor."""
    n_step: int = bounded(1, POSITIVE)
    """Rewards summed before bootstrapping (n-step returns, cut short where an episode or the rollout ends); at most --rollout-len."""
    buffer_size: int = bounded(50_000, POSITIVE)
    """Transitions the replay buffer holds (the oldest are overwritten); at least --batch-size."""
    batch_size: int = bounded(128, POSITIVE)
    """Transitions per gradient step (split over the devices: a multiple of their count)."""
    learning_starts: int = bounded(1_000, NON_NEGATIVE)
    """Transitions in the buffer before the first gradient step."""
    updates_per_rollout: int = bounded(1, POSITIVE)
    """Gradient steps on sampled minibatches after each rollout is added."""
    target_update_period: int = bounded(100, POSITIVE)
    """Gradient steps between two target-network updates."""
    tau: float = bounded(1.0, Bound(0, 1, low_open=True))
    """Target update: target <- tau * online + (1 - tau) * target; 1.0 copies (periodic hard updates), small values with --target-update-period=1 are Polyak averaging."""
    double_q: bool = True
    """Double Q-learning: the online network picks the next action, the target network values it."""
    loss: str = "huber"
    """TD loss: huber (delta 1) or mse."""
    epsilon_start: float = bounded(1.0, UNIT)
    """Exploration rate of epsilon-greedy acting at the first update."""
    epsilon_end: float = bounded(0.05, UNIT)
    """Exploration rate after the decay (also that of the recorded and evaluated stochastic policy)."""
    epsilon_decay: int = bounded(100, POSITIVE)
    """Updates (rollouts) over which epsilon decays linearly from --epsilon-start to --epsilon-end."""

    def __post_init__(self):
        check_bounds(self)
        if self.loss not in LOSSES:
            raise ValueError(f"--loss must be huber or mse, got {self.loss!r}")
        problem = replay.capacity_problem(self.buffer_size, self.batch_size, self.learning_starts)
        if problem:
            raise ValueError(problem)

    def batch_problem(self, rollout_len: int, envs_per_device: int) -> str | None:
        """Why rollouts of `rollout_len` steps cannot hold this config's n-step returns, or None."""
        if self.n_step > rollout_len:
            return (f"--n-step={self.n_step} is longer than a rollout (--rollout-len={rollout_len}); "
                    f"lower --n-step or raise --rollout-len")
        return None
