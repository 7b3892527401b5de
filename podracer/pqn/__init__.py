"""Pure-functional PQN (parallelised Q-learning): import the update into your own loop.

    from podracer import pqn
    update = jax.jit(pqn.make_update(q_network.apply, optax.adam(1e-4), pqn.PQNConfig()))
    state, metrics = update(state, batch, bootstrap_q, key)

`batch` is a time-major `QTransition`; `make_agent` wraps the update with
epsilon-greedy acting for the architectures (`podracer.agent`).
"""

from podracer.pqn.agent import epsilon_of, make_agent
from podracer.pqn.config import PQN_FIX, PQNConfig, with_run_updates
from podracer.pqn.network import make_q_network
from podracer.pqn.policy import load_policy, policy
from podracer.pqn.targets import epsilon_at, q_lambda_targets
from podracer.pqn.update import QTransition, make_update, next_q_max
from podracer.qnetwork import QNetwork, epsilon_greedy, epsilon_greedy_log_prob, make_epsilon_act
from podracer.types import TrainState

__all__ = [
    "PQN_FIX",
    "PQNConfig",
    "QNetwork",
    "QTransition",
    "TrainState",
    "epsilon_at",
    "epsilon_greedy",
    "epsilon_greedy_log_prob",
    "epsilon_of",
    "make_agent",
    "make_epsilon_act",
    "make_q_network",
    "load_policy",
    "make_update",
    "next_q_max",
    "policy",
    "q_lambda_targets",
    "with_run_updates",
]
