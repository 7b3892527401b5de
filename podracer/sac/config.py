"""SAC's algorithm settings: one frozen dataclass, nothing about devices or environments."""

from __future__ import annotations

import dataclasses

from podracer.bounds import NON_NEGATIVE, POSITIVE, UNIT, Bound, bounded, check_bounds

# What the NaN guard tells a user whose SAC run diverged.
SAC_FIX = "lower --lr or --max-grad-norm, or raise --batch-size"

HALF_OPEN_UNIT = Bound(0, 1, low_open=True)  # (0, 1]: a Polyak step that moves the targets at all


@dataclasses.dataclass(frozen=True)
class SACConfig:
    """Soft Actor-Critic (Haarnoja et al. 2018, with a learned temperature) hyperparameters.

    Defaults follow the common references (CleanRL, Stable-Baselines3): twin
    critics, Polyak targets with tau 0.005, a target entropy of -action_dim.
    """

    gamma: float = bounded(0.99, UNIT)
    """Discount factor."""
    tau: float = bounded(0.005, HALF_OPEN_UNIT)
    """Polyak step of the target critics after each gradient step: target <- (1 - tau) target + tau critic (1: copy)."""
    buffer_size: int = bounded(100_000, POSITIVE)
    """Transitions the replay buffer keeps (the oldest are overwritten); replicated on every device."""
    batch_size: int = bounded(256, POSITIVE)
    """Transitions per gradient step, drawn uniformly from the buffer (split over the devices: a multiple of their count)."""
    learning_starts: int = bounded(1_000, NON_NEGATIVE)
    """Transitions the buffer holds before the first gradient step (at least one batch)."""
    updates_per_rollout: int = bounded(8, POSITIVE)
    """Gradient steps after each rollout (of --num-envs x --rollout-len transitions) once the buffer is ready."""
    target_entropy_per_dim: float = -1.0
    """The entropy the temperature aims the policy at, per action dimension: -1 is SAC's -action_dim."""
    init_alpha: float = bounded(1.0, POSITIVE)
    """The temperature (the entropy's weight) to start from; it is then learned."""

    def __post_init__(self):
        check_bounds(self)
        if self.buffer_size < self.batch_size:
            raise ValueError(f"--buffer-size={self.buffer_size} is smaller than one batch "
                             f"(--batch-size={self.batch_size}); raise --buffer-size or lower --batch-size")
        if self.learning_starts > self.buffer_size:
            raise ValueError(f"--learning-starts={self.learning_starts} transitions never fit in "
                             f"--buffer-size={self.buffer_size}; lower --learning-starts or raise --buffer-size")

    def batch_problem(self, rollout_len: int, envs_per_device: int) -> str | None:
        """Any rollout fits a replay buffer: its transitions are added one by one."""
        del rollout_len, envs_per_device
        return None
