"""IMPALA's algorithm settings: one frozen dataclass, nothing about devices or envs."""

from __future__ import annotations

import dataclasses

from podracer.bounds import NON_NEGATIVE, POSITIVE, UNIT, bounded, check_bounds

# What the NaN guard tells a user whose IMPALA run diverged.
IMPALA_FIX = "lower --lr or --max-grad-norm"


@dataclasses.dataclass(frozen=True)
class ImpalaConfig:
    """IMPALA (Espeholt et al. 2018): V-trace actor-critic hyperparameters.

    Field names shared with `PPOConfig` (gamma, ent_coef, vf_coef, epochs,
    minibatches, normalize_*) mean the same and are the same flags.
    """

    gamma: float = bounded(0.99, UNIT)
    """Discount factor."""
    vtrace_lambda: float = bounded(1.0, UNIT)
    """V-trace's lambda: c_t = lambda * min(c_bar, rho_t) (1 is the paper's V-trace)."""
    rho_bar: float = bounded(1.0, POSITIVE)
    """Truncation of the importance weights in the value targets (the fixed point's policy)."""
    c_bar: float = bounded(1.0, POSITIVE)
    """Truncation of the trace-cutting weights c_t (the contraction's speed)."""
    pg_rho_bar: float = bounded(1.0, POSITIVE)
    """Truncation of the importance weights of the policy-gradient advantages."""
    importance_weights: bool = True
    """Correct for the actors' stale policies; off, every importance weight is 1 (an ablation: the on-policy targets of a lagged policy)."""
    ent_coef: float = bounded(0.01, NON_NEGATIVE)
    """Weight of the entropy bonus."""
    vf_coef: float = bounded(0.5, NON_NEGATIVE)
    """Weight of the value loss."""
    epochs: int = bounded(1, POSITIVE)
    """Passes over each batch of experience (1 is the paper's IMPALA)."""
    minibatches: int = bounded(1, POSITIVE)
    """Minibatches per epoch, split over environments (V-trace runs along each whole column); each device's environments must divide by it."""
    normalize_advantages: bool = False
    """Standardise the policy-gradient advantages per minibatch (statistics over every device)."""
    normalize_observations: bool = False
    """Standardise observations with running statistics kept in the train state."""

    def __post_init__(self):
        check_bounds(self)

    def batch_problem(self, rollout_len: int, envs_per_device: int) -> str | None:
        """Why a [rollout_len, envs_per_device] batch cannot be cut into minibatches, or None."""
        if envs_per_device % self.minibatches:
            return (f"each learner device's {envs_per_device} environments do not split into "
                    f"--minibatches={self.minibatches} (IMPALA splits environments, not time); "
                    f"use a divisor of {envs_per_device}")
        return None
