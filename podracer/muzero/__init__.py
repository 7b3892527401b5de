"""Pure-functional MuZero (Gumbel MuZero, searched with mctx): import the update into your own loop.

    from podracer import muzero
    network = muzero.MuZeroNetwork(action_dim=2)
    update = jax.jit(muzero.make_update(network, optax.adam(1e-3), muzero.MuZeroConfig()))
    state, metrics = update(state, sequences)  # sequences: muzero.Sequences [N, L, ...]

`make_agent` wraps it, the search and a replay of sequences into a
`podracer.agent.Agent` that Anakin runs (`--algo=muzero`).
"""

from podracer.muzero.agent import make_agent
from podracer.muzero.config import MUZERO_FIX, MuZeroConfig
from podracer.muzero.losses import Sequences, muzero_loss
from podracer.muzero.network import MuZeroNetwork
from podracer.muzero.search import SearchOutput, make_search
from podracer.muzero.targets import (inverse_value_transform, n_step_targets, scalar_to_support,
                                     support_to_scalar, two_hot, value_transform)
from podracer.muzero.update import MuZeroState, make_update

__all__ = [
    "MUZERO_FIX",
    "MuZeroConfig",
    "MuZeroNetwork",
    "MuZeroState",
    "SearchOutput",
    "Sequences",
    "inverse_value_transform",
    "make_agent",
    "make_search",
    "make_update",
    "muzero_loss",
    "n_step_targets",
    "scalar_to_support",
    "support_to_scalar",
    "two_hot",
    "value_transform",
]
