"""PPO's algorithm settings: one frozen dataclass, nothing about devices or envs."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """Proximal Policy Optimisation (Schulman et al. 2017) hyperparameters.

    Defaults are the classic-control settings of the common single-file JAX PPO.
    """

    gamma: float = 0.99
    """Discount factor."""
    gae_lambda: float = 0.95
    """GAE's bias/variance trade-off (Schulman et al. 2016)."""
    clip_eps: float = 0.2
    """Clipping range of the probability ratio."""
    clip_value: bool = True
    """Clip the value update to `clip_eps` around the behaviour value."""
    ent_coef: float = 0.01
    """Weight of the entropy bonus."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    epochs: int = 4
    """Passes over each batch of experience."""
    minibatches: int = 4
    """Minibatches per epoch; the rollout length must divide by it."""
    normalize_advantages: bool = True
    """Standardise advantages per minibatch (statistics over every device)."""
    normalize_observations: bool = False
    """Standardise observations with running statistics kept in the train state."""
    unroll_minibatches: bool = False
    """Unroll the epoch/minibatch loop: faster convolution gradients on XLA:CPU, longer compile."""

    def __post_init__(self):
        for name in ("epochs", "minibatches"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be positive, got {getattr(self, name)}")
