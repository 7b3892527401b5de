"""IMPALA as an agent (`podracer.agent.Agent`): PPO's acting and batch, the V-trace update."""

from __future__ import annotations

from typing import Any, Sequence

import optax

from podracer.agent import Agent
from podracer.ppo.agent import make_agent as make_actor_critic_agent
from podracer.vtrace.config import ImpalaConfig
from podracer.vtrace.update import make_update


def make_agent(network, optimizer: optax.GradientTransformation, config: ImpalaConfig, spec: Any,
               rollout_len: int, axis_names: Sequence[str] = (), *, num_envs: int | None = None) -> Agent:
    """IMPALA on a feed-forward actor-critic `network`; the arguments are `podracer.ppo.make_agent`'s
    (a recurrent `network` is refused: the V-trace update replays no carry)."""
    del num_envs  # an on-policy agent keeps nothing per environment
    return make_actor_critic_agent(network, optimizer, config, spec, rollout_len, axis_names, make_update)
