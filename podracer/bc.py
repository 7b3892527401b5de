"""Behaviour cloning: fit a policy to demonstrated actions, as one pure update.

    from podracer import bc
    update = jax.jit(bc.make_bc_update(network.apply, optax.adam(1e-3), bc.BCConfig()))
    state, metrics = update(state, demonstrations, key)

`state` is the same `TrainState` PPO trains, so cloned parameters (and
observation statistics) can start a PPO run. Everything is maximised as a
log-likelihood, minimised as its negative.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from podracer.normalize import standardize
from podracer.types import TrainState


@dataclasses.dataclass(frozen=True)
class BCConfig:
    """Behaviour-cloning settings."""

    batch_size: int = 256
    """Demonstrations drawn (uniformly, with replacement) for each update."""
    value_coef: float = 0.5
    """Weight of fitting the value head to the discounted returns-to-go; 0 leaves it alone."""
    ent_coef: float = 0.0
    """Weight of an entropy bonus, which keeps the cloned policy from collapsing early."""
    normalize_observations: bool = False
    """Standardise observations with the state's `obs_stats` (as PPO does when it normalises)."""

    def __post_init__(self):
        if self.batch_size <= 0:
            raise ValueError(f"--bc-batch-size must be positive, got {self.batch_size}")
        if self.value_coef < 0 or self.ent_coef < 0:
            raise ValueError("--bc-value-coef and the entropy weight must be >= 0")


class Demonstrations(NamedTuple):
    """Flat [N, ...] demonstrated steps: what was seen, what was done, what followed."""

    obs: Any
    action: Any
    return_to_go: Any  # discounted return from this step on, the value target


def bc_loss(params, apply_fn: Callable, batch: Demonstrations, config: BCConfig
            ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Negative log-likelihood of the demonstrated actions, plus an optional value fit.

        L = -E[log pi(a|s)] + value_coef * 0.5 * E[(v(s) - G)^2] - ent_coef * E[entropy]

    with G the discounted return-to-go. `apply_fn(params, obs) -> (distribution, value)`;
    observations arrive already normalised if normalisation is on.
    """
    dist, value = apply_fn(params, batch.obs)
    log_likelihood = jnp.mean(dist.log_prob(batch.action))
    value_loss = 0.5 * jnp.mean((value - batch.return_to_go) ** 2)
    entropy = jnp.mean(dist.entropy())
    loss = -log_likelihood + config.value_coef * value_loss - config.ent_coef * entropy
    metrics = {"loss": loss, "log_likelihood": log_likelihood, "value_loss": value_loss,
               "entropy": entropy}
    return loss, metrics


def make_bc_update(apply_fn: Callable, optimizer: optax.GradientTransformation, config: BCConfig
                   ) -> Callable[[TrainState, Demonstrations, jax.Array], tuple[TrainState, dict]]:
    """Build `update(state, demonstrations, key) -> (state, metrics)`.

    The returned function is pure and jittable: it draws `config.batch_size`
    demonstrations with `key` and takes one optimiser step on `bc_loss`. Keep the
    whole (small) demonstration set on the device and scan over keys to run many
    steps in one call. `state.obs_stats` is read, never updated.
    """

    def loss_fn(params, batch):
        return bc_loss(params, apply_fn, batch, config)

    grad_fn = jax.grad(loss_fn, has_aux=True)

    def update(state: TrainState, demonstrations: Demonstrations, key: jax.Array):
        num_samples = jax.tree.leaves(demonstrations.action)[0].shape[0]
        index = jax.random.randint(key, (config.batch_size,), 0, num_samples)
        batch = jax.tree.map(lambda x: x[index], demonstrations)
        if config.normalize_observations:
            batch = batch._replace(obs=standardize(state.obs_stats, batch.obs))
        grads, metrics = grad_fn(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(params, opt_state, state.obs_stats, state.step + 1), metrics

    return update
