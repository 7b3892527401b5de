"""Sebulba: environments on host CPU threads, the pure PPO update on separate learner devices.

    from podracer.sebulba import SebulbaConfig, train_ppo

Actor threads (`actor.py`) step envpool batches (`envs.py`) and assemble
trajectories (`trajectory.py`); the learner (`learner.py`) runs
`podracer.ppo.make_update` under `jit(shard_map)` over the learner devices and
publishes parameters back (`params.py`); `control.py` stops them all together.
Evolution strategies reuse the same threads, devices and controls: envpool
slots play population members (`es.py`, `es_actor.py`), driven by
`podracer.sebulba.train_es.train_es`.
"""

from podracer.sebulba.config import DeviceSplit, SebulbaConfig, SebulbaLayout, make_layout, split_devices
from podracer.sebulba.learner import make_learner_step
from podracer.sebulba.train import train_ppo
from podracer.sebulba.trajectory import Rollout, TrajectoryBuilder

__all__ = [
    "DeviceSplit",
    "Rollout",
    "SebulbaConfig",
    "SebulbaLayout",
    "TrajectoryBuilder",
    "make_layout",
    "make_learner_step",
    "split_devices",
    "train_ppo",
]
