"""Sebulba: environments on host CPU threads, any agent's learning on separate learner devices.

    from podracer.sebulba import SebulbaConfig, train_agent

Actor threads (`actor.py`) step envpool batches (`envs.py`) with the agent's
`act` (`podracer.agent`), assemble its trajectories (`trajectory.py`) and
`prepare` them on their actor device; the learner (`learner.py`) runs the
agent's `learn` under `jit(shard_map)` over the learner devices and publishes
its acting state back (`params.py`); `control.py` stops them all together.
Evolution strategies run as any agent, through the same actor threads and
learner (`podracer.es.agent`: one fresh episode per environment and
generation); `podracer.sebulba.train_es.train_es` adds only what is ES's own
(sizes, stopping rule, log row, checkpoint counters, summary keys).
"""

from podracer.sebulba.config import DeviceSplit, SebulbaConfig, SebulbaLayout, make_layout, split_devices
from podracer.sebulba.learner import make_learn_step, make_learner_step
from podracer.sebulba.train import train_actor_critic, train_agent, train_ppo
from podracer.sebulba.trajectory import Collected, TrajectoryBuilder

__all__ = [
    "Collected",
    "DeviceSplit",
    "SebulbaConfig",
    "SebulbaLayout",
    "TrajectoryBuilder",
    "make_layout",
    "make_learn_step",
    "make_learner_step",
    "split_devices",
    "train_actor_critic",
    "train_agent",
    "train_ppo",
]
