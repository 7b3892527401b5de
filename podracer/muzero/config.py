"""MuZero's algorithm settings: one frozen dataclass, nothing about devices or environments."""

from __future__ import annotations

import dataclasses
import math

from podracer.bounds import NON_NEGATIVE, POSITIVE, UNIT, Bound, bounded, check_bounds
from podracer.errors import PodracerError
from podracer.muzero.targets import support_limit, support_needed

# What the NaN guard tells a user whose MuZero run diverged.
MUZERO_FIX = "lower --lr or --max-grad-norm"

AT_LEAST_ONE = Bound(1)


@dataclasses.dataclass(frozen=True)
class MuZeroConfig:
    """Gumbel MuZero (Danihelka et al. 2022) on a learned model (Schrittwieser et al. 2020).

    Acting searches the model with mctx's `gumbel_muzero_policy`; learning
    replays sequences, unrolls the model along their actions and fits the
    policy to the search's improved policy, the value to n-step returns of a
    target network and the reward to the rewards seen.
    """

    num_simulations: int = bounded(8, AT_LEAST_ONE)
    """Model evaluations per search (per action taken); Gumbel MuZero improves the policy with as few as 2."""
    max_considered_actions: int = bounded(16, Bound(2))
    """Actions sampled without replacement at the root (Gumbel top-k), then halved sequentially over the simulations."""
    gamma: float = bounded(0.99, UNIT)
    """Discount factor, in the search and in the value targets."""
    td_steps: int = bounded(10, AT_LEAST_ONE)
    """n of the n-step value targets, bootstrapped from the target network's value."""
    unroll_steps: int = bounded(5, AT_LEAST_ONE)
    """Steps the dynamics network is unrolled along each replayed sequence's actions."""
    sequence_len: int = bounded(16, Bound(2))
    """Length of the replayed sequences; each needs --unroll-steps + --td-steps + 1 steps."""
    support_size: int = bounded(10, AT_LEAST_ONE)
    """S: values and rewards are categorical over the integers -S..S after h(x) = sign(x)(sqrt(|x|+1)-1) + 0.001x."""
    max_reward: float = bounded(1.0, POSITIVE)
    """The largest |reward| of one environment step: the support must hold max-reward / (1 - gamma)."""
    latent_size: int = bounded(64, AT_LEAST_ONE)
    """Width of the model's hidden state (min-max normalised to [0, 1], as MuZero's)."""
    batch_size: int = bounded(128, POSITIVE)
    """Replayed sequences per update (split over the devices)."""
    buffer_size: int = bounded(100_000, POSITIVE)
    """Replay capacity in environment steps (over every environment)."""
    learning_starts: int = bounded(1_000, NON_NEGATIVE)
    """Environment steps in the buffer before the first update."""
    value_coef: float = bounded(0.25, NON_NEGATIVE)
    """Weight of the value cross-entropy (MuZero's Atari setting)."""
    target_tau: float = bounded(0.05, Bound(0, 1, low_open=True))
    """Polyak step of the target network towards the online one, per update (1: a copy)."""

    def __post_init__(self):
        check_bounds(self)
        problem = self.support_problem() or self.sequence_problem()
        if problem:
            raise PodracerError(problem)

    def support_problem(self) -> str | None:
        """Why the value support cannot hold the returns' range, or None.

        A discounted return is at most max_reward / (1 - gamma) in size; the
        support -S..S holds values up to h^-1(S).
        """
        limit = support_limit(self.support_size)
        largest = math.inf if self.gamma >= 1.0 else self.max_reward / (1.0 - self.gamma)
        if largest <= limit:
            return None
        if math.isinf(largest):
            return ("--gamma=1 makes the returns unbounded, which no value support holds; "
                    "use --gamma below 1")
        needed = support_needed(largest)
        return (f"--support-size={self.support_size} holds values up to {limit:.1f}, but returns reach "
                f"--max-reward / (1 - --gamma) = {largest:.1f}; use --support-size={needed} or more, "
                f"or a lower --gamma")

    def sequence_problem(self) -> str | None:
        """Why the replayed sequences are too short for the unroll and its value targets, or None."""
        needed = self.unroll_steps + self.td_steps + 1
        if needed <= self.sequence_len:
            return None
        return (f"--unroll-steps={self.unroll_steps} with --td-steps={self.td_steps} needs replayed sequences "
                f"of {needed} steps, longer than --sequence-len={self.sequence_len}; raise --sequence-len "
                f"or lower --unroll-steps or --td-steps")

    def batch_problem(self, rollout_len: int, envs_per_device: int) -> str | None:
        """Anakin's layout check: any rollout feeds the buffer, so nothing to refuse here."""
        return None
