"""The pytrees every layer passes around. Arrays only; functions travel separately."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from podracer.normalize import RunningStats

Params = Any


class TrainState(NamedTuple):
    """Everything the learner updates: a pytree of arrays."""

    params: Params
    opt_state: Any
    obs_stats: RunningStats  # used only when observation normalisation is on
    step: jax.Array  # number of updates applied (int32 scalar)


class Transition(NamedTuple):
    """A time-major batch of experience: every field is [T, B, ...].

    Row t holds the observation acted on, the action, and what the environment
    answered. `final_value` is the behaviour value of the observation that ended
    the episode at row t when `truncated` (time limit); it is ignored elsewhere.
    """

    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    value: jax.Array
    log_prob: jax.Array
    final_value: jax.Array
