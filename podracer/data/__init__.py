"""Trajectories as RLDS datasets (tensorflow-datasets, array_record format, no TensorFlow).

    from podracer import data
    record = jax.jit(data.make_recorder(env, data.policy_act_fn(network.apply, ppo_config), 16))
    with data.DatasetWriter("/tmp/cartpole", data.step_spec_for_env(env.spec)) as writer:
        writer.add_episodes(record(train_state, key))
    episodes = data.load_episodes("/tmp/cartpole")          # padded [N, L, ...] + mask
    windows = data.load_windows("/tmp/cartpole", size=8)    # [M, 8, ...]

Importing this package needs nothing beyond podracer's own dependencies;
writing and reading need `pip install -e ".[data]"` (the distribution is `podracer-rl`).
"""

from podracer.acting import Policy, es_policy, policy_act_fn, ppo_policy
from podracer.data.config import DataConfig
from podracer.data.episodes import (EpisodeBatch, demonstrations, pad_episodes, returns_to_go,
                                    unpad_episodes, windows)
from podracer.data.reader import (check_fields, dataset_metadata, describe_steps, find_dataset_dir,
                                  iter_episodes, load_episodes, load_windows, open_dataset,
                                  read_episodes)
from podracer.data.record import make_recorder
from podracer.data.record_envpool import record_envpool
from podracer.data.spec import (EPISODE_METADATA, RLDS_STEP_FIELDS, FieldSpec, step_spec,
                                step_spec_for_env)
from podracer.data.writer import DatasetWriter

__all__ = [
    "DataConfig",
    "DatasetWriter",
    "EPISODE_METADATA",
    "EpisodeBatch",
    "FieldSpec",
    "Policy",
    "RLDS_STEP_FIELDS",
    "check_fields",
    "dataset_metadata",
    "demonstrations",
    "describe_steps",
    "es_policy",
    "find_dataset_dir",
    "iter_episodes",
    "load_episodes",
    "load_windows",
    "make_recorder",
    "open_dataset",
    "pad_episodes",
    "policy_act_fn",
    "ppo_policy",
    "read_episodes",
    "record_envpool",
    "returns_to_go",
    "step_spec",
    "step_spec_for_env",
    "unpad_episodes",
    "windows",
]
