"""SAC's state and its pure gradient step on a minibatch of transitions."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from podracer.protocol import parallel
from podracer.replay import device_share
from podracer.sac.config import SACConfig
from podracer.sac.losses import actor_loss, critic_loss, critic_target, target_entropy, temperature_loss
from podracer.sac.networks import SACNetworks


class Transitions(NamedTuple):
    """Flat transitions [N, ...], what the buffer holds: the action in (-1, 1), and the observation
    after it (the last of its episode where one ended, which a truncation bootstraps from)."""

    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    terminated: jax.Array
    next_obs: jax.Array


class SACParams(NamedTuple):
    actor: Any
    critic: Any
    target_critic: Any
    log_alpha: jax.Array  # the temperature's log: alpha = exp(log_alpha) stays positive


class SACOptStates(NamedTuple):
    """One optimizer state per learner: the three never share moments or clipping."""

    actor: Any
    critic: Any
    alpha: Any


class SACState(NamedTuple):
    """SAC's agent state: a pytree of arrays (`buffer` is the replay buffer's, `()` in a loop of one's own)."""

    params: SACParams
    opt_state: SACOptStates
    buffer: Any
    step: jax.Array  # gradient steps taken (int32)


def init_params(networks: SACNetworks, obs_shape: Sequence[int], obs_dtype, action_dim: int, key: jax.Array,
                init_alpha: float = 1.0) -> SACParams:
    actor_key, critic_key = jax.random.split(key)
    obs = jnp.zeros((1, *obs_shape), obs_dtype)
    actor = networks.actor.init(actor_key, obs)
    critic = networks.critic.init(critic_key, obs, jnp.zeros((1, action_dim), jnp.float32))
    return SACParams(actor, critic, critic, jnp.asarray(math.log(init_alpha), jnp.float32))


def init_opt_states(params: SACParams, optimizer: optax.GradientTransformation) -> SACOptStates:
    return SACOptStates(optimizer.init(params.actor), optimizer.init(params.critic),
                        optimizer.init(params.log_alpha))


def make_update(networks: SACNetworks, optimizer: optax.GradientTransformation, config: SACConfig,
                action_dim: int, axis_names: Sequence[str] = ()):
    """Build `update(state, batch, key) -> (state, metrics)`: one SAC gradient step.

    `batch` is a `Transitions` minibatch [N, ...], the same on every device of
    `axis_names` (a replicated sample of the replay buffer); each device takes
    its share of it (`podracer.replay.device_share`) and the gradients are
    averaged with `pmean`, so any device count takes the step one device would.
    The actor, the critics and the temperature each step their own optimizer
    state of `optimizer`, from gradients taken at the same parameters; the
    target critics then move `config.tau` of the way to the critics.

        from podracer import sac
        networks = sac.make_networks(obs_shape, action_dim)
        update = jax.jit(sac.make_update(networks, optax.adam(3e-4), sac.SACConfig(), action_dim))
        state, metrics = update(state, batch, key)
    """
    axis_names = tuple(axis_names)
    entropy_target = target_entropy(action_dim, config.target_entropy_per_dim)
    actor_apply, critic_apply = networks.actor.apply, networks.critic.apply

    def losses(trainable, target_critic, batch: Transitions, noise, next_noise):
        actor, critic, log_alpha = trainable
        alpha = jax.lax.stop_gradient(jnp.exp(log_alpha))
        # The target: a' ~ pi(.|s') with the current actor, valued by the target critics.
        next_action, next_log_prob = actor_apply(actor, batch.next_obs).sample_and_log_prob(next_noise)
        next_q = critic_apply(target_critic, batch.next_obs, next_action)
        target = critic_target(batch.reward, batch.terminated, next_q, jax.lax.stop_gradient(next_log_prob),
                               alpha, config.gamma)
        q = critic_apply(critic, batch.obs, batch.action)
        q_loss = critic_loss(q, target)
        # The actor through the reparameterised sample, valued by critics it cannot move.
        action, log_prob = actor_apply(actor, batch.obs).sample_and_log_prob(noise)
        pi_loss = actor_loss(log_prob, critic_apply(jax.lax.stop_gradient(critic), batch.obs, action), alpha)
        alpha_loss = temperature_loss(log_alpha, log_prob, entropy_target)
        metrics = {"critic_loss": q_loss, "actor_loss": pi_loss, "alpha_loss": alpha_loss, "alpha": alpha,
                   "entropy": -jnp.mean(log_prob), "q": jnp.mean(q)}
        # Each part's gradient reaches only its own parameters (the others are stopped above).
        return q_loss + pi_loss + alpha_loss, metrics

    grad_fn = jax.grad(losses, has_aux=True)

    def step(params, opt_state, grads):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def update(state: SACState, batch: Transitions, key: jax.Array):
        # Noise for the whole minibatch, both samples in one draw (one threefry pass, not a split and two),
        # then this device's share: the draws do not depend on the split.
        size = batch.reward.shape[0]
        noise, next_noise = jax.random.normal(key, (2, size, action_dim))
        share = device_share((batch, noise, next_noise), axis_names)
        params, opts = state.params, state.opt_state
        trainable = (params.actor, params.critic, params.log_alpha)
        grads, metrics = grad_fn(parallel.vary(trainable, axis_names), params.target_critic, *share)
        grads = parallel.pmean(grads, axis_names)
        actor, actor_opt = step(params.actor, opts.actor, grads[0])
        critic, critic_opt = step(params.critic, opts.critic, grads[1])
        log_alpha, alpha_opt = step(params.log_alpha, opts.alpha, grads[2])
        target_critic = optax.incremental_update(critic, params.target_critic, config.tau)
        new = state._replace(params=SACParams(actor, critic, target_critic, log_alpha),
                             opt_state=SACOptStates(actor_opt, critic_opt, alpha_opt), step=state.step + 1)
        return new, parallel.pmean(metrics, axis_names)

    return update
