"""A PQN state as a policy: to record datasets, and for `load_policy` / `podracer eval`."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from podracer.acting import Policy
from podracer.pqn.config import PQNConfig
from podracer.qnetwork import make_epsilon_act


def policy(state, network, config: PQNConfig, deterministic: bool) -> Policy:
    """A trained state's policy: greedy, or epsilon-greedy at the run's final epsilon."""
    return Policy(make_epsilon_act(network.apply, config.epsilon_end, greedy=deterministic), state.params,
                  "pqn", deterministic)


def load_policy(network, config: PQNConfig, saved: dict, deterministic: bool) -> Callable:
    """`act(obs, key) -> actions` from a checkpoint's agent state (`saved`)."""
    params = jax.tree.map(jnp.asarray, saved["params"])
    act_batch = make_epsilon_act(network.apply, config.epsilon_end, greedy=deterministic)

    def act(obs: jax.Array, key: jax.Array) -> jax.Array:
        """Greedy (`deterministic`) or epsilon-greedy actions, epsilon the run's final one, for obs [B, ...]."""
        return act_batch(params, obs, jax.random.split(key, obs.shape[0]))[0]

    return act
