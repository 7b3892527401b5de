"""PQN's Q-network: the layer-normed `podracer.qnetwork.QNetwork`, layer norm standing in for a target network."""

from __future__ import annotations

from podracer.errors import PodracerError
from podracer.qnetwork import QNetwork, make_q_network as make_layer_normed


def make_q_network(spec, net) -> QNetwork:
    """The Q-network for an environment's spec and the run's `NetworkConfig` (--hidden, --activation)."""
    if not spec.discrete:
        raise PodracerError("--algo=pqn picks among discrete actions; use --algo=ppo for continuous ones")
    if spec.action_mask:
        raise PodracerError("--algo=pqn does not read this environment's legal-action mask; use --algo=ppo")
    if net.network != "mlp":
        raise PodracerError(f"--network={net.network} trains with --algo=ppo only; use --network=mlp")
    return make_layer_normed(tuple(spec.obs_shape), spec.action_dim, net.hidden, net.activation, layer_norm=True)
