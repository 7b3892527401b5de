"""The actor-critic algorithms every architecture runs with one driver: the update is a parameter.

PPO and IMPALA share the network, the acting function, the trajectory and the
update's signature (`make_update(apply_fn, optimizer, config, axis_names)`).
Anakin runs either through the agent contract (`make_agent`, `podracer.agent`);
Sebulba through `make_update`. Neither names the algorithm.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from podracer import ppo, vtrace
from podracer.ppo.config import PPO_FIX


class ActorCritic(NamedTuple):
    name: str  # --algo, its config section and the name its recorded datasets carry
    make_update: Callable  # make_update(apply_fn, optimizer, config, axis_names) -> update
    make_agent: Callable  # make_agent(network, optimizer, config, spec, rollout_len, axis_names) -> Agent
    fix: str  # what the NaN guard suggests


ACTOR_CRITIC: dict[str, ActorCritic] = {
    "ppo": ActorCritic("ppo", ppo.make_update, ppo.make_agent, PPO_FIX),
    "impala": ActorCritic("impala", vtrace.make_update, vtrace.make_agent, vtrace.IMPALA_FIX),
}


def actor_critic(configs: dict[str, Any]) -> tuple[ActorCritic, Any]:
    """The run's algorithm and its config section."""
    algo = configs["run"].algo
    return ACTOR_CRITIC[algo], configs[algo]
