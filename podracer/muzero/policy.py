"""A MuZero state as a policy that acts by search: to record datasets, and for `load_policy` / `podracer eval`."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from podracer.acting import Policy, keyed_act
from podracer.errors import PodracerError
from podracer.muzero.agent import sized_network
from podracer.muzero.config import MuZeroConfig
from podracer.muzero.network import MuZeroNetwork
from podracer.muzero.search import make_search


def make_network(spec: Any, net: Any) -> MuZeroNetwork:
    """The model's MLPs with `--hidden` and `--activation`; its latent and support sizes are MuZero's flags."""
    if net.network != "mlp":
        raise PodracerError(f"--algo=muzero learns a feed-forward model; drop --network={net.network} "
                            f"(use --network=mlp)")
    return MuZeroNetwork(spec.action_dim, tuple(net.hidden), activation=net.activation)


def _search_act(network, config: MuZeroConfig, deterministic: bool) -> Callable:
    """`act_fn(params, obs [B, ...], keys [B]) -> (action, log of the improved policy's weight of it)`."""
    search = make_search(sized_network(network, config), config, deterministic)

    def act_fn(params, obs, keys):
        out = search(params, obs, keys)
        weight = jnp.take_along_axis(out.action_weights, out.action[:, None], axis=1)[:, 0]
        return out.action, jnp.log(weight)

    return act_fn


def policy(state, network, config: MuZeroConfig, deterministic: bool) -> Policy:
    """A trained state's search policy; its recorded log-probability is the improved policy's."""
    return Policy(_search_act(network, config, deterministic), state.params, "muzero", deterministic)


def load_policy(network, config: MuZeroConfig, saved: dict, deterministic: bool) -> Callable:
    """`act(obs, key) -> actions` searching with a checkpoint's parameters (`saved`: its agent state)."""
    return keyed_act(_search_act(network, config, deterministic), jax.tree.map(jnp.asarray, saved["params"]))
