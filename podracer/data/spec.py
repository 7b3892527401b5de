"""What one RLDS step holds, and the tensorflow-datasets features that store it.

RLDS (Ramos et al. 2021) stores an episode as a sequence of steps. Step t holds
the observation o_t, the action a_t taken on it, the reward r_t and discount d_t
that followed that action, and the flags `is_first`, `is_last`, `is_terminal`.
An episode of n transitions has n + 1 steps: the last one carries the final
observation only, so its action, reward, discount and log-probability are not
meaningful (podracer writes zeros there). `is_terminal` on the last step says the
episode reached a terminal state; `is_last` without it means it was truncated.

tensorflow-datasets is an optional dependency (`pip install -e ".[data]"`),
imported only when a dataset is written or read.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from podracer.errors import PodracerError

OBSERVATION = "observation"
ACTION = "action"
REWARD = "reward"
DISCOUNT = "discount"
IS_FIRST = "is_first"
IS_LAST = "is_last"
IS_TERMINAL = "is_terminal"
POLICY_LOG_PROB = "policy_log_prob"
STEPS = "steps"

# Fields every step of a podracer dataset has; `policy_log_prob` is podracer's own.
RLDS_STEP_FIELDS = (OBSERVATION, ACTION, REWARD, DISCOUNT, IS_FIRST, IS_LAST, IS_TERMINAL)
# What RLDS itself makes mandatory; everything else is optional in RLDS datasets.
RLDS_MANDATORY = (IS_FIRST, IS_LAST)


class FieldSpec(NamedTuple):
    """Shape (per step, or per episode for metadata) and numpy dtype of one field."""

    shape: tuple[int, ...]
    dtype: Any


# Per-episode metadata the writer adds to every episode.
EPISODE_METADATA: dict[str, FieldSpec] = {
    "episode_id": FieldSpec((), np.int64),  # order of writing, from 0
    "episode_return": FieldSpec((), np.float32),  # undiscounted sum of rewards
    "episode_length": FieldSpec((), np.int64),  # transitions: steps - 1
}


def step_spec(observation_shape: Sequence[int], observation_dtype, action_shape: Sequence[int],
              action_dtype) -> dict[str, FieldSpec]:
    """The fields of a podracer step: the RLDS ones plus `policy_log_prob`."""
    return {
        OBSERVATION: FieldSpec(tuple(observation_shape), np.dtype(observation_dtype)),
        ACTION: FieldSpec(tuple(action_shape), np.dtype(action_dtype)),
        REWARD: FieldSpec((), np.dtype(np.float32)),
        DISCOUNT: FieldSpec((), np.dtype(np.float32)),
        IS_FIRST: FieldSpec((), np.dtype(bool)),
        IS_LAST: FieldSpec((), np.dtype(bool)),
        IS_TERMINAL: FieldSpec((), np.dtype(bool)),
        POLICY_LOG_PROB: FieldSpec((), np.dtype(np.float32)),
    }


def step_spec_for_env(env_spec) -> dict[str, FieldSpec]:
    """Step fields for an Anakin `EnvSpec`: int64 discrete actions (the RLDS
    convention), float32 vectors for continuous ones."""
    if env_spec.discrete:
        action_shape, action_dtype = (), np.int64
    else:
        action_shape, action_dtype = (env_spec.action_dim,), np.float32
    return step_spec(env_spec.obs_shape, np.dtype(env_spec.obs_dtype), action_shape, action_dtype)


def import_tfds():
    """tensorflow_datasets, or a one-line error that says how to install it."""
    try:
        return importlib.import_module("tensorflow_datasets")
    except ImportError:
        raise PodracerError("datasets need tensorflow-datasets and array-record; "
                            "install them with: pip install \"podracer-rl[data]\" (or pip install -e \".[data]\" in a checkout)") from None


def tfds_features(steps: Mapping[str, FieldSpec], metadata: Mapping[str, FieldSpec] = EPISODE_METADATA):
    """The `tfds.features.FeaturesDict` of an RLDS episode: a `steps` Dataset plus metadata."""
    tfds = import_tfds()

    def tensor(spec: FieldSpec):
        return tfds.features.Tensor(shape=tuple(spec.shape), dtype=np.dtype(spec.dtype))

    return tfds.features.FeaturesDict({
        STEPS: tfds.features.Dataset({name: tensor(spec) for name, spec in steps.items()}),
        **{name: tensor(spec) for name, spec in metadata.items()},
    })
