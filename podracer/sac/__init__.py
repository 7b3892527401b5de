"""Pure-functional Soft Actor-Critic: import the gradient step into your own loop.

    from podracer import sac
    networks = sac.make_networks(obs_shape, action_dim)
    update = jax.jit(sac.make_update(networks, optax.adam(3e-4), sac.SACConfig(), action_dim))
    state, metrics = update(state, batch, key)

`make_agent` runs it on a replay buffer kept in the agent's state (Anakin).
"""

from podracer.sac.agent import load_policy, make_act, make_agent, next_observations, policy
from podracer.sac.config import SAC_FIX, SACConfig
from podracer.sac.losses import actor_loss, critic_loss, critic_target, target_entropy, temperature_loss
from podracer.sac.networks import SACNetworks, make_networks
from podracer.sac.update import (SACOptStates, SACParams, SACState, Transitions, init_opt_states, init_params,
                                 make_update)

__all__ = [
    "SAC_FIX",
    "SACConfig",
    "SACNetworks",
    "SACOptStates",
    "SACParams",
    "SACState",
    "Transitions",
    "actor_loss",
    "critic_loss",
    "critic_target",
    "init_opt_states",
    "init_params",
    "load_policy",
    "make_act",
    "make_agent",
    "make_networks",
    "make_update",
    "next_observations",
    "policy",
    "target_entropy",
    "temperature_loss",
]
