"""Pure-functional DQN (double Q-learning, n-step returns, a target network, a replay buffer): import the update.

    from podracer import dqn
    update = jax.jit(dqn.make_update(q_fn, optax.adam(1e-3), dqn.DQNConfig()))
    state, metrics = update(state, transitions, key)
"""

from podracer.dqn.agent import example_transition, load_policy, make_act, make_agent, policy
from podracer.dqn.config import DQN_FIX, DQNConfig
from podracer.dqn.targets import NStep, double_q_targets, nstep_transitions, td_loss
from podracer.dqn.update import DQNState, epsilon, init_state, make_loss, make_update, target_update
from podracer.qnetwork import QNetwork, make_q_network

__all__ = [
    "DQNConfig",
    "DQNState",
    "DQN_FIX",
    "NStep",
    "QNetwork",
    "double_q_targets",
    "epsilon",
    "example_transition",
    "init_state",
    "load_policy",
    "make_act",
    "make_agent",
    "make_loss",
    "make_q_network",
    "make_update",
    "nstep_transitions",
    "policy",
    "target_update",
    "td_loss",
]
