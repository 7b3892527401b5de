"""The pure MuZero update: one gradient step on replayed sequences, then the target network's Polyak step."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import optax

from podracer.muzero.config import MuZeroConfig
from podracer.protocol import parallel
from podracer.muzero.losses import Sequences, muzero_loss


class MuZeroState(NamedTuple):
    """Everything MuZero carries: a pytree of arrays."""

    params: Any
    target_params: Any  # the n-step value targets' bootstrap network
    opt_state: Any
    buffer: Any  # the replay's flashbax trajectory-buffer state (`podracer.replay`); () outside an agent
    step: jax.Array  # updates applied (int32 scalar)


def make_update(network, optimizer: optax.GradientTransformation, config: MuZeroConfig,
                axis_names: Sequence[str] = ()) -> Callable:
    """`update(state, sequences) -> (state, metrics)`: pure and jittable.

    `network` is a `MuZeroNetwork` (its `apply` with `method="initial"` and
    `"recurrent"`), `sequences` this device's replayed `Sequences` [N, L, ...].
    With `axis_names`, gradients and metrics are averaged over those mesh axes
    (each device holding its share of one minibatch).
    """
    axis_names = tuple(axis_names)

    def update(state: MuZeroState, sequences: Sequences):
        # Each device's gradient of its share, then their mean (`parallel.vary`: under shard_map's
        # replication check a replicated input's gradient would otherwise be summed implicitly).
        grads, metrics = jax.grad(muzero_loss, has_aux=True)(parallel.vary(state.params, axis_names),
                                                              state.target_params, network, sequences, config)
        grads, metrics = parallel.pmean((grads, metrics), axis_names)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        target_params = optax.incremental_update(params, state.target_params, config.target_tau)
        return state._replace(params=params, target_params=target_params, opt_state=opt_state,
                              step=state.step + 1), metrics

    return update
