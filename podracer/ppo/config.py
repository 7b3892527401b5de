"""PPO's algorithm settings: one frozen dataclass, nothing about devices or envs."""

from __future__ import annotations

import dataclasses

from podracer.bounds import NON_NEGATIVE, POSITIVE, UNIT, bounded, check_bounds


# What the NaN guard tells a user whose PPO run diverged.
PPO_FIX = "lower --lr or --max-grad-norm"


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """Proximal Policy Optimisation (Schulman et al. 2017) hyperparameters.

    Defaults are the classic-control settings of the common single-file JAX PPO.
    """

    gamma: float = bounded(0.99, UNIT)
    """Discount factor."""
    gae_lambda: float = bounded(0.95, UNIT)
    """GAE's bias/variance trade-off (Schulman et al. 2016)."""
    clip_eps: float = bounded(0.2, POSITIVE)
    """Clipping range of the probability ratio."""
    clip_value: bool = True
    """Clip the value update to `clip_eps` around the behaviour value."""
    ent_coef: float = bounded(0.01, NON_NEGATIVE)
    """Weight of the entropy bonus."""
    vf_coef: float = bounded(0.5, NON_NEGATIVE)
    """Weight of the value loss."""
    epochs: int = bounded(4, POSITIVE)
    """Passes over each batch of experience."""
    minibatches: int = bounded(4, POSITIVE)
    """Minibatches per epoch; the rollout length must divide by it."""
    normalize_advantages: bool = True
    """Standardise advantages per minibatch (statistics over every device)."""
    normalize_observations: bool = False
    """Standardise observations with running statistics kept in the train state."""
    unroll_minibatches: bool = False
    """Unroll the epoch/minibatch loop: faster convolution gradients on XLA:CPU, longer compile."""

    def __post_init__(self):
        check_bounds(self)

    def batch_problem(self, rollout_len: int, envs_per_device: int) -> str | None:
        """Why a [rollout_len, envs_per_device] batch cannot be cut into minibatches, or None."""
        if rollout_len % self.minibatches:
            return (f"--rollout-len={rollout_len} does not split into --minibatches={self.minibatches}; "
                    f"make the rollout length a multiple of the minibatch count")
        return None
