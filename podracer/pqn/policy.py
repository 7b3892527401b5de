"""A PQN state as a policy: to record datasets, and for `load_policy` / `podracer eval`."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from podracer.acting import Policy, keyed_act
from podracer.pqn.config import PQNConfig
from podracer.qnetwork import make_epsilon_act


def policy(state, network, config: PQNConfig, deterministic: bool) -> Policy:
    """A trained state's policy: greedy, or epsilon-greedy at the run's final epsilon."""
    return Policy(make_epsilon_act(network.apply, config.epsilon_end, greedy=deterministic), state.params,
                  "pqn", deterministic)


def load_policy(network, config: PQNConfig, saved: dict, deterministic: bool) -> Callable:
    """`act(obs, key) -> actions` from a checkpoint's agent state (`saved`): greedy (`deterministic`) or
    epsilon-greedy, epsilon the run's final one."""
    act_fn = make_epsilon_act(network.apply, config.epsilon_end, greedy=deterministic)
    return keyed_act(act_fn, jax.tree.map(jnp.asarray, saved["params"]))
