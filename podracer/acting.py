"""A trained policy as a pure act function: what an architecture hands over when training ends.

`Policy` is an `ActFn` and its first argument (its parameters): `ppo_policy`
builds one from an actor-critic `TrainState` (PPO or IMPALA), `es_policy`
from an ES search distribution's mean (`make_es_act`). Recording a dataset
(`podracer.data`) plays it; the architectures build it without knowing what
it will be used for.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from podracer.networks import initial_carry
from podracer.ppo import PPOConfig, make_act

# act_fn(params, obs [B, ...], keys [B, 2]) -> (action [B, ...], log_prob [B], ...)
ActFn = Callable[[Any, jax.Array, jax.Array], tuple]


def policy_act_fn(apply_fn: Callable, ppo_config: PPOConfig, deterministic: bool = False) -> ActFn:
    """An `act_fn` whose params are a PPO `TrainState` (its network params and
    observation statistics). `deterministic` takes the distribution's mode; the
    log-probability recorded is still that of the stochastic policy."""
    act = make_act(apply_fn, ppo_config, deterministic)

    def act_fn(state, obs, keys):
        action, log_prob, _ = act(state.params, state.obs_stats, obs, keys)
        return action, log_prob

    return act_fn


class Policy(NamedTuple):
    """A policy to record: `act_fn(params, obs, keys)`, and how the dataset's metadata names it."""

    act_fn: ActFn
    params: Any  # act_fn's first argument: a pytree of arrays (host, device or global)
    name: str  # metadata.json's "policy": "ppo", "impala" or "es"
    deterministic: bool  # metadata.json's "deterministic"


def keyed_act(act_fn: ActFn, params: Any) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """`act(obs [B, ...], key) -> actions` of `act_fn(params, obs, keys [B])`, each observation its own key:
    what an algorithm's `load_policy` returns from a checkpoint's parameters."""

    def act(obs: jax.Array, key: jax.Array) -> jax.Array:
        return act_fn(params, obs, jax.random.split(key, obs.shape[0]))[0]

    return act


def ppo_policy(train_state, apply_fn: Callable, ppo_config: PPOConfig,
               deterministic: bool = False, name: str = "ppo") -> Policy:
    """An actor-critic `TrainState`'s policy (`policy_act_fn`): a sampled action, or the most likely one.

    `name` is the algorithm that trained it (PPO or IMPALA: the same actor-critic).
    """
    return Policy(policy_act_fn(apply_fn, ppo_config, deterministic), train_state, name,
                  deterministic)


def es_policy(mean, obs_stats, es_config, net, spec) -> Policy:
    """The ES search distribution's `mean` acting as its evaluation episodes do.

    `podracer.policy.make_es_act`: the flat mean unravelled into the
    `make_policy_network` params of `net` and `spec`; ARS V2 reads observations
    through the run's `obs_stats` (`es.RunningStats`). The policy is
    deterministic, so the recorded `policy_log_prob` is 0 (log 1) on every step.
    """
    act = make_es_act(es_config, net, spec)

    def act_fn(params, obs, keys):
        del keys  # deterministic
        mean, obs_stats = params
        return act(mean, obs_stats, obs), jnp.zeros(obs.shape[0], jnp.float32)

    return Policy(act_fn, (mean, obs_stats), "es", True)


def make_es_act(es_config, net, spec) -> Callable:
    """`act(mean, obs_stats, obs) -> actions`: an ES policy acting as it was evaluated.

    `mean` is a flat parameter vector of `make_policy_network` (the search
    distribution's mean, or any member), `obs` a batch [B, ...] as the run's
    environment yields it. ARS V2 (`es_config.normalize_observations`) reads the
    observations through `es.ars_normalize(obs_stats, .)`; the other variants ignore
    `obs_stats`. The policy is deterministic: it takes no key.
    """
    from jax.flatten_util import ravel_pytree

    from podracer import es
    from podracer.networks import make_policy_network

    policy = make_policy_network(spec.obs_shape, spec.action_dim, spec.discrete, net.hidden,
                                 net.activation, spec.action_mask)
    # Only the structure matters: the mean's values replace these.
    shapes = jax.eval_shape(policy.init, jax.random.PRNGKey(0), jnp.zeros(spec.obs_shape, spec.obs_dtype))
    unravel = ravel_pytree(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))[1]

    def act(mean: jax.Array, obs_stats, obs: jax.Array) -> jax.Array:
        params = unravel(mean)
        if es_config.normalize_observations:
            flat = obs.reshape(obs.shape[0], -1)
            obs = es.ars_normalize(obs_stats, flat).reshape(obs.shape)
        return jax.vmap(lambda o: policy.apply(params, o))(obs)

    return act


class RecurrentPolicy:
    """A recurrent run's policy: `act(obs, key, carry, reset=None) -> (actions, carry)`, pure and jittable.

    `carry` is the policy's state before `obs` (start from `initial_carry(B)`);
    `reset` ([B] bool, optional) zeroes it first where an episode starts at
    `obs`. Pass the returned carry to the next call.
    """

    def __init__(self, network, act_batch: Callable, params, obs_stats: RunningStats):
        self._network, self._act, self._params, self._obs_stats = network, act_batch, params, obs_stats

    def initial_carry(self, batch_size: int):
        return initial_carry(self._network, batch_size)

    def __call__(self, obs: jax.Array, key: jax.Array, carry, reset: jax.Array | None = None):
        keys = jax.random.split(key, obs.shape[0])
        reset = jnp.zeros(obs.shape[:1], bool) if reset is None else reset
        action, _, _, carry = self._act(self._params, self._obs_stats, obs, keys, carry, reset)
        return action, carry
