"""What both architectures know of an environment: its spaces.

Anakin's JAX environments (`podracer.envs.jax_envs`) and Sebulba's envpool and
Gymnasium ones (`podracer.sebulba.envs`) each describe theirs as an
`EnvSpec`, from which networks, datasets and checks are made alike.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from podracer.errors import PodracerError


class EnvSpec(NamedTuple):
    """Static description of an environment's spaces."""

    obs_shape: tuple[int, ...]
    obs_dtype: Any
    action_dim: int  # number of actions (discrete) or action dimensions (continuous)
    discrete: bool
    action_low: np.ndarray | None
    action_high: np.ndarray | None
    action_mask: bool = False  # the last `action_dim` observation entries are the legal actions (0/1)


def check_masked_inputs(spec: EnvSpec, normalize_observations: bool) -> None:
    """Refuse observation normalisation where the observation carries an action mask."""
    if spec.action_mask and normalize_observations:
        raise PodracerError("this environment's observations end with its legal-action mask, which "
                            "normalisation would distort; train it without observation normalisation (PPO's default, ES other than ARS)")
